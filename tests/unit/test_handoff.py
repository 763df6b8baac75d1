"""The frontend's handoff state machine (`pdserve.disagg.handoff`), driven without processes:
every message it sends is recorded, workers' liveness and the clock are plain values."""

from __future__ import annotations

import pytest

from pdserve.disagg.handoff import HandoffCoordinator
from pdserve.ipc.messages import AddRequest, FinishRequests, ReleaseKV, ResumeLocally
from pdserve.types import EngineCoreOutput, KVRole, PrefillFailurePolicy, SamplingParams

D, P = 1, 0  # decode and prefill worker ids


class World:
    def __init__(self, policy=PrefillFailurePolicy.RECOMPUTE):
        self.sent: list[tuple[int, object]] = []
        self.delivered: list[tuple[int, list]] = []
        self.failed: list[tuple[str, str]] = []
        self.fallbacks: list[str] = []
        self.dead: set[int] = set()
        self.now = 0.0
        self.h = HandoffCoordinator(
            lambda wid, msg: self.sent.append((wid, msg)),
            lambda wid: wid not in self.dead,
            deliver=lambda wid, outs: self.delivered.append((wid, outs)),
            fail=lambda core_id, reason: self.failed.append((core_id, reason)),
            kv_transfer_timeout_s=5.0,
            queue_timeout_s=2.0,
            on_prefill_failure=policy,
            on_fallback=self.fallbacks.append,
            clock=lambda: self.now,
        )

    def accept(self, worker_id, outputs):
        """Outputs of `worker_id`; every request here is decoded by D."""
        return self.h.accept(worker_id, outputs, {o.request_id: D for o in outputs})

    def take(self):
        out, self.sent = self.sent, []
        return out

    def start(self, core_id="c"):
        self.h.start(core_id, D, P, [5, 6, 7], SamplingParams(max_tokens=4))
        return self.take()

    def reserve(self, core_id="c"):
        self.h.on_reservation(D, core_id, [3, 4], 0)
        return self.take()


def tok(core_id, *ids, finish=None):
    return EngineCoreOutput(core_id, list(ids), finish_reason=finish)


def test_happy_path_sends_receive_then_send_and_streams_in_order():
    w = World()
    [(wid, add)] = w.start()
    assert wid == D and isinstance(add, AddRequest) and add.kv_role == KVRole.RECEIVE
    assert add.queue_timeout_s == 2.0
    [(wid, add)] = w.reserve()
    assert wid == P and add.kv_role == KVRole.SEND
    assert (add.kv_dest.worker_id, add.kv_dest.block_ids) == (D, [3, 4])
    # the decode worker's tokens may arrive before the prefill worker's first token
    w.h.on_kv_received("c", 9)
    assert w.accept(D, [tok("c", 11)]) == []  # held
    kept = w.accept(P, [tok("c", 9)])
    assert [o.new_token_ids for o in kept] == [[9], [11]]  # first token, then the held one
    assert "c" not in w.h  # done coordinating
    assert [o.new_token_ids for o in w.accept(D, [tok("c", 12)])] == [[12]]


def test_first_token_before_kv_signal():
    w = World()
    w.start()
    w.reserve()
    assert [o.new_token_ids for o in w.accept(P, [tok("c", 9)])] == [[9]]
    assert "c" in w.h
    w.h.on_kv_received("c", 9)
    assert "c" not in w.h


def test_request_ending_at_its_first_token_is_finished_on_the_decode_worker():
    w = World()
    w.start()
    w.reserve()
    kept = w.accept(P, [tok("c", 2, finish="stop")])
    assert kept[0].finish_reason == "stop"
    [(wid, fin)] = w.take()
    # the prefill worker wrote nothing more after its last token: blocks stay until its
    # abort signal reaches the decode worker
    assert wid == D and isinstance(fin, FinishRequests) and fin.release_kv is False
    assert "c" not in w.h


def test_outputs_from_the_wrong_worker_are_dropped_or_passed_through():
    w = World()
    w.start()
    w.reserve()
    assert w.accept(7, [tok("c", 9)]) == []  # not its prefill worker
    assert w.accept(P, [tok("other", 9)]) == []  # not a handoff (any more)
    err = EngineCoreOutput("c", [], finish_reason="abort", error="refused")
    assert w.accept(D, [err]) == [err]  # a refusal is never held


def test_reservation_for_a_dead_prefill_worker_falls_back_at_once():
    w = World()
    w.start()
    w.dead.add(P)
    [(wid, resume)] = w.reserve()
    assert wid == D and isinstance(resume, ResumeLocally)
    assert resume.output_token_ids == [] and resume.release_kv is True  # no writer
    assert w.fallbacks == ["prefill_dead"] and "c" not in w.h


def test_deadline_recomputes_and_tells_the_live_writer_to_stop():
    w = World()
    w.start()
    w.reserve()
    w.now = 4.9
    assert w.h.check_deadlines() == []
    w.now = 5.1
    assert w.h.check_deadlines() == ["c"]
    msgs = w.take()
    resume = next(m for wid, m in msgs if wid == D)
    assert isinstance(resume, ResumeLocally) and resume.release_kv is False  # writer alive
    assert any(wid == P and isinstance(m, FinishRequests) for wid, m in msgs)
    assert w.fallbacks == ["timeout"]


