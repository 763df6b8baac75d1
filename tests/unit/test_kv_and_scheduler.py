"""Block pool, KV cache manager and scheduler: pure logic, no model, no torch."""

from __future__ import annotations

import sys

import pytest

from pdserve.config import EngineArgs
from pdserve.kv.block_pool import BlockPool, hash_block
from pdserve.kv.manager import KVCacheManager
from pdserve.request import Request
from pdserve.sched.scheduler import Scheduler
from pdserve.types import RequestStatus, SamplingParams

BS = 4


def make_request(rid: str, num_prompt: int = 6, max_tokens: int = 4, start: int = 10, **kw):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, **kw)
    prompt = list(range(start, start + num_prompt))
    return Request(rid, prompt, params, max_tokens, eos_token_ids=(2,))


def make_scheduler(num_blocks=16, budget=64, max_seqs=8, caching=True, chunked=True, max_len=128):
    kv = KVCacheManager(num_blocks, BS, caching)
    args = EngineArgs(
        model="m",
        max_num_batched_tokens=budget,
        max_num_seqs=max_seqs,
        enable_chunked_prefill=chunked,
    )
    return Scheduler(args.scheduler_config(max_len), kv)


def run_step(sched: Scheduler, token: int = 7):
    plan = sched.schedule()
    sampled = [token for s in plan.scheduled if s.sample]
    return plan, sched.update(plan, sampled)


def test_sched_and_kv_import_no_torch():
    import subprocess

    code = (
        "import sys, pdserve.sched.scheduler, pdserve.kv.manager, pdserve.types;"
        "sys.exit(int('torch' in sys.modules))"
    )
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_block_pool_allocates_lru_and_keeps_cached_blocks_until_needed():
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    pool.cache(a, b"h-a")
    pool.free([b, a])  # tail first
    assert pool.num_free_blocks == 4
    assert pool.lookup(b"h-a") is a
    # Uncached blocks go out first; the cached block survives until the pool is exhausted.
    got = pool.allocate(3)
    assert a not in got and pool.lookup(b"h-a") is a
    (last,) = pool.allocate(1)
    assert last is a and pool.lookup(b"h-a") is None


def test_block_pool_double_free_is_an_error():
    pool = BlockPool(2)
    (a,) = pool.allocate(1)
    pool.free([a])
    with pytest.raises(RuntimeError, match="freed twice"):
        pool.free([a])


def test_hash_chain_depends_on_parent():
    assert hash_block(None, [1, 2]) != hash_block(b"x", [1, 2])
    assert hash_block(None, [1, 2]) == hash_block(None, [1, 2])


def test_prefill_then_decode_counts_tokens_and_finishes_on_length():
    sched = make_scheduler()
    req = make_request("a", num_prompt=6, max_tokens=3)
    sched.add_request(req)
    plan, outs = run_step(sched)
    assert plan.num_prefill_tokens == 6 and plan.num_decode_tokens == 0
    assert req.num_computed_tokens == 6 and req.output_token_ids == [7]
    plan, _ = run_step(sched)
    assert plan.num_decode_tokens == 1
    _, outs = run_step(sched)
    assert outs[0].finish_reason == "length"
    assert req.status == RequestStatus.FINISHED_LENGTH
    sched.kv.pool.check_whole()


def test_chunked_prefill_splits_by_budget_and_decodes_go_first():
    sched = make_scheduler(budget=8)
    a = make_request("a", num_prompt=4, max_tokens=10)
    sched.add_request(a)
    run_step(sched)  # a prefilled, now decoding
    b = make_request("b", num_prompt=20, max_tokens=2, start=100)
    sched.add_request(b)
    plan, _ = run_step(sched)
    assert [(s.request.request_id, s.num_new_tokens) for s in plan.scheduled] == [
        ("a", 1),
        ("b", 7),
    ]
    assert not plan.scheduled[1].sample
    plan, _ = run_step(sched)
    assert [s.num_new_tokens for s in plan.scheduled] == [1, 7]
    plan, _ = run_step(sched)
    assert [s.num_new_tokens for s in plan.scheduled] == [1, 6]
    assert plan.scheduled[1].sample and b.num_output_tokens == 1


def test_no_chunking_waits_for_room():
    sched = make_scheduler(budget=8, chunked=False)
    a, b = make_request("a", num_prompt=6), make_request("b", num_prompt=6, start=50)
    sched.add_request(a)
    sched.add_request(b)
    plan, _ = run_step(sched)
    assert [s.request.request_id for s in plan.scheduled] == ["a"]


