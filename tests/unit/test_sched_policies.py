"""Scheduling policies: priority order with aging, prefill-first chunks, KV kept for running
requests, the preemption victim under priorities, and priority preemption (no torch)."""

from __future__ import annotations

import time

import pytest

from pdserve.config import EngineArgs
from pdserve.kv.manager import KVCacheManager
from pdserve.request import Request
from pdserve.sched.scheduler import Scheduler
from pdserve.types import RequestStatus, SamplingParams

BS = 4


def make_request(rid, num_prompt=6, max_tokens=4, start=10, priority=0, arrival=None):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, priority=priority)
    prompt = list(range(start, start + num_prompt))
    kw = {} if arrival is None else {"arrival_time": arrival}
    return Request(rid, prompt, params, max_tokens, eos_token_ids=(2,), **kw)


def make_scheduler(num_blocks=64, budget=64, max_seqs=8, **settings):
    args = EngineArgs(model="m", max_num_batched_tokens=budget, max_num_seqs=max_seqs, **settings)
    return Scheduler(args.scheduler_config(512), KVCacheManager(num_blocks, BS))


def step(sched: Scheduler):
    plan = sched.schedule()
    sched.update(plan, [7 for s in plan.scheduled if s.sample])
    return {s.request.request_id: s.num_new_tokens for s in plan.scheduled}


def admitted_order(sched: Scheduler, requests) -> list[str]:
    for r in requests:
        sched.add_request(r)
    order = []
    while sched.waiting:
        for rid in step(sched):
            if rid not in order:
                order.append(rid)
    return order


def test_lower_priority_value_is_admitted_first_and_fcfs_within_a_priority():
    sched = make_scheduler(max_seqs=1)
    reqs = [
        make_request("low-1", priority=5, start=10),
        make_request("high-1", priority=-1, start=20),
        make_request("mid", priority=0, start=30),
        make_request("high-2", priority=-1, start=40),
        make_request("low-2", priority=5, start=50),
    ]
    assert admitted_order(sched, reqs) == ["high-1", "high-2", "mid", "low-1", "low-2"]
    while sched.has_unfinished:
        step(sched)
    sched.kv.pool.check_whole()


def test_without_priorities_the_order_is_fcfs():
    sched = make_scheduler(max_seqs=1)
    reqs = [make_request(f"r{i}", start=10 * i) for i in range(5)]
    assert admitted_order(sched, reqs) == [f"r{i}" for i in range(5)]


def test_aging_lets_a_long_waiting_low_priority_request_pass():
    """One level per priority_aging_s waited: priority 3 that waited 35 s ranks as 3 - 3 = 0,
    ahead of a fresh priority-0 request that arrived later, but not of a fresh priority -1."""
    sched = make_scheduler(max_seqs=1, priority_aging_s=10.0)
    now = time.perf_counter()
    old_low = make_request("old-low", priority=3, arrival=now - 35.0, start=10)
    fresh = make_request("fresh", priority=0, arrival=now, start=20)
    urgent = make_request("urgent", priority=-1, arrival=now, start=30)
    assert admitted_order(sched, [fresh, old_low, urgent]) == ["urgent", "old-low", "fresh"]


def test_preemption_takes_the_least_urgent_request_when_priorities_differ():
    sched = make_scheduler(num_blocks=4, budget=64)  # 16 token slots
    urgent = make_request("urgent", num_prompt=7, max_tokens=8, priority=-1, start=10)
    lax = make_request("lax", num_prompt=7, max_tokens=8, priority=1, start=40)
    sched.add_request(lax)  # admitted first, so it is not the newest
    step(sched)
    sched.add_request(urgent)
    step(sched)
    step(sched)
    step(sched)  # someone needs a third block: the lax one goes, though it is the older
    assert lax.status == RequestStatus.PREEMPTED and urgent.status == RequestStatus.RUNNING
    while sched.has_unfinished:
        step(sched)
    assert urgent.num_output_tokens == 8 and lax.num_output_tokens == 8
    sched.kv.pool.check_whole()


