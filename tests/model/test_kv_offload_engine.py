"""The offload tiers end to end on real engines: greedy outputs identical with and without a tier
after eviction and reload and after preemption and resume, for the host tier, the disk tier and
both stacked; two engines sharing prefixes through one host arena; the disk tier found again
after a restart; corrupt and missing entries recomputed; every KV block returned."""

from __future__ import annotations

import os

import numpy as np
import pytest

from pdserve import LLM, SamplingParams
from pdserve.ipc.channel import SHM_DIR_ENV

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
# A pool of 24 blocks of 8 tokens (192 tokens) cannot hold the 6 sessions of ~90 tokens: a
# returning session finds its history evicted from the pool.
SMALL_POOL = {"num_kv_blocks": 24, "block_size": 8, "max_num_seqs": 2}
ALWAYS = {"kv_offload_reload": "always"}  # these tiny models recompute faster than they load


def sessions(vocab: int, n: int = 6, seed: int = 0) -> list[list[int]]:
    """Two turns of each of `n` sessions: turn 1 of all, then turn 2 (turn 1 + a question)."""
    rng = np.random.default_rng(seed)
    first = [rng.integers(3, vocab, 80).tolist() for _ in range(n)]
    second = [p + rng.integers(3, vocab, 9).tolist() for p in first]
    return first + second


def run_one_by_one(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [llm.generate([p], GREEDY)[0].outputs[0].token_ids for p in prompts]


def finish(llm: LLM):
    core = llm.engine.core
    core.kv.pool.check_whole()
    if core.kv.tier is not None:
        assert core.kv.tier.flush()
    return core


@pytest.fixture(scope="module")
def reference(stories_path) -> list[list[int]]:
    llm = LLM(stories_path, **SMALL_POOL)
    prompts = sessions(llm.engine.core.model_config.vocab_size)
    outs = run_one_by_one(llm, prompts)
    assert finish(llm).kv.stats.hits == 0  # no tier: every returning turn was recomputed
    return outs


def tiers(kind: str, tmp_path) -> tuple[str, ...]:
    return {
        "cpu": ("cpu:64MiB",),
        "disk": (f"disk:{tmp_path / 'kv'}:64MiB",),
        # a host tier of a few blocks: most entries are handed down to disk and read from there
        "cpu+disk": ("cpu:40KiB", f"disk:{tmp_path / 'kv'}:64MiB"),
    }[kind]


@pytest.mark.parametrize("kind", ["cpu", "disk", "cpu+disk"])
def test_returning_turns_load_their_history_and_answer_the_same(
    kind, stories_path, reference, tmp_path
):
    llm = LLM(stories_path, **SMALL_POOL, kv_offload=tiers(kind, tmp_path), **ALWAYS)
    prompts = sessions(llm.engine.core.model_config.vocab_size)
    assert run_one_by_one(llm, prompts) == reference
    core = finish(llm)
    st = core.kv.tier.state()
    # every returning turn found its 80-token history (10 blocks) in a tier
    assert core.kv.stats.tier_hits == 6 * 80
    assert st.loaded_blocks == 60 and st.saved_blocks > 0
    if kind == "cpu+disk":
        cpu, disk = st.tiers
        assert cpu.evicted > 0 and disk.stored > 0 and disk.hits > 0


def test_auto_reload_recomputes_when_that_is_faster(stories_path, reference):
    """stories260K prefills a block faster than it reads one back, once both are measured: the
    rule then recomputes, with the same answers."""
    llm = LLM(stories_path, **SMALL_POOL, kv_offload=("cpu:64MiB",))
    cost = llm.engine.core.kv.tier.cost
    cost.observe_load(1, 1.0)  # as if the tier read a byte a second
    cost.observe_prefill(10**6, 1.0)
    prompts = sessions(llm.engine.core.model_config.vocab_size)
    assert run_one_by_one(llm, prompts) == reference
    assert finish(llm).kv.stats.tier_hits == 0


def test_a_preempted_request_resumes_from_the_tier(stories_path):
    """A pool too small for both long generations: one is preempted, its blocks are evicted to
    the tier, and it resumes by loading them; the tokens equal an unpreempted run."""
    params = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 500, 40).tolist() for _ in range(2)]
    big = LLM(stories_path, block_size=8)
    want = [o.outputs[0].token_ids for o in big.generate(prompts, params)]
    small = LLM(stories_path, num_kv_blocks=30, block_size=8, kv_offload=("cpu:64MiB",), **ALWAYS)
    outs = small.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == want
    core = finish(small)
    assert core.scheduler.num_preemptions > 0
    assert core.kv.tier.swap_ins > 0 and core.kv.stats.tier_hits > 0