def test_max_num_seqs_limits_running():
    sched = make_scheduler(max_seqs=2)
    for i in range(3):
        sched.add_request(make_request(f"r{i}", start=20 * i))
    plan, _ = run_step(sched)
    assert len(plan.scheduled) == 2 and len(sched.waiting) == 1


def test_prefix_hit_skips_cached_blocks_and_counts():
    sched = make_scheduler()
    a = make_request("a", num_prompt=10, max_tokens=1)
    sched.add_request(a)
    run_step(sched)
    b = make_request("b", num_prompt=10, max_tokens=1)
    sched.add_request(b)
    plan, _ = run_step(sched)
    assert b.num_cached_tokens == 8  # two full blocks of 4
    assert plan.scheduled[0].num_new_tokens == 2
    assert sched.kv.stats.hits == 8 and sched.kv.stats.queries == 20
    sched.kv.pool.check_whole()


def test_full_prompt_hit_still_computes_last_token():
    sched = make_scheduler()
    sched.add_request(make_request("a", num_prompt=8, max_tokens=1))
    run_step(sched)
    b = make_request("b", num_prompt=8, max_tokens=1)
    sched.add_request(b)
    plan, _ = run_step(sched)
    assert b.num_cached_tokens == 4 and plan.scheduled[0].num_new_tokens == 4


def test_same_step_requests_share_prompt_blocks():
    sched = make_scheduler()
    a, b = make_request("a", num_prompt=9), make_request("b", num_prompt=9)
    sched.add_request(a)
    sched.add_request(b)
    plan, _ = run_step(sched)
    assert [s.num_new_tokens for s in plan.scheduled] == [9, 1]
    assert sched.kv.block_ids("a")[:2] == sched.kv.block_ids("b")[:2]


def test_prefix_caching_off_never_hits():
    sched = make_scheduler(caching=False)
    for rid in ("a", "b"):
        sched.add_request(make_request(rid, num_prompt=10, max_tokens=1))
        run_step(sched)
    assert sched.kv.stats.hits == 0


def test_preemption_of_newest_when_blocks_run_out_then_recompute():
    sched = make_scheduler(num_blocks=4, max_len=64)  # 16 token slots
    a = make_request("a", num_prompt=7, max_tokens=8)
    b = make_request("b", num_prompt=7, max_tokens=8, start=40)
    sched.add_request(a)
    sched.add_request(b)
    run_step(sched)  # both prefilled: 2 blocks each, pool full
    run_step(sched)  # both decode token 8: still 2 blocks each
    plan, _ = run_step(sched)  # a needs a 3rd block for token 9: b (newest) is preempted
    assert plan.num_preempted == 1 and sched.num_preemptions == 1
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert sched.waiting[0] is b
    while sched.has_unfinished:
        run_step(sched)
    assert a.num_output_tokens == 8 and b.num_output_tokens == 8
    assert b.metrics.num_preemptions >= 1
    sched.kv.pool.check_whole()


def test_eos_and_stop_token_and_min_tokens():
    sched = make_scheduler()
    a = make_request("a", max_tokens=5)
    sched.add_request(a)
    _, outs = run_step(sched, token=2)  # EOS
    assert outs[0].finish_reason == "stop"
    b = make_request("b", max_tokens=5, stop_token_ids=[9])
    sched.add_request(b)
    _, outs = run_step(sched, token=9)
    assert outs[0].finish_reason == "stop" and outs[0].stop_reason == 9
    c = make_request("c", max_tokens=5, min_tokens=2)
    sched.add_request(c)
    _, outs = run_step(sched, token=2)
    assert outs[0].finish_reason is None  # EOS ignored before min_tokens
    d = make_request("d", max_tokens=3, ignore_eos=True)
    sched.add_request(d)
    for _ in range(3):
        _, outs = run_step(sched, token=2)
    assert d.num_output_tokens == 3 and d.status == RequestStatus.FINISHED_LENGTH


def test_abort_waiting_and_running_returns_blocks():
    sched = make_scheduler(max_seqs=1)
    a, b = make_request("a"), make_request("b", start=60)
    sched.add_request(a)
    sched.add_request(b)
    run_step(sched)
    ended = sched.finish_requests(["a", "b", "missing"], RequestStatus.FINISHED_ABORTED)
    assert {r.request_id for r in ended} == {"a", "b"}
    assert not sched.has_unfinished
    sched.kv.pool.check_whole()