def test_an_urgent_prompt_in_prefill_takes_the_budget_before_a_lax_one():
    sched = make_scheduler(budget=64, long_prefill_token_threshold=48)
    lax = make_request("lax", num_prompt=200, priority=1, start=10)
    urgent = make_request("urgent", num_prompt=200, priority=0, start=300)
    sched.add_request(lax)
    assert list(step(sched).items()) == [("lax", 48)]  # alone: it starts
    sched.add_request(urgent)
    # admitted behind the running one, then its chunk goes first
    assert list(step(sched).items()) == [("lax", 48), ("urgent", 16)]
    assert list(step(sched).items()) == [("urgent", 48), ("lax", 16)]
    while sched.has_unfinished:
        step(sched)
    sched.kv.pool.check_whole()


def test_prefill_first_schedules_a_new_prompt_before_a_long_prefill_and_keeps_decodes():
    def run(prefill_first: bool) -> dict[str, int]:
        sched = make_scheduler(
            num_blocks=256, budget=40, long_prefill_token_threshold=32, prefill_first=prefill_first
        )
        streaming = make_request("stream", num_prompt=4, max_tokens=50, start=1)
        sched.add_request(streaming)
        step(sched)  # prefilled; decoding from now on
        sched.add_request(make_request("long", num_prompt=200, start=100))
        step(sched)  # the long prompt's first chunk
        sched.add_request(make_request("short", num_prompt=8, start=400))
        return step(sched)

    fcfs = run(False)
    assert fcfs == {"stream": 1, "long": 32, "short": 7}  # the short one gets what is left
    first = run(True)
    # the new prompt's whole chunk first, one token for the decode, the rest to the long prompt
    assert first == {"stream": 1, "long": 31, "short": 8}


def test_prefill_first_never_takes_a_running_decode_token():
    sched = make_scheduler(num_blocks=256, budget=8, prefill_first=True, max_seqs=16)
    streams = [make_request(f"s{i}", num_prompt=2, max_tokens=30, start=10 * i) for i in range(5)]
    for r in streams:
        sched.add_request(r)
    step(sched)
    step(sched)  # all five decode
    sched.add_request(make_request("big", num_prompt=100, start=300))
    plan = step(sched)
    assert all(plan[f"s{i}"] == 1 for i in range(5))
    assert plan["big"] == 3  # what the decodes leave
    while sched.has_unfinished:
        step(sched)
    sched.kv.pool.check_whole()


def test_reserved_kv_keeps_room_for_running_requests():
    sched = make_scheduler(num_blocks=10, reserved_kv_fraction=0.3)  # 3 blocks kept free
    running = make_request("running", num_prompt=8, max_tokens=8, start=1)  # 2 blocks
    sched.add_request(running)
    step(sched)
    newcomer = make_request("new", num_prompt=24, max_tokens=4, start=100)  # needs 6 blocks
    sched.add_request(newcomer)
    assert "new" not in step(sched)  # 2 + 6 would leave 2 free < 3
    assert newcomer.status == RequestStatus.WAITING
    while running.status == RequestStatus.RUNNING:
        step(sched)
    assert "new" in step(sched)  # nothing running: nothing to keep
    while sched.has_unfinished:
        step(sched)
    sched.kv.pool.check_whole()


def test_priority_preemption_pauses_lax_streams_while_an_urgent_prompt_prefills():
    sched = make_scheduler(num_blocks=256, budget=32, priority_preemption=True)
    lax = [make_request(f"lax{i}", num_prompt=4, max_tokens=40, priority=1, start=10 * i)
           for i in range(3)]  # fmt: skip
    for r in lax:
        sched.add_request(r)
    step(sched)
    assert step(sched) == {"lax0": 1, "lax1": 1, "lax2": 1}  # decoding
    urgent = make_request("urgent", num_prompt=80, max_tokens=4, priority=0, start=500)
    sched.add_request(urgent)
    # its prompt runs alone, chunk after chunk, with the whole budget
    assert step(sched) == {"urgent": 32}
    assert step(sched) == {"urgent": 32}
    assert step(sched) == {"urgent": 16}  # the first token: the prompt is done
    after = step(sched)  # every stream resumes beside the urgent decode
    assert after == {"urgent": 1, "lax0": 1, "lax1": 1, "lax2": 1}
    while sched.has_unfinished:
        step(sched)
    assert all(r.num_output_tokens == 40 for r in lax)
    sched.kv.pool.check_whole()


