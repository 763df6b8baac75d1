"""Bursts (`--num-scheduler-steps`): several decode steps per schedule, in the scheduler alone.

When a burst runs, how long it is, which KV slots it holds, and how its tokens come back
(`Scheduler._burst`, `Scheduler.update(bursts=...)`). The model side (the native loop gives the
tokens of one step at a time, and transformers') is tests/model/test_burst_decode.py.
"""

from __future__ import annotations

import pytest

from pdserve.config import EngineArgs
from pdserve.kv.manager import KVCacheManager
from pdserve.request import Request
from pdserve.sched.scheduler import Scheduler
from pdserve.types import RequestStatus, SamplingParams

BS = 4
EOS = 2


def make_scheduler(steps: int, num_blocks: int = 64, max_seqs: int = 8, max_len: int = 128):
    args = EngineArgs(model="m", max_num_seqs=max_seqs, num_scheduler_steps=steps)
    return Scheduler(args.scheduler_config(max_len), KVCacheManager(num_blocks, BS))


def make_request(rid: str, num_prompt: int = 6, max_tokens: int = 40, **kw) -> Request:
    """A greedy request (`kw`: other sampling parameters) whose prompt no other id shares."""
    params = SamplingParams(**{"temperature": 0, **kw}, max_tokens=max_tokens)
    start = 100 * (1 + sum(map(ord, rid)))
    prompt = list(range(start, start + num_prompt))
    return Request(rid, prompt, params, max_tokens, eos_token_ids=(EOS,))


def decoding(sched: Scheduler, *requests: Request) -> None:
    """Admit the requests and run their prompts, one first token each."""
    for r in requests:
        sched.add_request(r)
    plan = sched.schedule()
    assert plan.num_steps == 1 and plan.num_prefill_tokens
    sched.update(plan, [7] * len(plan.scheduled))


def run_burst(sched: Scheduler, tokens: list[int] | None = None):
    """Schedule, and answer a burst with `tokens` for every request (default: 7s)."""
    plan = sched.schedule()
    n = plan.num_steps
    answer = [list(tokens if tokens is not None else [7] * n) for _ in plan.scheduled]
    return plan, sched.update(plan, [], bursts=answer)


