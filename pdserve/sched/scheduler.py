"""Scheduler: continuous batching with a per-step token budget and chunked prefill (no torch).

Each step, running requests are served first (a decode takes one token; a request still in
prefill takes its next chunk), then waiting requests are admitted while the token budget,
`max_num_seqs` and the KV pool allow. When a running request cannot get a block, the newest
running request is preempted: its blocks are returned and it is recomputed later (its prefix
will usually still be cached). Every path that ends a request returns its blocks.

Admission order is FCFS within a priority (`SamplingParams.priority`, lower first). A waiting
request gains one priority level per `priority_aging_s` it has waited, so a low priority is
delayed, never starved. With priorities in play, running requests are served in the same order
(an urgent prompt's chunk takes the budget before a lax one's) and preemption takes the
lowest-priority newest request. With `priority_preemption`, priorities go further: while a
prompt of a more urgent priority has tokens to compute, less urgent requests get none (their
streams pause while it prefills), and a waiting urgent request preempts less urgent running
ones for a sequence slot or KV blocks (they are recomputed later, from the prefix cache where it
still holds them): the low priorities absorb the queueing. While they sit out, an urgent prompt
is not held to `long_prefill_token_threshold` (which bounds the pause of streams that share its
steps, paused anyway): it takes what the step budget leaves after the urgent decodes. The rules
are in `sched/priority.py`.

Two settings serve interactive traffic (the chat profile):

- `prefill_first`: a new prompt's next chunk is scheduled before the chunks of prompts already
  in prefill (a short question does not wait behind a long document), while every running
  decode still gets its token each step: a stream pauses for at most one chunk.
- `reserved_kv_fraction`: new requests are admitted only while this share of the KV blocks
  stays free for the requests already running, so a running stream is not preempted to make
  room for a newcomer.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from pdserve.config import SchedulerConfig
from pdserve.kv.manager import KVCacheManager
from pdserve.request import Request
from pdserve.sched.priority import PriorityPolicy
from pdserve.sched.remote_kv import RemoteKV
from pdserve.spec.proposer import Proposer
from pdserve.types import EngineCoreOutput, KVRole, Logprob, RequestStatus, Verdict


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # proposed tokens included
    sample: bool  # this chunk reaches the end of the known tokens: sample the next one
    # Speculative decoding: tokens proposed after the request's last one, verified this step
    # (the step computes 1 + len(spec_tokens) tokens and emits 1 to len(spec_tokens) + 1).
    spec_tokens: list[int] = field(default_factory=list)


@dataclass(slots=True)
class SchedulerOutput:
    """One step's plan: which requests compute how many tokens. Requests are referenced whole (the
    runner lives in the same process); their block tables are `kv.block_ids(request_id)`."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0  # per step
    num_preempted: int = 0
    # A burst (`--num-scheduler-steps`): decode steps run back to back, each request's greedy
    # token the input of its next step; the KV slots of all of them are allocated.
    num_steps: int = 1

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens


