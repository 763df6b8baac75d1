"""Speculative decoding end to end: greedy outputs identical to decoding one token at a time, in
every engine mode, for prompt lookup and both drafts (the model's own first layers, a draft
model with its own KV cache), with proposals really made and (on the trained model) really
accepted; grammars, penalties, min_tokens, logprobs and seeds give what plain decoding gives;
every KV block returned. Sampled speculation's distribution is tested in tests/unit/test_spec.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.torch import load_file, save_file

from pdserve import LLM, SamplingParams
from pdserve.structured import spec as grammars

ARCHS = ["llama", "qwen2", "qwen3", "mistral"]
MODES = {
    "batched": {},
    "chunked_prefill": {"max_num_batched_tokens": 16},
    "tiny_kv_preemption": {"num_kv_blocks": 14, "block_size": 8, "max_num_batched_tokens": 64},
    "prefix_cache": {"block_size": 4},
}
# Not adaptive: on these tiny models a plain step is so cheap that the adaptive rule would turn
# speculation off, and these tests are about its correctness.
SPEC = {"speculative_method": "ngram", "num_speculative_tokens": 3, "speculative_ngram_min": 1,
        "speculative_adaptive": False}  # fmt: skip
DRAFT = {"speculative_method": "draft", "num_speculative_tokens": 3, "speculative_adaptive": False}


def first_layers(src: str, dst: Path, n: int) -> str:
    """A draft model folder: the first `n` layers of `src` (its embeddings, norm and head)."""
    if dst.exists():
        return str(dst)
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors"))
    cfg = json.loads((dst / "config.json").read_text())
    cfg["num_hidden_layers"] = n
    (dst / "config.json").write_text(json.dumps(cfg))
    for f in Path(src).glob("*.safetensors"):
        kept = {k: v for k, v in load_file(f).items()
                if not k.startswith("model.layers.") or int(k.split(".")[2]) < n}  # fmt: skip
        save_file(kept, dst / f.name)
    return str(dst)


def repetitive_prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    """Prompts whose tokens recur (a random model continues them with ids it has seen, now and
    then), of mixed lengths."""
    rng = np.random.default_rng(seed)
    out = []
    for n, period in ((12, 3), (40, 5), (7, 2), (25, 4)):
        motif = rng.integers(3, vocab, period).tolist()
        out.append((motif * (n // period + 1))[:n])
    return out


# llama in every mode in the default run; the other architectures in the slow suite (the
# default run is bounded, and the drafts below cover them batched)
SPEC_ARCHS = ["llama", *(pytest.param(a, marks=pytest.mark.slow) for a in ARCHS[1:])]


@pytest.mark.parametrize("arch", SPEC_ARCHS)
@pytest.mark.parametrize("mode", list(MODES))
def test_greedy_speculation_is_token_for_token_plain_decoding(arch, mode, tiny_models):
    kw = MODES[mode]
    plain = LLM(tiny_models[arch], **kw)
    spec = LLM(tiny_models[arch], **kw, **SPEC)
    prompts = repetitive_prompts(plain.engine.core.model_config.vocab_size)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    if mode == "prefix_cache":  # the second pass hits the cache with speculated blocks
        spec.generate(prompts, params)
    want = [o.token_ids for o in plain.generate(prompts, params)]
    outs = spec.generate(prompts, params)
    assert [o.token_ids for o in outs] == want
    assert all(len(o.token_ids) == 24 for o in outs)  # never past max_tokens
    assert sum(o.metrics.num_spec_proposed for o in outs) > 0
    if mode == "tiny_kv_preemption":
        assert spec.engine.core.scheduler.num_preemptions > 0
    spec.engine.core.kv.pool.check_whole()


def test_the_trained_model_accepts_proposals_and_stays_exact(stories_path, stories_reference_text):
    """stories260K retelling its own reference story: proposals are accepted (several tokens per
    step), outputs equal plain greedy decoding, stop strings and n > 1 included."""
    plain = LLM(stories_path)
    spec = LLM(stories_path, speculative_method="ngram", speculative_adaptive=False)
    text = stories_reference_text[:400]
    params = SamplingParams(temperature=0, max_tokens=150, ignore_eos=True)
    a, b = plain.generate([text], params)[0], spec.generate([text], params)[0]
    assert b.token_ids == a.token_ids
    m = b.metrics
    assert m.num_spec_accepted > 0 and m.num_spec_accepted <= m.num_spec_proposed
    stop = SamplingParams(temperature=0, max_tokens=150, stop=["park"], n=2)
    a, b = plain.generate([text], stop)[0], spec.generate([text], stop)[0]
    assert [c.text for c in b.outputs] == [c.text for c in a.outputs]
    assert [c.finish_reason for c in b.outputs] == [c.finish_reason for c in a.outputs]
    spec.engine.core.kv.pool.check_whole()


@pytest.mark.slow  # seconds of its own: the default run stays short
def test_sampled_speculation_runs_and_a_seed_gives_plain_samplings_tokens(stories_path):
    plain = LLM(stories_path)
    prompt = "Once upon a time, there was a little girl. Once upon a time, there was a"
    seeded = SamplingParams(temperature=0.8, max_tokens=60, seed=3, ignore_eos=True)
    want = plain.generate([prompt], seeded)[0].token_ids
    for kw in (SPEC, {**DRAFT, "draft_layers": 4}):
        spec = LLM(stories_path, **kw)
        params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=60, ignore_eos=True)
        outs = spec.generate([prompt] * 4, params)
        assert all(len(o.token_ids) == 60 for o in outs)
        assert sum(o.metrics.num_spec_proposed for o in outs) > 0
        # a seeded request draws what plain sampling draws: the same tokens, batched or not
        got = spec.generate([prompt, prompt + " big"], seeded)
        assert got[0].token_ids == want and got[0].metrics.num_spec_accepted > 0
        spec.engine.core.kv.pool.check_whole()


@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_stateful_sampling_speculates_and_equals_plain_decoding(
    proposer, stories_path, stories_reference_text
):
    """Penalties, min_tokens, grammars and logprobs: each verified position is constrained as
    plain sampling constrains it, so the tokens (and their logprobs) are plain decoding's."""
    kw = SPEC if proposer == "ngram" else {**DRAFT, "draft_layers": 4}
    plain, spec = LLM(stories_path), LLM(stories_path, **kw)
    text = stories_reference_text[:300]
    cases = [
        SamplingParams(temperature=0, max_tokens=80, logprobs=3),
        SamplingParams(
            temperature=0,
            max_tokens=80,
            repetition_penalty=1.3,
            frequency_penalty=0.2,
            presence_penalty=0.1,
        ),
        SamplingParams(temperature=0, max_tokens=80, min_tokens=40),
        SamplingParams(
            temperature=0, max_tokens=60, grammar=grammars.regex_grammar(r"( [a-z]+[,.]?){3,40}")
        ),
        SamplingParams(
            temperature=0.9,
            max_tokens=60,
            seed=11,
            logprobs=2,
            ignore_eos=True,
            repetition_penalty=1.1,
        ),
    ]
    proposed = 0
    for params in cases:
        a, b = plain.generate([text], params)[0], spec.generate([text], params)[0]
        assert b.token_ids == a.token_ids, params
        if params.logprobs is not None:
            for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
                assert x.token_id == y.token_id
                assert y.logprob == pytest.approx(x.logprob, abs=1e-4)
                assert [t for t, _ in y.top] == [t for t, _ in x.top]
        proposed += b.metrics.num_spec_proposed
    assert proposed > 0
    spec.engine.core.kv.pool.check_whole()