def test_decodes_alone_run_a_burst_with_the_slots_of_every_step():
    sched = make_scheduler(8)
    a, b = make_request("a"), make_request("b", num_prompt=9)
    decoding(sched, a, b)
    plan = sched.schedule()
    assert plan.num_steps == 8 and plan.num_decode_tokens == 2
    # slots for each request's last token and the 7 the burst feeds back: 6 + 1 + 7 = 14 tokens
    assert len(sched.kv.block_ids("a")) == -(-(a.num_computed_tokens + 8) // BS) == 4
    assert len(sched.kv.block_ids("b")) == -(-(b.num_computed_tokens + 8) // BS) == 5
    outs = sched.update(plan, [], bursts=[[21 + i for i in range(8)], [31 + i for i in range(8)]])
    assert [o.new_token_ids for o in outs] == [list(range(21, 29)), list(range(31, 39))]
    assert a.output_token_ids == [7, *range(21, 29)]
    assert a.num_computed_tokens == a.num_tokens - 1  # the newest token is the next to compute
    assert len(a.metrics.token_times) == 9


def test_one_step_per_schedule_by_default():
    sched = make_scheduler(1)
    decoding(sched, make_request("a"))
    assert sched.schedule().num_steps == 1


def test_a_burst_stops_at_the_first_length_limit():
    sched = make_scheduler(8)
    short, long = make_request("a", max_tokens=4), make_request("b", max_tokens=40)
    decoding(sched, short, long)
    plan, outs = run_burst(sched)
    assert plan.num_steps == 3  # "a" has 3 tokens left
    assert outs[0].finish_reason == "length" and short.num_output_tokens == 4
    assert sched.kv.block_ids("b") and "a" not in sched.kv.req_block_ids
    plan, _ = run_burst(sched)
    assert plan.num_steps == 8
    # the context: a 6-token prompt in 12 tokens of model length leaves 6 outputs
    sched = make_scheduler(8, max_len=12)
    r = make_request("c")
    decoding(sched, r)
    plan, outs = run_burst(sched)
    assert plan.num_steps == 5 and outs[0].finish_reason == "length" and r.num_tokens == 12


@pytest.mark.parametrize(
    "params",
    [
        dict(temperature=0.8),
        dict(logprobs=2),
        dict(repetition_penalty=1.2),
        dict(presence_penalty=0.5),
        dict(min_tokens=5),
    ],
)
def test_no_burst_where_a_token_is_more_than_the_raw_argmax(params):
    sched = make_scheduler(8)
    decoding(sched, make_request("plain"), make_request("other", **params))
    assert sched.schedule().num_steps == 1


def test_min_tokens_met_lets_bursts_run():
    sched = make_scheduler(8)
    r = make_request("a", min_tokens=1)  # the first token counts
    decoding(sched, r)
    assert sched.schedule().num_steps == 8


def test_no_burst_while_a_waiting_request_could_start():
    sched = make_scheduler(8, max_seqs=2)
    decoding(sched, make_request("a"))
    sched.add_request(make_request("b", max_tokens=2))  # a free slot: its prompt runs now
    plan = sched.schedule()
    assert plan.num_steps == 1 and {s.request.request_id for s in plan.scheduled} == {"a", "b"}
    sched.update(plan, [7, 7])
    sched.add_request(make_request("c"))  # "b" ends at its next token, "c" takes its slot
    plan = sched.schedule()
    assert plan.num_steps == 1  # "c" waits for a slot, but only one step: "b" ends in it


def test_a_burst_runs_while_every_slot_is_taken_and_frees_the_slot_when_one_step_would():
    """Requests waiting for a sequence slot (an offline batch larger than max_num_seqs) cannot
    start before a running request ends; the burst ends where the first one does, so the next
    request starts at the same step as with one step per schedule."""
    for steps in (1, 8):
        sched = make_scheduler(steps, max_seqs=2)
        decoding(sched, make_request("a", max_tokens=13), make_request("b", max_tokens=40))
        sched.add_request(make_request("c"))
        bursts = []
        while True:
            plan = sched.schedule()
            if any(item.request.request_id == "c" for item in plan.scheduled):
                break
            bursts.append(plan.num_steps)
            if plan.num_steps > 1:
                sched.update(plan, [], bursts=[[7] * plan.num_steps for _ in plan.scheduled])
            else:
                sched.update(plan, [7] * len(plan.scheduled))
        computed = sum(bursts)
        assert computed == 12  # "a" has 12 tokens left after its first: "c" starts right after
        assert bursts == ([1] * 12 if steps == 1 else [8, 4])
        assert plan.num_prefill_tokens == 6 and plan.num_steps == 1  # "c"'s prompt, beside "b"


def test_no_burst_while_a_waiting_request_could_take_a_slot_by_priority():
    args = EngineArgs(model="m", max_num_seqs=1, num_scheduler_steps=8, priority_preemption=True)
    sched = Scheduler(args.scheduler_config(128), KVCacheManager(64, BS))
    decoding(sched, make_request("a", priority=1))
    sched.add_request(make_request("b", priority=1))  # as urgent: no slot for it, but aging
    plan = sched.schedule()  # may make it more urgent than "a" during a burst
    assert plan.num_steps == 1 and [s.request.request_id for s in plan.scheduled] == ["a"]
    # without priorities in play the same queue lets a burst run
    sched = Scheduler(args.scheduler_config(128), KVCacheManager(64, BS))
    decoding(sched, make_request("a"))
    sched.add_request(make_request("b"))
    assert sched.schedule().num_steps == 8


def test_without_blocks_for_the_whole_burst_it_is_one_step_and_holds_no_extra():
    # 6 blocks of 4: "a" and "b" hold 2 each after their prompts; a burst of 8 needs 4 each
    sched = make_scheduler(8, num_blocks=6)
    decoding(sched, make_request("a"), make_request("b"))
    plan = sched.schedule()
    assert plan.num_steps == 1
    assert [len(sched.kv.block_ids(r)) for r in ("a", "b")] == [2, 2]
    assert sched.kv.num_free_blocks() == 2
    outs = sched.update(plan, [7, 7])
    assert [o.new_token_ids for o in outs] == [[7], [7]]


def test_a_stop_inside_a_burst_ends_the_request_there_and_frees_every_block():
    sched = make_scheduler(8)
    r = make_request("a", stop_token_ids=[99])
    decoding(sched, r)
    plan, outs = run_burst(sched, [5, 6, EOS, 8, 9, 10, 11, 12])
    assert outs[0].new_token_ids == [5, 6, EOS] and outs[0].finish_reason == "stop"
    assert r.output_token_ids == [7, 5, 6, EOS] and r.status == RequestStatus.FINISHED_STOPPED
    assert sched.kv.num_free_blocks() == 64
    r = make_request("b", stop_token_ids=[99])
    decoding(sched, r)
    _, outs = run_burst(sched, [5, 99, 6, 7, 8, 9, 10, 11])
    assert outs[0].new_token_ids == [5, 99] and outs[0].stop_reason == 99
    assert sched.kv.num_free_blocks() == 64


def test_a_burst_the_runner_cut_short_gives_its_unused_blocks_back():
    """A runner that could run only one step of a burst (the fused step not usable for it)
    answers one token: the blocks of the other steps go back."""
    sched = make_scheduler(8)
    r = make_request("a")
    decoding(sched, r)
    plan = sched.schedule()
    assert plan.num_steps == 8 and len(sched.kv.block_ids("a")) == 4
    sched.update(plan, [], bursts=[[7]])
    assert r.num_tokens == 8 and r.num_computed_tokens == 7
    assert len(sched.kv.block_ids("a")) == 2  # 8 tokens in blocks of 4
    assert sched.schedule().num_steps == 8  # and the next burst allocates afresh


def test_an_abort_during_a_burst_emits_nothing():
    sched = make_scheduler(8)
    decoding(sched, make_request("a"), make_request("b"))
    plan = sched.schedule()
    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    outs = sched.update(plan, [], bursts=[[7] * 8, [7] * 8])
    assert [o.request_id for o in outs] == ["b"]
    sched.finish_requests(["b"], RequestStatus.FINISHED_ABORTED)
    assert sched.kv.num_free_blocks() == 64


def test_bursts_and_speculation_are_one_or_the_other():
    args = EngineArgs(model="m", num_scheduler_steps=4, speculative_method="ngram")
    with pytest.raises(ValueError, match="num_scheduler_steps"):
        args.scheduler_config(128)
    with pytest.raises(ValueError, match="num_scheduler_steps"):
        EngineArgs(model="m", num_scheduler_steps=0)


def test_the_blocks_a_last_burst_filled_reach_the_prefix_cache():
    """A request that ends in a burst publishes the full blocks whose KV the burst computed,
    as one step per schedule does: a later request whose prompt is that text hits them."""
    sched = make_scheduler(8)
    r = make_request("a", num_prompt=6, max_tokens=12)
    decoding(sched, r)  # 6 prompt tokens + 1 output: 7 tokens
    run_burst(sched, [21 + i for i in range(8)])  # 15 tokens, 14 computed
    _, outs = run_burst(sched, [31, 32, 33])  # the last 3 of 12: 18 tokens, 17 computed
    assert outs[0].finish_reason == "length" and r.num_tokens == 18
    follow = Request("b", r.all_token_ids + [5, 6], SamplingParams(temperature=0, max_tokens=1),
                     1, eos_token_ids=(EOS,))  # fmt: skip
    match, hit_tokens = sched.kv.get_computed_blocks(follow)
    assert hit_tokens == 16  # blocks 0-3: positions 0-15, all computed before it ended
