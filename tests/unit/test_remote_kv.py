"""The scheduler half of the KV connector (`pdserve.sched.remote_kv`): every disaggregation path
of the decode and the prefill side, and that every path returns every block. No torch."""

from __future__ import annotations

import sys

from test_kv_and_scheduler import BS, make_request, make_scheduler, run_step

from pdserve.types import KVRole, RequestStatus


def receiving(sched, rid="r", num_prompt=6, max_tokens=4, **kw):
    req = make_request(rid, num_prompt=num_prompt, max_tokens=max_tokens, **kw)
    req.kv_role = KVRole.RECEIVE
    sched.add_request(req)
    return req


def free(sched) -> int:
    return sched.kv.num_free_blocks()


def test_remote_kv_imports_no_torch():
    import subprocess

    code = "import sys, pdserve.sched.remote_kv; sys.exit(int('torch' in sys.modules))"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_receiving_request_reserves_its_prompt_instead_of_computing_it():
    sched = make_scheduler()
    before = free(sched)
    req = receiving(sched, num_prompt=6)
    plan, outs = run_step(sched)
    assert plan.is_empty and outs == []
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KV
    assert sched.remote.waiting == {"r": req}
    assert free(sched) == before - 2  # 6 tokens in blocks of 4
    assert sched.remote.block_ids("r") == sched.kv.block_ids("r")
    assert [r.request_id for r in sched.remote.take_reservations()] == ["r"]
    assert sched.remote.take_reservations() == []  # reported once


def test_reservation_waits_for_room_and_counts_against_max_num_seqs():
    sched = make_scheduler(num_blocks=3, max_seqs=2)
    a = receiving(sched, "a", num_prompt=8)  # 2 of 3 blocks
    b = receiving(sched, "b", num_prompt=8, start=40)  # no room
    run_step(sched)
    assert a.status == RequestStatus.WAITING_FOR_REMOTE_KV
    assert b.status == RequestStatus.WAITING and list(sched.waiting) == [b]
    sched2 = make_scheduler(max_seqs=1)
    receiving(sched2, "a")
    c = make_request("c", start=60)
    sched2.add_request(c)
    plan, _ = run_step(sched2)
    assert plan.is_empty and c.status == RequestStatus.WAITING  # a's reservation holds the seat


def test_kv_arrival_makes_the_request_decode_with_the_first_token():
    sched = make_scheduler()
    req = receiving(sched, num_prompt=6, max_tokens=3)
    run_step(sched)
    outs, received = sched.remote.on_sender_done([("r", 9)], [], valid_token=lambda t: t < 100)
    assert outs == [] and received == [("r", 9)]
    assert req.status == RequestStatus.RUNNING and req.output_token_ids == [9]
    assert req.num_computed_tokens == 6
    plan, outs = run_step(sched)
    assert [s.num_new_tokens for s in plan.scheduled] == [1]  # a decode, no prefill
    assert outs[0].new_token_ids == [7]


def test_arrived_blocks_join_the_prefix_cache_only_then():
    sched = make_scheduler()
    receiving(sched, "a", num_prompt=8)
    run_step(sched)
    probe = make_request("p", num_prompt=8)
    assert sched.kv.get_computed_blocks(probe)[1] == 0  # reserved blocks are not a cache hit
    sched.remote.on_sender_done([("a", 9)], [], valid_token=lambda t: True)
    assert sched.kv.get_computed_blocks(probe)[1] == 2 * BS - BS  # all but the last block


def test_first_token_that_ends_the_request_finishes_it_and_frees_blocks():
    sched = make_scheduler()
    before = free(sched)
    receiving(sched, max_tokens=1)
    run_step(sched)
    outs, _ = sched.remote.on_sender_done([("r", 9)], [], valid_token=lambda t: True)
    assert [(o.request_id, o.finish_reason) for o in outs] == [("r", "length")]
    assert not sched.has_unfinished and free(sched) == before
    receiving(sched, "e")
    run_step(sched)
    outs, _ = sched.remote.on_sender_done([("e", 2)], [], valid_token=lambda t: True)  # EOS
    assert outs[0].finish_reason == "stop" and free(sched) == before