def test_a_prefill_worker_that_keeps_stepping_keeps_its_requests():
    """A long queue on a busy prefill worker is no reason to recompute; silence is."""
    w = World()
    w.start()
    w.reserve()
    for t in (4.0, 8.0, 12.0):  # P reports a step every 4 s (timeout 5 s)
        w.now = t
        w.h.on_progress(P)
        assert w.h.check_deadlines() == []
    w.h.on_progress(D)  # another worker's progress extends nothing
    w.now = 16.9
    assert w.h.check_deadlines() == []
    w.now = 17.1  # 5 s since P last reported a step
    assert w.h.check_deadlines() == ["c"] and w.fallbacks == ["timeout"]


def test_progress_before_the_prefill_worker_has_the_request_extends_nothing():
    w = World()
    w.start()  # waiting for the decode worker's reservation
    w.now = 4.0
    w.h.on_progress(P)
    w.now = 5.1
    assert w.h.check_deadlines() == ["c"]


def test_deadline_after_the_first_token_resumes_after_it():
    w = World()
    w.start()
    w.reserve()
    w.accept(P, [tok("c", 9)])
    w.now = 6.0
    w.h.check_deadlines()
    resume = next(m for wid, m in w.take() if wid == D)
    assert resume.output_token_ids == [9]


def test_kv_done_but_first_token_lost_delivers_it_from_the_decode_side():
    w = World()
    w.start()
    w.reserve()
    w.h.on_kv_received("c", 9)
    w.accept(D, [tok("c", 11)])
    w.dead.add(P)
    w.h.on_prefill_death(P, [D])
    [(wid, outs)] = w.delivered
    assert wid == D and [o.new_token_ids for o in outs] == [[9], [11]]
    assert w.fallbacks == []  # not a fallback: the KV arrived


def test_prefill_death_recomputes_and_releases_blocks_held_for_it():
    w = World()
    w.start("a")
    w.reserve("a")
    w.start("b")  # still waiting for its reservation
    w.dead.add(P)
    w.h.on_prefill_death(P, [D])
    msgs = w.take()
    resumes = {m.request_id: m for _, m in msgs if isinstance(m, ResumeLocally)}
    assert set(resumes) == {"a", "b"}
    assert all(m.release_kv for m in resumes.values())  # the writer is dead
    [release] = [m for _, m in msgs if isinstance(m, ReleaseKV)]
    assert release.request_ids == ["a"]
    assert not any(wid == P for wid, _ in msgs)


def test_fail_policy_ends_the_request_when_the_prefill_worker_dies():
    w = World(PrefillFailurePolicy.FAIL)
    w.start()
    w.reserve()
    w.dead.add(P)
    w.h.on_prefill_death(P, [D])
    assert w.failed and w.failed[0][0] == "c" and "prefill worker 0 died" in w.failed[0][1]
    fin = next(m for wid, m in w.take() if wid == D and isinstance(m, FinishRequests))
    assert fin.release_kv is True


def test_fail_policy_still_recomputes_on_a_timeout():
    w = World(PrefillFailurePolicy.FAIL)
    w.start()
    w.now = 10.0
    w.h.check_deadlines()
    assert w.failed == [] and any(isinstance(m, ResumeLocally) for _, m in w.take())


def test_decode_death_stops_the_prefill():
    w = World()
    w.start()
    w.reserve()
    w.dead.add(D)
    w.h.on_decode_death({"c"})
    assert [(wid, type(m)) for wid, m in w.take()] == [(P, FinishRequests)]
    assert "c" not in w.h


@pytest.mark.parametrize("sent_to_prefill", [True, False])
def test_finish_ends_both_sides(sent_to_prefill):
    w = World()
    w.start()
    if sent_to_prefill:
        w.reserve()
    assert w.h.finish("c", "abort")
    msgs = w.take()
    fin_d = next(m for wid, m in msgs if wid == D)
    assert fin_d.reason == "abort"
    # while the prefill worker may write, the decode worker keeps the blocks until its signal
    assert fin_d.release_kv is (not sent_to_prefill)
    assert any(wid == P for wid, _ in msgs) is sent_to_prefill
    assert not w.h.finish("c", "abort")  # only once


def test_forget_drops_the_state():
    w = World()
    w.start()
    w.h.forget("c")
    assert "c" not in w.h and w.h.check_deadlines() == []


def test_one_worker_prefills_one_request_and_decodes_another():
    """Switchable workers: worker 0 is the prefill side of "a" and the decode side of "b"."""
    w = World()
    w.h.start("a", D, P, [5, 6], SamplingParams())
    w.h.start("b", P, D, [7, 8], SamplingParams())
    w.h.on_reservation(D, "a", [1], 0)
    w.h.on_reservation(P, "b", [2], 0)
    decoders = {"a": D, "b": P}
    w.h.on_kv_received("b", 4)
    # worker 0 reports a's first token and b's second; worker 1 the reverse
    from_p = w.h.accept(P, [tok("a", 3), tok("b", 12)], decoders)
    assert [(o.request_id, o.new_token_ids) for o in from_p] == [("a", [3])]  # b's is held
    from_d = w.h.accept(D, [tok("b", 4), tok("a", 13)], decoders)
    assert [(o.request_id, o.new_token_ids) for o in from_d] == [("b", [4]), ("b", [12])]
    # a's decode token came before its KV signal (workers report the KV first; still): it
    # goes out with the signal, after the first token
    w.h.on_kv_received("a", 3)
    assert "a" not in w.h and "b" not in w.h
    assert [(wid, [o.new_token_ids for o in outs]) for wid, outs in w.delivered] == [(D, [[13]])]
    assert [o.new_token_ids for o in w.h.accept(D, [tok("a", 14)], decoders)] == [[14]]
