"""OutputProcessor: token ids from the engine core -> text outputs for the user, per request.

It lives where the tokenizer lives (in-process for `LLM`, in the HTTP frontend for the server),
so the engine core only schedules and computes. It fans a request with `n > 1` out into `n` core
requests, detokenizes each incrementally, finds stop strings (the caller must then finish those
core requests), and keeps the request's metrics as observed here: arrival, first-token and
per-token times are read when outputs arrive, queue time and cache hits come from the core.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import msgspec

from pdserve.frontend.detokenizer import IncrementalDetokenizer
from pdserve.types import (
    CompletionOutput,
    EngineCoreOutput,
    Logprob,
    RequestMetrics,
    RequestOutput,
    SamplingParams,
)


def child_requests(request_id: str, params: SamplingParams) -> list[tuple[str, SamplingParams]]:
    """The core requests of one user request: one per completion. Seeded children get seed + i,
    so the `n` choices differ and are each reproducible."""
    if params.n == 1:
        return [(request_id, params)]
    return [
        (
            f"{request_id}#{i}",
            msgspec.structs.replace(
                params, n=1, seed=None if params.seed is None else _wrap_int64(params.seed + i)
            ),
        )
        for i in range(params.n)
    ]


def _wrap_int64(x: int) -> int:
    return (x + 2**63) % 2**64 - 2**63


@dataclass(slots=True)
class _Completion:
    index: int
    core_id: str
    detok: IncrementalDetokenizer
    metrics: RequestMetrics
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Logprob] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    rejection: EngineCoreOutput | None = None  # the engine's refusal, when it refused


@dataclass(slots=True)
class _Group:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    completions: list[_Completion]
    prompt_logprobs: list[Logprob | None] | None = None

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.completions)


@dataclass(slots=True)
class ProcessedOutputs:
    request_outputs: list[RequestOutput]
    core_ids_to_stop: list[str]  # matched a stop string: finish these in the core now


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.groups: dict[str, _Group] = {}
        self.by_core_id: dict[str, tuple[_Group, _Completion]] = {}

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float,
    ) -> list[tuple[str, SamplingParams]]:
        """Register a request; returns the core requests (id, params) to send to the engine."""
        if request_id in self.groups:
            raise ValueError(f"invalid request_id={request_id!r}: already in use")
        children = child_requests(request_id, params)
        completions = []
        for i, (core_id, _) in enumerate(children):
            detok = IncrementalDetokenizer(
                self.tokenizer,
                prompt_token_ids,
                skip_special_tokens=params.skip_special_tokens,
                stop=params.stop,
                include_stop_str_in_output=params.include_stop_str_in_output,
                min_tokens=params.min_tokens,
            )
            metrics = RequestMetrics(arrival_time, num_prompt_tokens=len(prompt_token_ids))
            completions.append(_Completion(i, core_id, detok, metrics))
        group = _Group(request_id, prompt, prompt_token_ids, completions)
        self.groups[request_id] = group
        for c in completions:
            self.by_core_id[c.core_id] = (group, c)
        return children

    def core_ids(self, request_id: str) -> list[str]:
        group = self.groups.get(request_id)
        return [] if group is None else [c.core_id for c in group.completions]

    def remove(self, request_id: str) -> list[str]:
        """Forget a request (aborted by the caller); returns its core ids to abort."""
        group = self.groups.pop(request_id, None)
        if group is None:
            return []
        for c in group.completions:
            self.by_core_id.pop(c.core_id, None)
        return [c.core_id for c in group.completions]

    @property
    def has_unfinished(self) -> bool:
        return bool(self.groups)

    def process(
        self, outputs: Sequence[EngineCoreOutput], now: float | None = None
    ) -> ProcessedOutputs:
        now = time.perf_counter() if now is None else now
        touched: dict[str, _Group] = {}
        new_ids: dict[str, list[int]] = {}
        to_stop: list[str] = []
        for out in outputs:
            entry = self.by_core_id.get(out.request_id)
            if entry is None:  # aborted here while the core was still stepping
                continue
            group, comp = entry
            if comp.finish_reason is not None:
                continue
            touched[group.request_id] = group
            self._record(comp, out, now)
            if out.prompt_logprobs is not None and group.prompt_logprobs is None:
                group.prompt_logprobs = out.prompt_logprobs
            accepted = out.new_token_ids
            stop_str = comp.detok.add_tokens(accepted) if accepted else None
            if stop_str is not None:
                accepted = accepted[: comp.detok.num_output_tokens - len(comp.token_ids)]
            comp.token_ids.extend(accepted)
            # several outputs of one request can come in one call (a handoff releases the decode
            # worker's held outputs behind the first token): each adds its tokens
            new_ids.setdefault(comp.core_id, []).extend(accepted)
            if out.new_logprobs:
                comp.logprobs = (comp.logprobs or []) + out.new_logprobs[: len(accepted)]
            if stop_str is not None:
                if out.finish_reason is None:
                    to_stop.append(comp.core_id)
                comp.finish_reason, comp.stop_reason = "stop", stop_str
            elif out.finish_reason is not None:
                comp.finish_reason, comp.stop_reason = out.finish_reason, out.stop_reason
                comp.rejection = out if out.error else None
            if comp.finish_reason is not None:
                comp.metrics.finished_time = now
        results = [self._output(g, new_ids) for g in touched.values()]
        for group in touched.values():
            if group.finished:
                self.remove(group.request_id)
        return ProcessedOutputs(results, to_stop)

    @staticmethod
    def _record(comp: _Completion, out: EngineCoreOutput, now: float) -> None:
        m = comp.metrics
        if out.queue_time_s is not None:
            m.scheduled_time = m.arrival_time + out.queue_time_s
            m.num_cached_tokens = out.num_cached_tokens or 0
        m.num_preemptions = out.num_preemptions
        if out.num_spec_proposed:
            m.num_spec_proposed, m.num_spec_accepted = out.num_spec_proposed, out.num_spec_accepted
            m.num_spec_steps = out.num_spec_steps
        if out.new_token_ids:
            if m.first_token_time is None:
                m.first_token_time = now
                if m.scheduled_time is None:
                    m.scheduled_time = m.arrival_time
            m.token_times.extend([now] * len(out.new_token_ids))

    def _output(self, group: _Group, new_ids: dict[str, list[int]]) -> RequestOutput:
        outs = []
        for c in group.completions:
            done = c.finish_reason is not None
            delta = c.detok.take_delta(done)  # first: finishing flushes held-back text
            outs.append(
                CompletionOutput(
                    index=c.index,
                    text=c.detok.output_text,
                    token_ids=list(c.token_ids),
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                    logprobs=c.logprobs,
                    metrics=c.metrics,
                    new_text=delta,
                    new_token_ids=new_ids.get(c.core_id, []),
                )
            )
        refused = next((c.rejection for c in group.completions if c.rejection), None)
        return RequestOutput(
            request_id=group.request_id,
            prompt=group.prompt,
            prompt_token_ids=group.prompt_token_ids,
            outputs=outs,
            finished=group.finished,
            metrics=group.completions[0].metrics,
            error=refused.error if refused else None,
            error_code=refused.error_code if refused else None,
            error_param=refused.error_param if refused else None,
            prompt_logprobs=group.prompt_logprobs,
        )