@dataclass(slots=True)
class SchedulerStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    num_preemptions: int = 0  # cumulative
    prefix_queries: int = 0  # cumulative prompt tokens looked up
    prefix_hits: int = 0


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.config = config
        self.kv = kv
        self.clock = clock  # the simulator (pdserve.planner) runs it on simulated time
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.priority = PriorityPolicy(config)
        self.remote = RemoteKV(self)  # the connector's half: requests whose KV crosses workers
        spec = config.speculation
        self.proposer = Proposer(spec, config.max_model_len) if spec is not None else None
        # the longest burst (1: none); the engine lowers it where its runner cannot run them
        self.max_steps = config.num_scheduler_steps

    # ---- requests in and out -------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a request (validated by `pdserve.validation` when it was made)."""
        if request.request_id in self.requests:
            raise ValueError(f"invalid request_id={request.request_id!r}: already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)
        self.kv.prefetch(request)  # an offload tier reads its history while it waits

    def finish_requests(
        self, request_ids: Iterable[str], status: RequestStatus, release_kv: bool = True
    ) -> list[Request]:
        """End requests from outside the step (abort, stop string): blocks are returned at once,
        except those a prefill worker may still be writing into when `release_kv` is False."""
        ended = []
        for rid in request_ids:
            request = self.requests.get(rid)
            if request is None or request.is_finished:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            elif request.status == RequestStatus.WAITING_FOR_REMOTE_KV:
                self.remote.drop(request, release_kv)
            else:
                self.waiting.remove(request)
            self.finish(request, status)
            ended.append(request)
        return ended

    def finish(self, request: Request, status: RequestStatus) -> None:
        """End a request that is off the running and waiting lists; its blocks go back."""
        request.status = status
        request.metrics.finished_time = self.clock()
        self.kv.free(request)
        del self.requests[request.request_id]

    def expire_waiting(self, now: float) -> list[Request]:
        """End requests that were never scheduled before their queue deadline."""
        expired = [
            r
            for r in self.waiting
            if r.queue_deadline is not None
            and r.metrics.scheduled_time is None
            and now > r.queue_deadline
        ]
        return self.finish_requests([r.request_id for r in expired], RequestStatus.FINISHED_ABORTED)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ---- the plan ------------------------------------------------------------------------
    def _chunk(self, request: Request, budget: int, unbounded: bool = False) -> int:
        n = min(request.num_tokens - request.num_computed_tokens, budget)
        if self.config.long_prefill_token_threshold and not unbounded:
            n = min(n, self.config.long_prefill_token_threshold)
        return n

    def _make_room(self, request: Request, now: float, out: SchedulerOutput) -> bool:
        """priority_preemption: preempt the least urgent, newest running request that is less
        urgent than `request` and not in this step's plan, to give `request` its slot or
        blocks."""
        planned = {id(item.request) for item in out.scheduled}
        victims = self.priority.yielding_to(request, self.running, now, planned)
        if not victims:
            return False
        victim = self.priority.victim(victims, now)
        self.running.remove(victim)
        self._preempt(victim)
        self.waiting.rotate(-1)  # the victim to the back: `request` stays at the head
        out.num_preempted += 1
        return True

    def _prefill_reserve(
        self, budget: int, sits_out: Callable[[Request], bool], unbounded: Callable
    ) -> int:
        """prefill_first: the tokens the waiting head's next chunk needs this step."""
        if not (self.config.prefill_first and self.waiting) or sits_out(self.waiting[0]):
            return 0
        if self._slots_full():
            return 0
        head = self.waiting[0]
        return self._chunk(head, budget, unbounded(head)) if head.kv_role != KVRole.RECEIVE else 0

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        now = self.clock()
        self.waiting = self.priority.ordered(self.waiting, now)
        self.priority.sort_running(self.running, now)
        urgent = self.priority.urgent_level(self.running, self.waiting, now)
        level = self.priority.level(now)
        sits_out = (lambda r: level(r) > urgent) if urgent is not None else (lambda r: False)
        # While less urgent requests sit out, an urgent prompt is not held to the per-stream
        # chunk (`long_prefill_token_threshold` bounds the pause of the streams sharing a step,
        # and those streams are paused anyway): it takes what the budget leaves.
        pausing = urgent is not None and any(sits_out(r) for r in (*self.running, *self.waiting))
        unbounded = (lambda r: level(r) == urgent) if pausing else (lambda r: False)
        reserve = self._prefill_reserve(budget, sits_out, unbounded)
        # prefill_first: one token of the budget stays with each running decode
        decodes_left = (
            sum(r.num_tokens - r.num_computed_tokens == 1 and not sits_out(r) for r in self.running)
            if reserve
            else 0
        )

        if self.proposer is not None:
            self.proposer.begin_step(
                sum(
                    r.num_tokens - r.num_computed_tokens == 1 and r.num_output_tokens > 0
                    for r in self.running
                )
            )
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            if sits_out(request):  # a more urgent prompt is in prefill
                i += 1
                continue
            if not reserve:
                num_new = self._chunk(request, budget, unbounded(request))
            elif request.num_tokens - request.num_computed_tokens == 1:
                decodes_left -= 1
                num_new = 1
            else:  # a prompt in prefill: after the new prompt's chunk and the decodes
                num_new = self._chunk(request, budget - reserve - decodes_left, unbounded(request))
                if num_new <= 0:
                    i += 1
                    continue
            spec: list[int] = []
            if self.proposer is not None and num_new == 1 and request.num_output_tokens > 0:
                spare = budget - 1 - (reserve + max(decodes_left, 0) if reserve else 0)
                spec = self.proposer.propose(request, spare)
                # proposals never cost a preemption: without room they are dropped
                if spec and self.kv.allocate_slots(request, 1 + len(spec)):
                    self._add(out, request, 1 + len(spec), spec)
                    budget -= 1 + len(spec)
                    i += 1
                    continue
            while not self.kv.allocate_slots(request, num_new):
                victim = self.priority.victim(self.running[i:], now)
                self.running.remove(victim)
                self._preempt(victim)
                out.num_preempted += 1
                if victim is request:
                    break
            else:
                self._add(out, request, num_new)
                budget -= num_new
                i += 1

        # KV blocks kept free for the running requests (none to keep when nothing runs)
        keep_free = 0
        if self.running and self.config.reserved_kv_fraction:
            keep_free = math.ceil(self.config.reserved_kv_fraction * self.kv.num_blocks)
        # After a preemption for KV the pool is short: admit nothing new this step.
        short = out.num_preempted > 0
        while self.waiting and budget > 0 and not short:
            request = self.waiting[0]
            if sits_out(request):
                break
            if self._slots_full():
                if not self._make_room(request, now, out):
                    break
                continue
            if request.kv_role == KVRole.RECEIVE:
                if not self.remote.reserve(request, now):
                    break
                self.waiting.popleft()
                continue
            hits, num_hit_tokens = None, 0
            # Prompt logprobs need every prompt position computed: no prefix-cache hit then.
            if request.num_computed_tokens == 0 and request.sampling_params.prompt_logprobs is None:
                hits, num_hit_tokens = self.kv.get_computed_blocks(request)
            remaining = request.num_tokens - request.num_computed_tokens - num_hit_tokens
            num_new = min(remaining, budget)
            if self.config.long_prefill_token_threshold and not unbounded(request):
                num_new = min(num_new, self.config.long_prefill_token_threshold)
            if num_new < remaining and not self.config.enable_chunked_prefill:
                break
            if not self.kv.allocate_slots(request, num_new, hits, keep_free=keep_free):
                if self._make_room(request, now, out):
                    continue  # blocks freed by a less urgent request: try again
                break
            self.waiting.popleft()
            request.num_computed_tokens += num_hit_tokens
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit_tokens
                request.metrics.num_cached_tokens = num_hit_tokens
            if request.metrics.scheduled_time is None:
                request.metrics.scheduled_time = now
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            self._add(out, request, num_new)
            budget -= num_new
        if self.max_steps > 1:
            out.num_steps = self._burst(out)
        return out

    def _burst(self, out: SchedulerOutput) -> int:
        """How many decode steps the plan runs back to back, with their KV slots allocated.

        A burst runs only when every running request decodes, each takes the raw argmax (no
        sampler between its steps), no prompt's KV is on its way from a prefill worker, and no
        waiting request could start before a running one ends (a newcomer's prompt would wait
        for the burst, at most `max_steps - 1` steps: `_queue_blocked`). It ends where the
        first request reaches its `max_tokens` or the context, so no burst computes past a
        length limit, and a slot that a length limit frees is free at the same step as without
        bursts; a request that stops earlier (EOS, a stop token) leaves the rest of its burst
        unused, and a request waiting for its slot waits for that rest too. Without blocks for
        the whole burst it is one step, and nothing is preempted for it."""
        if out.num_prefill_tokens or out.num_preempted or self.remote.waiting:
            return 1
        if self.waiting and not self._queue_blocked():
            return 1
        if len(out.scheduled) != len(self.running):
            return 1
        steps = self.max_steps
        for item in out.scheduled:
            r = item.request
            if item.spec_tokens or not item.sample or r.kv_role == KVRole.SEND:
                return 1
            if not r.sampling_params.takes_raw_argmax(r.num_output_tokens):
                return 1
            left = min(r.max_tokens - r.num_output_tokens, self.config.max_model_len - r.num_tokens)
            steps = min(steps, left)
        if steps <= 1:
            return 1
        for item in out.scheduled:
            if not self.kv.allocate_slots(item.request, steps):
                for done in out.scheduled:  # back to one step: the extra blocks go back
                    self.kv.trim(done.request, done.request.num_tokens)
                return 1
        return steps

    def _slots_full(self) -> bool:
        """Every sequence slot is taken: by a running request, or reserved for one whose KV
        comes from a prefill worker."""
        return len(self.running) + len(self.remote.waiting) >= self.config.max_num_seqs

    def _queue_blocked(self) -> bool:
        """No waiting request can start before a running one ends: every sequence slot is taken
        (as offline batches of more requests than `max_num_seqs` keep them), and none can be
        taken from a running request (priority preemption with priorities in play, where aging
        makes a waiting request more urgent as time passes)."""
        if not self._slots_full():
            return False
        every = (*self.running, *self.waiting)
        return not (self.config.priority_preemption and self.priority.in_play(every))

    def _add(
        self, out: SchedulerOutput, request: Request, num_new: int, spec: list[int] = ()
    ) -> None:
        sample = request.num_computed_tokens + num_new - len(spec) == request.num_tokens
        sample = sample and request.max_tokens > 0  # max_tokens 0: score the prompt only
        out.scheduled.append(ScheduledRequest(request, num_new, sample, list(spec)))
        if num_new - len(spec) == 1 and request.num_output_tokens > 0:
            out.num_decode_tokens += num_new
        else:
            out.num_prefill_tokens += num_new

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.metrics.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    # ---- after the forward ---------------------------------------------------------------
    def update(
        self,
        plan: SchedulerOutput,
        sampled: list[int],
        logprobs: list[Logprob | None] | None = None,
        prompt_logprobs: dict[str, tuple[int, list[Logprob]]] | None = None,
        speculated: dict[str, Verdict] | None = None,
        bursts: list[list[int]] | None = None,
    ) -> list[EngineCoreOutput]:
        """Advance the counters by the computed tokens, append sampled tokens (one per sampling
        request, in plan order; `speculated`: what each request with proposals emits; `bursts`:
        a burst plan's tokens per request, as many as the runner ran of its steps), and finish
        requests that hit EOS, a stop token or a length."""
        now = self.clock()
        outputs: list[EngineCoreOutput] = []
        for rid, (start, scored) in (prompt_logprobs or {}).items():
            request = self.requests.get(rid)
            if request is not None:
                if request.prompt_logprobs is None:
                    request.prompt_logprobs = [None] * request.num_prompt_tokens
                request.prompt_logprobs[start : start + len(scored)] = scored
        if bursts is not None:
            return self._update_burst(plan, bursts, now)
        k = 0
        for item in plan.scheduled:
            request = item.request
            if item.spec_tokens:
                out = self._update_speculated(request, item, speculated[request.request_id], now)
                if out is not None:
                    outputs.append(out)
                continue
            request.num_computed_tokens += item.num_new_tokens
            if not item.sample:
                if (
                    request.max_tokens == 0
                    and request.num_computed_tokens == request.num_tokens
                    and not request.is_finished
                ):
                    outputs.append(self._finish_scored(request))
                continue
            token = sampled[k]
            lp = logprobs[k] if logprobs is not None else None
            k += 1
            if request.is_finished:  # ended by an abort during the step
                continue
            request.append_output_token(token)
            m = request.metrics
            m.token_times.append(now)
            out = EngineCoreOutput(request.request_id, [token], new_logprobs=[lp] if lp else None)
            if m.first_token_time is None:
                m.first_token_time = now
                out.queue_time_s = m.queue_time
                out.num_cached_tokens = max(request.num_cached_tokens, 0)
                out.prompt_logprobs = self._full_prompt_logprobs(request)
            out.num_preemptions = m.num_preemptions
            status = self.check_stop(request, token)
            if status is None and request.kv_role == KVRole.SEND:
                status = self.remote.hand_off(request)
            if status is not None:
                self.running.remove(request)
                self.finish(request, status)
                out.finish_reason = status.finish_reason
                out.stop_reason = request.stop_reason
            outputs.append(out)
        return outputs

    def _update_speculated(
        self, request: Request, item: ScheduledRequest, verdict: Verdict, now: float
    ) -> EngineCoreOutput | None:
        """A verified step: the accepted proposals and the model's next token, each checked for
        a stop; the KV of the rejected proposals' positions is left to be overwritten."""
        emitted, logprobs = verdict.tokens, verdict.logprobs
        accepted = len(emitted) - 1
        request.num_computed_tokens += 1 + accepted  # the last token and the accepted proposals
        self.proposer.record(request, len(item.spec_tokens), accepted)
        m = request.metrics
        m.num_spec_proposed += len(item.spec_tokens)
        m.num_spec_accepted += accepted
        m.num_spec_steps += 1
        if request.is_finished:  # ended by an abort during the step
            return None
        out = self._emit(request, emitted, logprobs, now)
        out.num_spec_proposed, out.num_spec_accepted = m.num_spec_proposed, m.num_spec_accepted
        out.num_spec_steps = m.num_spec_steps
        return out

    def _update_burst(
        self, plan: SchedulerOutput, bursts: list[list[int]], now: float
    ) -> list[EngineCoreOutput]:
        """A burst: each request's tokens, checked for a stop one by one (a request that
        stops leaves the KV of its burst's later positions unused, and frees it with the rest)."""
        outputs = []
        for item, tokens in zip(plan.scheduled, bursts, strict=True):
            request = item.request
            request.num_computed_tokens += len(tokens)  # its last token and all but the newest
            if not request.is_finished:  # else ended by an abort during the step
                outputs.append(self._emit(request, tokens, None, now))
        return outputs

    def _emit(
        self, request: Request, tokens: list[int], logprobs: list[Logprob] | None, now: float
    ) -> EngineCoreOutput:
        """Append tokens a step made in a row, up to the first that stops the request; the
        request ends there, else its blocks past what the next step computes (rejected
        proposals, an unused end of a burst) go back."""
        m = request.metrics
        out = EngineCoreOutput(request.request_id, [], new_logprobs=[] if logprobs else None)
        status = None
        for j, token in enumerate(tokens):
            request.append_output_token(token)
            m.token_times.append(now)
            out.new_token_ids.append(token)
            if logprobs:
                out.new_logprobs.append(logprobs[j])
            status = self.check_stop(request, token)
            if status is not None:
                break
        out.num_preemptions = m.num_preemptions
        if status is not None:
            # full blocks whose KV this step computed go to the prefix cache, as a one-token
            # step's do when it is scheduled (a later turn finds the output there)
            self.kv.publish_blocks(request, request.num_computed_tokens)
            self.running.remove(request)
            self.finish(request, status)
            out.finish_reason = status.finish_reason
            out.stop_reason = request.stop_reason
        else:
            self.kv.trim(request, request.num_tokens)
        return out

    def observe_step(self, plan: SchedulerOutput, seconds: float) -> None:
        """How long the plan's forward took (for the speculation rule; after `update`)."""
        if self.proposer is not None:
            speculated = any(s.spec_tokens for s in plan.scheduled)
            decoding = sum(bool(s.spec_tokens) or s.num_new_tokens == 1 for s in plan.scheduled)
            self.proposer.observe_step(speculated, plan.num_prefill_tokens == 0, seconds, decoding)

    def _finish_scored(self, request: Request) -> EngineCoreOutput:
        """A `max_tokens=0` request whose prompt is computed: it ends without a token."""
        self.running.remove(request)
        self.finish(request, RequestStatus.FINISHED_LENGTH)
        return EngineCoreOutput(
            request.request_id,
            [],
            finish_reason="length",
            queue_time_s=request.metrics.queue_time,
            num_cached_tokens=max(request.num_cached_tokens, 0),
            prompt_logprobs=self._full_prompt_logprobs(request),
        )

    @staticmethod
    def _full_prompt_logprobs(request: Request) -> list[Logprob | None] | None:
        if request.sampling_params.prompt_logprobs is None:
            return None
        return request.prompt_logprobs or [None] * request.num_prompt_tokens

    def check_stop(self, request: Request, token: int) -> RequestStatus | None:
        params = request.sampling_params
        if request.grammar_state is not None and token in request.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED  # a grammar decides where its output ends
        if request.num_output_tokens >= params.min_tokens:
            if token in params.stop_token_ids:
                request.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
            if not params.ignore_eos and token in request.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= request.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if request.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def queued_prefill_tokens(self) -> int:
        """Prompt tokens still to compute (waiting requests and prompts mid-prefill): the load
        signal the router balances prefill work by."""
        return sum(
            r.num_tokens - r.num_computed_tokens
            for r in (*self.waiting, *self.running)
            if r.num_output_tokens == 0
        )

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_usage=self.kv.usage,
            num_preemptions=self.num_preemptions,
            prefix_queries=self.kv.stats.queries,
            prefix_hits=self.kv.stats.hits,
        )
