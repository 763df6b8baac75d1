"""The scheduler half of the KV connector: requests whose prompt KV crosses workers (no torch).

The worker half (`pdserve.disagg.connector`) moves bytes; this half keeps the books, inside the
scheduler, for both ends of a handoff:

- decode side (`KVRole.RECEIVE`): a request is admitted by *reserving* blocks for its whole
  prompt (after any local prefix hit) instead of computing it; it waits in `waiting` until a
  prefill worker's KV and first token arrive (`finish_remote`), then decodes like any other. If
  the KV never comes (timeout, dead prefill worker) it is *resumed locally*: the prompt is
  recomputed here. Blocks a prefill worker may still be writing into are never reused: when such
  a request ends early they go to `quarantine` until the writer is known to have stopped.
- prefill side (`KVRole.SEND`): a request whose first token is sampled is *handed off*
  (finished here with `FINISHED_REMOTE`); the worker half flushes its KV to the decode worker.

The scheduler calls `reserve`, `hand_off` and `drop`; the worker loop calls the rest. Every path
returns every block exactly once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from pdserve.kv.manager import KVCacheManager
from pdserve.request import Request
from pdserve.types import EngineCoreOutput, KVRole, RequestStatus

if TYPE_CHECKING:
    from pdserve.sched.scheduler import Scheduler


class RemoteKV:
    def __init__(self, scheduler: Scheduler) -> None:
        self.sched = scheduler
        self.kv: KVCacheManager = scheduler.kv
        self.waiting: dict[str, Request] = {}  # holding reserved blocks, KV on its way
        self.new_reservations: list[Request] = []  # reserved since `take_reservations`
        self.quarantine: dict[str, list] = {}  # request id -> blocks a sender may still write
        self.handed_off: list[Request] = []  # prefill side, since `take_handed_off`

    # ---- decode side ---------------------------------------------------------------------
    def reserve(self, request: Request, now: float) -> bool:
        """Admit a receiving request: hold blocks for its prompt. False: no room this step."""
        hits, num_hit_tokens = self.kv.get_computed_blocks(request)
        num_new = request.num_tokens - num_hit_tokens
        # The blocks join the prefix cache only once their KV has arrived.
        if not self.kv.allocate_slots(request, num_new, hits, publish=False):
            return False
        request.num_computed_tokens = num_hit_tokens
        request.num_cached_tokens = num_hit_tokens
        request.metrics.num_cached_tokens = num_hit_tokens
        request.metrics.scheduled_time = now
        request.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self.waiting[request.request_id] = request
        self.new_reservations.append(request)
        return True

    def take_reservations(self) -> list[Request]:
        """Reservations made since the last call (the frontend forwards them to the sender)."""
        out, self.new_reservations = self.new_reservations, []
        return out

    def block_ids(self, request_id: str) -> list[int] | None:
        """The blocks a request holds for KV that a prefill worker sends (None: it holds none,
        so nothing may be written for it)."""
        if request_id in self.waiting:
            return self.kv.block_ids(request_id)
        held = self.quarantine.get(request_id)
        return None if held is None else [b.block_id for b in held]

    def finish_remote(self, request_id: str, first_token: int) -> EngineCoreOutput | None:
        """The prompt's KV and first token arrived: the request decodes on. Returns an output
        only if the first token already ends it (EOS, stop token, max_tokens)."""
        request = self.waiting.pop(request_id, None)
        if request is None:
            return None
        request.num_computed_tokens = request.num_tokens
        self.kv.publish_blocks(request, request.num_tokens)
        request.append_output_token(first_token)
        now = self.sched.clock()
        request.metrics.first_token_time = now
        request.metrics.token_times.append(now)
        request.kv_role = None
        status = self.sched.check_stop(request, first_token)
        if status is not None:
            self.sched.finish(request, status)
            return EngineCoreOutput(
                request_id, [], finish_reason=status.finish_reason, stop_reason=request.stop_reason
            )
        request.status = RequestStatus.RUNNING
        self.sched.running.append(request)
        return None

    def resume_locally(
        self, request_id: str, output_token_ids: list[int], release_kv: bool = True
    ) -> bool:
        """Give up on the remote KV (timeout, dead prefill worker): compute the prompt here,
        continuing after the tokens the client already has. `release_kv=False`: the sender may
        still write, so the reserved blocks are quarantined rather than freed."""
        request = self.waiting.pop(request_id, None)
        if request is None:
            queued = self.sched.requests.get(request_id)
            if queued is not None and queued.kv_role == KVRole.RECEIVE:  # nothing reserved yet
                queued.kv_role = None
                for t in output_token_ids:
                    queued.append_output_token(t)
                return True
            return False
        self._let_go(request, release_kv)
        for t in output_token_ids:
            request.append_output_token(t)
        request.num_computed_tokens = 0
        request.num_cached_tokens = -1
        request.kv_role = None
        request.status = RequestStatus.WAITING
        self.sched.waiting.appendleft(request)
        return True

    def drop(self, request: Request, release_kv: bool) -> None:
        """A waiting request ends before its KV came (the scheduler then finishes it)."""
        del self.waiting[request.request_id]
        if not release_kv:
            self.quarantine[request.request_id] = self.kv.detach(request)

    def release_quarantine(self, request_ids: Iterable[str]) -> None:
        """The sender of these requests' KV stopped writing: their held blocks go back."""
        for rid in request_ids:
            blocks = self.quarantine.pop(rid, None)
            if blocks:
                self.kv.pool.free(reversed(blocks))

    def on_sender_done(
        self, done: Iterable[tuple[str, int]], aborted: Iterable[str], valid_token: Callable
    ) -> tuple[list[EngineCoreOutput], list[tuple[str, int]]]:
        """Apply a sender's signals: `done` (request id, first token) completes a transfer,
        `aborted` means the sender gave the request up (it ended there, or was aborted). Either
        way the sender writes no more, so quarantined blocks go back. Returns the outputs of
        requests that ended at once, and the (request id, first token) actually received."""
        done, aborted = list(done), list(aborted)
        outputs, received = [], []
        for rid, first_token in done:
            if rid in self.waiting and valid_token(first_token):
                out = self.finish_remote(rid, first_token)
                received.append((rid, first_token))
                if out is not None:
                    outputs.append(out)
        gone = [rid for rid in aborted if rid in self.waiting]
        self.sched.finish_requests(gone, RequestStatus.FINISHED_ABORTED)
        self.release_quarantine([rid for rid, _ in done] + aborted)
        return outputs, received

    def _let_go(self, request: Request, release_kv: bool) -> None:
        if release_kv:
            self.kv.free(request)
        else:
            self.quarantine[request.request_id] = self.kv.detach(request)

    # ---- prefill side --------------------------------------------------------------------
    def hand_off(self, request: Request) -> RequestStatus:
        """A sending request sampled its first token: the decode worker takes it from here."""
        self.handed_off.append(request)
        return RequestStatus.FINISHED_REMOTE

    def take_handed_off(self) -> list[Request]:
        out, self.handed_off = self.handed_off, []
        return out