# both drafts in every mode on llama (the draft model's unbatched modes in the slow suite),
# self-speculation batched on the other architectures in the slow suite (the modes themselves
# are covered for every architecture by prompt lookup above)
DRAFT_CASES = [
    ("llama", d, m) if d == "layers" or m == "batched"
    else pytest.param("llama", d, m, marks=pytest.mark.slow)  # the default run is bounded
    for d in ("layers", "model") for m in MODES
] + [pytest.param(a, "layers", "batched", marks=pytest.mark.slow) for a in ARCHS[1:]]  # fmt: skip


@pytest.mark.parametrize(("arch", "draft", "mode"), DRAFT_CASES)
def test_a_draft_speculates_losslessly_in_every_mode(arch, draft, mode, tiny_models, tmp_path):
    """Self-speculation shares the target's KV of its layers; a draft model keeps its own cache
    (filled lazily, restarted after a preemption): both leave greedy decoding unchanged."""
    path, kw = tiny_models[arch], MODES[mode]
    how = {"draft_layers": 1} if draft == "layers" else {
        "draft_model": first_layers(tiny_models[arch], tmp_path / "draft", 1)}  # fmt: skip
    plain = LLM(path, **kw)
    spec = LLM(path, **kw, **DRAFT, **how)
    prompts = repetitive_prompts(plain.engine.core.model_config.vocab_size)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    if mode == "prefix_cache":
        spec.generate(prompts, params)
    outs = spec.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain.generate(prompts, params)]
    assert sum(o.metrics.num_spec_proposed for o in outs) > 0
    if mode == "tiny_kv_preemption":
        assert spec.engine.core.scheduler.num_preemptions > 0
    spec.engine.core.kv.pool.check_whole()


@pytest.mark.slow  # seconds of its own: the default run stays short
def test_a_draft_model_of_the_first_layers_proposes_what_self_speculation_does(
    stories_path, tmp_path
):
    """The draft model's own cache holds what the target's first layers hold: a folder with
    those layers accepts exactly as many proposals as `--draft-layers`; its KV counts against
    the cache memory; a draft with another vocabulary is refused."""
    prompt = "Once upon a time, there was a little girl named Lily."
    params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    folder = first_layers(stories_path, tmp_path / "draft3", 3)
    by_layers = LLM(stories_path, **DRAFT, draft_layers=3).generate([prompt] * 2, params)
    model = LLM(stories_path, **DRAFT, draft_model=folder, kv_cache_memory="4MiB")
    by_model = model.generate([prompt] * 2, params)
    assert [o.token_ids for o in by_model] == [o.token_ids for o in by_layers]
    got = [(o.metrics.num_spec_proposed, o.metrics.num_spec_accepted) for o in by_model]
    assert got == [(o.metrics.num_spec_proposed, o.metrics.num_spec_accepted) for o in by_layers]
    assert all(a > 0 for _, a in got)
    runner = model.engine.core.runner
    per_block = runner.kv_bytes_per_block * (1 + 3 / 5)  # the draft: 3 of the 5 layers
    assert runner.num_blocks == int(4 * 2**20 // per_block)
    other = tmp_path / "other"
    shutil.copytree(folder, other)
    cfg = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**cfg, "vocab_size": 256}))
    with pytest.raises(ValueError, match="vocabulary has 256 tokens"):
        LLM(stories_path, **DRAFT, draft_model=str(other))
    with pytest.raises(ValueError, match="draft_layers=5"):
        LLM(stories_path, **DRAFT, draft_layers=5)
    with pytest.raises(ValueError, match="exactly one of draft_model and draft_layers"):
        LLM(stories_path, speculative_method="draft")