def test_invalid_first_token_or_unknown_request_is_ignored():
    sched = make_scheduler()
    req = receiving(sched)
    run_step(sched)
    outs, received = sched.remote.on_sender_done(
        [("r", 10_000), ("nobody", 3)], [], valid_token=lambda t: t < 100
    )
    assert outs == [] and received == []
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KV


def test_resume_locally_recomputes_the_prompt_after_the_tokens_already_sent():
    sched = make_scheduler()
    before = free(sched)
    req = receiving(sched, max_tokens=4)
    run_step(sched)
    assert sched.remote.resume_locally("r", [9], release_kv=True)
    assert req.status == RequestStatus.WAITING and req.output_token_ids == [9]
    assert free(sched) == before  # reservation returned; the prompt is computed afresh
    plan, outs = run_step(sched)
    assert plan.scheduled[0].num_new_tokens == 7  # prompt + the token the client has
    assert outs[0].new_token_ids == [7]
    while sched.has_unfinished:
        run_step(sched)
    assert req.output_token_ids == [9, 7, 7, 7] and free(sched) == before


def test_resume_locally_before_any_reservation_and_for_unknown_requests():
    sched = make_scheduler()
    req = receiving(sched)  # not scheduled yet: nothing reserved
    assert sched.remote.resume_locally("r", [5])
    assert req.kv_role is None and req.output_token_ids == [5]
    plan, _ = run_step(sched)
    assert plan.scheduled[0].num_new_tokens == 7  # computed here
    assert not sched.remote.resume_locally("nobody", [])


def test_a_sender_still_writing_keeps_blocks_quarantined_until_it_stops():
    sched = make_scheduler()
    before = free(sched)
    receiving(sched, "a")
    receiving(sched, "b", start=40)
    run_step(sched)
    held_a = sched.remote.block_ids("a")
    # a: ended (client gone) while the sender may still write; b: falls back the same way
    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED, release_kv=False)
    assert sched.remote.resume_locally("b", [], release_kv=False)
    assert sched.remote.block_ids("a") == held_a  # writes for it are still accepted
    assert free(sched) == before - 4
    sched.remote.release_quarantine(["a"])
    assert sched.remote.block_ids("a") is None and free(sched) == before - 2
    # b's sender gives up (its abort signal): its quarantined reservation goes back too
    sched.remote.on_sender_done([], ["b"], valid_token=lambda t: True)
    assert free(sched) == before  # b waits to be computed here, holding nothing yet
    while sched.has_unfinished:
        run_step(sched)
    assert free(sched) == before


def test_abort_signal_from_the_sender_ends_a_waiting_request():
    sched = make_scheduler()
    before = free(sched)
    receiving(sched)
    run_step(sched)
    sched.remote.on_sender_done([], ["r"], valid_token=lambda t: True)
    assert not sched.has_unfinished and free(sched) == before


def test_finishing_a_waiting_request_with_release_frees_at_once():
    sched = make_scheduler()
    before = free(sched)
    receiving(sched)
    run_step(sched)
    sched.finish_requests(["r"], RequestStatus.FINISHED_ABORTED, release_kv=True)
    assert sched.remote.waiting == {} and sched.remote.quarantine == {}
    assert free(sched) == before


def test_prefill_side_hands_off_after_the_first_token():
    sched = make_scheduler()
    before = free(sched)
    req = make_request("s", num_prompt=6, max_tokens=4)
    req.kv_role = KVRole.SEND
    sched.add_request(req)
    _, outs = run_step(sched)
    assert outs[0].new_token_ids == [7] and outs[0].finish_reason is None
    assert req.status == RequestStatus.FINISHED_REMOTE
    assert sched.remote.take_handed_off() == [req]
    assert sched.remote.take_handed_off() == []
    assert not sched.has_unfinished and free(sched) == before


def test_prefill_side_request_ending_at_its_first_token_is_not_handed_off():
    sched = make_scheduler()
    req = make_request("s", max_tokens=1)
    req.kv_role = KVRole.SEND
    sched.add_request(req)
    _, outs = run_step(sched)
    assert outs[0].finish_reason == "length"
    assert sched.remote.take_handed_off() == []