def test_without_priority_preemption_decodes_keep_their_token():
    sched = make_scheduler(num_blocks=256, budget=32)
    lax = make_request("lax", num_prompt=4, max_tokens=40, priority=1, start=10)
    sched.add_request(lax)
    step(sched)
    sched.add_request(make_request("urgent", num_prompt=80, priority=0, start=500))
    assert step(sched) == {"lax": 1, "urgent": 31}


def test_an_urgent_request_takes_a_sequence_slot_from_a_lax_one():
    sched = make_scheduler(num_blocks=256, budget=64, max_seqs=2, priority_preemption=True)
    lax = [make_request(f"lax{i}", num_prompt=4, max_tokens=20, priority=2, start=10 * i)
           for i in range(2)]  # fmt: skip
    for r in lax:
        sched.add_request(r)
    step(sched)
    step(sched)
    urgent = make_request("urgent", num_prompt=8, max_tokens=4, priority=0, start=500)
    sched.add_request(urgent)
    assert step(sched) == {"urgent": 8}  # the newest lax request gave up its slot
    assert lax[1].status == RequestStatus.PREEMPTED and lax[0].status == RequestStatus.RUNNING
    assert sched.num_preemptions == 1
    while sched.has_unfinished:
        step(sched)
    assert urgent.num_output_tokens == 4 and all(r.num_output_tokens == 20 for r in lax)
    sched.kv.pool.check_whole()


def test_an_urgent_request_takes_kv_blocks_from_a_lax_one():
    sched = make_scheduler(num_blocks=6, budget=64, priority_preemption=True)  # 24 slots
    lax = make_request("lax", num_prompt=16, max_tokens=8, priority=1, start=10)  # 4 blocks
    sched.add_request(lax)
    step(sched)
    urgent = make_request("urgent", num_prompt=12, max_tokens=4, priority=0, start=500)
    sched.add_request(urgent)  # needs 3 blocks, 2 are free
    assert "urgent" in step(sched) and lax.status == RequestStatus.PREEMPTED
    while sched.has_unfinished:
        step(sched)
    assert urgent.num_output_tokens == 4 and lax.num_output_tokens == 8
    sched.kv.pool.check_whole()


def test_equal_priorities_preempt_nothing_for_admission():
    sched = make_scheduler(num_blocks=256, budget=64, max_seqs=1, priority_preemption=True)
    first = make_request("first", num_prompt=4, max_tokens=6, priority=1, start=10)
    sched.add_request(first)
    step(sched)
    sched.add_request(make_request("second", num_prompt=4, max_tokens=6, priority=1, start=50))
    assert step(sched) == {"first": 1} and sched.num_preemptions == 0


@pytest.mark.parametrize("bad", [{"priority": 2**31}, {"priority": 1.5}, {"deadline_s": 0}])
def test_scheduling_fields_are_checked(bad):
    with pytest.raises(ValueError, match="invalid"):
        SamplingParams(**bad)


def test_an_urgent_prompt_is_not_held_to_the_chunk_while_lax_streams_sit_out():
    """With lax streams paused for it, an urgent prompt takes the budget, not the per-stream
    chunk (the threshold bounds the pause of streams sharing its steps, and those are paused);
    with every request at one level the chunk holds as before."""
    sched = make_scheduler(num_blocks=256, budget=32, priority_preemption=True,
                           long_prefill_token_threshold=8)  # fmt: skip
    lax = make_request("lax", num_prompt=4, max_tokens=40, priority=1, start=10)
    sched.add_request(lax)
    step(sched)
    sched.add_request(make_request("urgent", num_prompt=80, max_tokens=4, priority=0, start=500))
    assert step(sched) == {"urgent": 32}  # admitted with the whole budget
    assert step(sched) == {"urgent": 32}
    assert step(sched) == {"urgent": 16}
    assert step(sched) == {"urgent": 1, "lax": 1}
    while sched.has_unfinished:
        step(sched)
    sched.kv.pool.check_whole()

    same = make_scheduler(num_blocks=256, budget=32, priority_preemption=True,
                          long_prefill_token_threshold=8)  # fmt: skip
    same.add_request(make_request("a", num_prompt=4, max_tokens=40, priority=0, start=10))
    step(same)
    same.add_request(make_request("b", num_prompt=80, max_tokens=4, priority=0, start=500))
    assert step(same) == {"a": 1, "b": 8}
