"""HandoffCoordinator: the frontend's state machine for requests prefilled on another worker.

Pure logic (no processes, sockets or torch): it sends through an injected `send(worker_id, msg)`
and hands outputs back to its caller, so the unit tests drive every path with plain calls.

The protocol, for one core request routed to decode worker D and prefill worker P:

1. `start`: D gets `AddRequest(kv_role=RECEIVE)`; it reserves blocks and reports a
   `KVReservation` (`on_reservation`).
2. P gets `AddRequest(kv_role=SEND, kv_dest=...)`: it prefills, ships the KV layer by layer,
   sends `KVDone` (with the first token) straight to D, and the first token to the frontend
   (`accept`), which streams it at once: TTFT is P's.
3. D reports `kv_received` (`on_kv_received`) and decodes on. D's tokens are held until P's first
   token has been delivered (`accept`), so the client sees them in order.

The deadline of a handoff is `kv_transfer_timeout_s` after it starts, and once P has the
request, that long after P last showed progress (`on_progress`: any step it reports): a busy P
with a long queue keeps its requests, a P that has stopped stepping (hung, or lost a message)
does not.

Failures: no KV by the deadline (`check_deadlines`) or a dead P (`on_prefill_death`) make D
recompute the prompt after any token the client already has (a *fallback*), or, with the `fail`
policy and a dead P, end the request with 503. A dead D (`on_decode_death`) ends its requests.
Blocks that P may still be writing into stay quarantined on D until P is known to have stopped.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from pdserve.disagg.protocol import KVDest
from pdserve.ipc.messages import AddRequest, FinishRequests, ReleaseKV, ResumeLocally
from pdserve.types import EngineCoreOutput, KVRole, PrefillFailurePolicy, SamplingParams


@dataclass
class Handoff:
    """One core request whose prompt is prefilled on another worker than the one decoding it."""

    core_id: str
    decode_id: int
    prefill_id: int
    prompt_token_ids: list[int]
    params: SamplingParams
    deadline: float
    sent_to_prefill: bool = False
    accepted_tokens: list[int] = field(default_factory=list)  # from the prefill worker
    kv_done: bool = False  # the decode worker has the KV (its signal may beat the first token)
    first_token: int | None = None  # as the decode worker received it
    held: list[EngineCoreOutput] = field(default_factory=list)  # decode outputs to follow it


class HandoffCoordinator:
    def __init__(
        self,
        send: Callable[[int, object], None],
        alive: Callable[[int], bool],
        *,
        deliver: Callable[[int, list[EngineCoreOutput]], None],
        fail: Callable[[str, str], None],
        kv_transfer_timeout_s: float = 30.0,
        queue_timeout_s: float | None = None,
        on_prefill_failure: PrefillFailurePolicy = PrefillFailurePolicy.RECOMPUTE,
        on_fallback: Callable[[str], None] = lambda reason: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.send = send  # send(worker_id, message); a dead worker's messages are dropped
        self.alive = alive
        self.deliver = deliver  # deliver(worker_id, outputs) to the client
        self.fail = fail  # fail(core_id, reason): end it with 503
        self.kv_transfer_timeout_s = kv_transfer_timeout_s
        self.queue_timeout_s = queue_timeout_s
        self.policy = on_prefill_failure
        self.on_fallback = on_fallback  # counted in metrics, by reason
        self.clock = clock
        self.handoffs: dict[str, Handoff] = {}
        self.sent_to: dict[int, set[str]] = {}  # prefill worker -> core ids it may write for

    def __contains__(self, core_id: str) -> bool:
        return core_id in self.handoffs

    # ---- the protocol --------------------------------------------------------------------
    def start(
        self,
        core_id: str,
        decode_id: int,
        prefill_id: int,
        prompt_token_ids: list[int],
        params: SamplingParams,
    ) -> None:
        deadline = self.clock() + self.kv_transfer_timeout_s
        self.handoffs[core_id] = Handoff(
            core_id, decode_id, prefill_id, prompt_token_ids, params, deadline
        )
        msg = AddRequest(
            core_id, prompt_token_ids, params, self.queue_timeout_s, kv_role=KVRole.RECEIVE
        )
        self.send(decode_id, msg)

    def on_reservation(self, decode_id: int, core_id: str, block_ids, num_cached: int) -> None:
        """The decode worker holds blocks for the prompt: the prefill worker may start."""
        h = self.handoffs.get(core_id)
        if h is None or h.decode_id != decode_id:
            return
        if not self.alive(h.prefill_id):
            self.fallback(h, "prefill_dead")
            return
        dest = KVDest(decode_id, list(block_ids), num_cached)
        self.send(
            h.prefill_id,
            AddRequest(core_id, h.prompt_token_ids, h.params, kv_role=KVRole.SEND, kv_dest=dest),
        )
        h.sent_to_prefill = True
        self.sent_to.setdefault(h.prefill_id, set()).add(core_id)

    def on_progress(self, prefill_id: int) -> None:
        """P reported a step: its requests still waiting for their KV get a new deadline."""
        deadline = self.clock() + self.kv_transfer_timeout_s
        for core_id in self.sent_to.get(prefill_id, ()):
            h = self.handoffs.get(core_id)
            if h is not None and h.prefill_id == prefill_id:
                h.deadline = max(h.deadline, deadline)

    def on_kv_received(self, core_id: str, first_token: int) -> None:
        h = self.handoffs.get(core_id)
        if h is not None:
            h.kv_done, h.first_token = True, first_token
            if h.accepted_tokens:  # the first token is out: nothing more to coordinate
                del self.handoffs[core_id]
                if h.held:  # (a worker reports the KV before its decode tokens; be safe)
                    self.deliver(h.decode_id, h.held)

    def accept(
        self, worker_id: int, outputs: list[EngineCoreOutput], decoder_of: Mapping[str, int]
    ) -> list[EngineCoreOutput]:
        """The outputs of one worker's step that go to the client now, in order. A worker may
        be the prefill side of some requests and the decode side of others (`decoder_of` says
        which worker decodes each request): first tokens from a request's prefill worker go out
        at once, followed by any decode outputs that waited for them; a decode worker's outputs
        wait while its request's first token is still on its way; an output from a prefill
        worker the request has fallen back from (or from any other worker) is dropped."""
        kept = []
        for out in outputs:
            h = self.handoffs.get(out.request_id)
            if h is not None and h.prefill_id == worker_id:
                kept += self._first_token(h, out)
            elif decoder_of.get(out.request_id) == worker_id:
                if h is not None and out.error is None:
                    h.held.append(out)
                else:
                    kept.append(out)
        return kept

    def _first_token(self, h: Handoff, out: EngineCoreOutput) -> list[EngineCoreOutput]:
        self.sent_to.get(h.prefill_id, set()).discard(h.core_id)
        h.accepted_tokens.extend(out.new_token_ids)
        if out.finish_reason is not None:  # ended at the first token: nothing to hand off
            del self.handoffs[h.core_id]
            self.send(h.decode_id, FinishRequests([h.core_id], release_kv=False))
            return [out]
        if h.kv_done:  # the decode worker's tokens waited for this one
            del self.handoffs[h.core_id]
            return [out, *h.held]
        return [out]

    # ---- failures ------------------------------------------------------------------------
    def check_deadlines(self) -> list[str]:
        """Fall back for handoffs whose KV did not arrive in time; returns their ids."""
        now = self.clock()
        late = [h for h in self.handoffs.values() if now > h.deadline and not h.kv_done]
        for h in late:
            self.fallback(h, "timeout")
        return [h.core_id for h in late]

    def fallback(self, h: Handoff, reason: str) -> None:
        """Give up on the remote prefill of one request (see the module docstring)."""
        self.handoffs.pop(h.core_id, None)
        if h.kv_done:  # the decode worker has everything; only the first token was lost
            first = [] if h.accepted_tokens else [EngineCoreOutput(h.core_id, [h.first_token])]
            self.deliver(h.decode_id, first + h.held)
            return
        self.on_fallback(reason)
        if reason == "prefill_dead" and self.policy == PrefillFailurePolicy.FAIL:
            self.send(h.decode_id, FinishRequests([h.core_id], release_kv=True))
            self.fail(h.core_id, f"prefill worker {h.prefill_id} died during the request")
            return
        writer_alive = h.sent_to_prefill and self.alive(h.prefill_id)
        self.send(
            h.decode_id,
            ResumeLocally(h.core_id, list(h.accepted_tokens), release_kv=not writer_alive),
        )
        if writer_alive:
            self.send(h.prefill_id, FinishRequests([h.core_id]))

    def on_prefill_death(self, prefill_id: int, live_decode_ids: Iterable[int]) -> None:
        for h in [h for h in self.handoffs.values() if h.prefill_id == prefill_id]:
            self.fallback(h, "prefill_dead")
        held = self.sent_to.pop(prefill_id, set())
        if held:  # it will never write again: blocks held for it can go back
            for d in live_decode_ids:
                self.send(d, ReleaseKV(sorted(held)))

    def on_decode_death(self, lost: Iterable[str]) -> None:
        """The decode worker of these requests died (the caller fails them): stop their
        prefills."""
        for core_id in lost:
            h = self.handoffs.pop(core_id, None)
            if h is not None and h.sent_to_prefill and self.alive(h.prefill_id):
                self.send(h.prefill_id, FinishRequests([core_id]))

    # ---- ending ----------------------------------------------------------------------------
    def finish(self, core_id: str, reason: str) -> bool:
        """End a handed-off request on both workers (abort, stop string); False if it is not
        one (any more)."""
        h = self.handoffs.pop(core_id, None)
        if h is None:
            return False
        writer_alive = h.sent_to_prefill and self.alive(h.prefill_id)
        self.send(h.decode_id, FinishRequests([core_id], reason, release_kv=not writer_alive))
        if writer_alive:
            self.send(h.prefill_id, FinishRequests([core_id], reason))
        return True

    def forget(self, core_id: str) -> None:
        self.handoffs.pop(core_id, None)