def test_two_engines_share_a_prefix_through_one_host_arena(stories_path, tmp_path, monkeypatch):
    monkeypatch.setenv(SHM_DIR_ENV, str(tmp_path))  # as a server's workers see it
    a = LLM(stories_path, **SMALL_POOL, kv_offload=("cpu:64MiB",), **ALWAYS)
    b = LLM(stories_path, **SMALL_POOL, kv_offload=("cpu:64MiB",), **ALWAYS)
    (arena,) = [p for p in os.listdir(tmp_path) if p.startswith("kvtier-")]
    assert os.stat(tmp_path / arena).st_mode & 0o777 == 0o600
    prompts = sessions(a.engine.core.model_config.vocab_size)
    first, second = prompts[:6], prompts[6:]
    run_one_by_one(a, first)
    # a pushes its sessions out of its pool into the arena, then b answers the returning turns
    run_one_by_one(a, sessions(a.engine.core.model_config.vocab_size, seed=1)[:6])
    assert finish(a).kv.tier.flush()
    outs_b = run_one_by_one(b, second)
    assert finish(b).kv.stats.tier_hits >= 6 * 80 - 8 * 6  # most of each history
    fresh = LLM(stories_path, **SMALL_POOL)
    assert outs_b == run_one_by_one(fresh, second)


def test_the_disk_tier_is_found_after_a_restart_and_corrupt_entries_are_recomputed(
    stories_path, reference, tmp_path
):
    spec = (f"disk:{tmp_path / 'kv'}:64MiB",)
    first = LLM(stories_path, **SMALL_POOL, kv_offload=spec, **ALWAYS)
    prompts = sessions(first.engine.core.model_config.vocab_size)
    run_one_by_one(first, prompts[:6])
    run_one_by_one(first, sessions(512, seed=1)[:6])  # evicts all six histories to disk
    finish(first)
    del first
    restarted = LLM(stories_path, **SMALL_POOL, kv_offload=spec, **ALWAYS)
    assert run_one_by_one(restarted, prompts[6:]) == reference[6:]
    assert finish(restarted).kv.stats.tier_hits == 6 * 80

    (layout_dir,) = [d for d in (tmp_path / "kv").iterdir() if d.is_dir()]
    files = sorted(layout_dir.glob("*.kv"))
    for i, f in enumerate(files):  # truncate, flip a byte, or delete each entry
        if i % 3 == 0:
            f.write_bytes(f.read_bytes()[:100])
        elif i % 3 == 1:
            data = bytearray(f.read_bytes())
            data[-5] ^= 0x10
            f.write_bytes(bytes(data))
        else:
            f.unlink()
    broken = LLM(stories_path, **SMALL_POOL, kv_offload=spec, **ALWAYS)
    assert run_one_by_one(broken, prompts[6:]) == reference[6:]
    core = finish(broken)
    (disk,) = core.kv.tier.state().tiers
    assert disk.misses.get("corrupt", 0) > 0  # the truncated and altered files
    assert core.kv.stats.tier_hits == 0  # every history was broken: all recomputed


def test_another_model_never_reads_these_entries(stories_path, tiny_models, tmp_path):
    spec = (f"disk:{tmp_path / 'kv'}:64MiB",)
    llm = LLM(stories_path, **SMALL_POOL, kv_offload=spec, **ALWAYS)
    run_one_by_one(llm, sessions(512)[:6])
    run_one_by_one(llm, sessions(512, seed=1)[:6])
    finish(llm)
    other = LLM(tiny_models["llama"], **SMALL_POOL, kv_offload=spec, **ALWAYS)
    run_one_by_one(other, sessions(512)[6:])
    assert finish(other).kv.stats.tier_hits == 0
    assert len([d for d in (tmp_path / "kv").iterdir() if d.is_dir()]) == 2


def test_tiers_keep_to_their_size(stories_path, reference, tmp_path):
    """A host tier of 3 blocks and a disk tier of 12: both full after the run, never over, and
    the answers unchanged (what fell off the end is recomputed)."""
    probe = LLM(stories_path, **SMALL_POOL)
    block = probe.engine.core.runner.kv_bytes_per_block
    spec = (f"cpu:{3 * block}", f"disk:{tmp_path / 'kv'}:{12 * (block + 64)}")
    llm = LLM(stories_path, **SMALL_POOL, kv_offload=spec, **ALWAYS)
    prompts = sessions(llm.engine.core.model_config.vocab_size)
    assert run_one_by_one(llm, prompts) == reference
    core = finish(llm)
    cpu, disk = core.kv.tier.tiers
    assert cpu.num_slots == 3 and cpu.used_bytes() == cpu.capacity_bytes
    (layout_dir,) = [d for d in (tmp_path / "kv").iterdir() if d.is_dir()]
    assert len(list(layout_dir.glob("*.kv"))) == 12 == disk.used_bytes() // disk.entry_bytes
    assert disk.stats.evicted > 0 and cpu.stats.evicted > 0
