"""LLMEngine: text in, text out, around an `EngineCore`.

It tokenizes prompts, fans a request with `n > 1` out into `n` core requests (their prompt blocks
are shared through the prefix cache), detokenizes incrementally, applies stop strings (a match
finishes the core request at once, returning its blocks) and groups results back per request.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from pdserve.config import EngineArgs
from pdserve.engine.core import EngineCore
from pdserve.engine.detokenizer import IncrementalDetokenizer
from pdserve.request import Request
from pdserve.types import CompletionOutput, Logprob, RequestOutput, SamplingParams


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"invalid tokenizer={path!r}: {e}") from None


@dataclass(slots=True)
class _Completion:
    index: int
    request: Request
    detok: IncrementalDetokenizer
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[Logprob] | None = None


@dataclass(slots=True)
class _Group:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    completions: list[_Completion] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.completions)


class LLMEngine:
    def __init__(self, args: EngineArgs, core: EngineCore | None = None) -> None:
        self.args = args
        self.core = core or EngineCore(args)
        self.tokenizer = load_tokenizer(args.tokenizer or args.model)
        self.groups: dict[str, _Group] = {}
        self.child_to_group: dict[str, tuple[_Group, _Completion]] = {}

    @property
    def max_model_len(self) -> int:
        return self.core.max_model_len

    def tokenize(self, prompt: str | Sequence[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("invalid prompt: it is empty")
            return prompt, self.tokenizer.encode(prompt)
        ids = list(prompt)
        if not all(isinstance(t, int) for t in ids):
            raise ValueError("invalid prompt: token ids must be integers")
        return None, ids

    def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams,
        arrival_time: float | None = None,
    ) -> None:
        """Validate and queue a request; raises ValueError (nothing queued) on bad input."""
        if request_id in self.groups:
            raise ValueError(f"invalid request_id={request_id!r}: already in use")
        arrival_time = time.perf_counter() if arrival_time is None else arrival_time
        text, ids = self.tokenize(prompt)
        group = _Group(request_id, text, ids)
        requests = []
        for i in range(params.n):
            child_params = params
            if params.n > 1:
                seed = None if params.seed is None else params.seed + i
                child_params = _replace(params, n=1, seed=seed)
            child_id = request_id if params.n == 1 else f"{request_id}#{i}"
            req = self.core.make_request(child_id, ids, child_params, arrival_time)
            detok = IncrementalDetokenizer(
                self.tokenizer,
                ids,
                skip_special_tokens=params.skip_special_tokens,
                stop=params.stop,
                include_stop_str_in_output=params.include_stop_str_in_output,
            )
            group.completions.append(_Completion(i, req, detok))
            requests.append(req)
        for req, comp in zip(requests, group.completions):
            self.core.add_request(req)
            self.child_to_group[req.request_id] = (group, comp)
        self.groups[request_id] = group

    def abort_request(self, request_id: str) -> None:
        group = self.groups.pop(request_id, None)
        if group is None:
            return
        ids = [c.request.request_id for c in group.completions]
        self.core.abort_requests(ids)
        for rid in ids:
            self.child_to_group.pop(rid, None)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.groups)

    def step(self) -> list[RequestOutput]:
        touched: dict[str, _Group] = {}
        new_tokens: dict[str, list[int]] = {}
        for out in self.core.step():
            group, comp = self.child_to_group[out.request_id]
            touched[group.request_id] = group
            new_tokens[out.request_id] = out.new_token_ids
            if out.new_logprobs and comp.request.sampling_params.logprobs is not None:
                comp.logprobs = (comp.logprobs or []) + out.new_logprobs
            stop_str = comp.detok.add_tokens(out.new_token_ids)
            if stop_str is not None:
                if out.finish_reason is None:
                    self.core.stop_requests([out.request_id])
                comp.finish_reason, comp.stop_reason = "stop", stop_str
            elif out.finish_reason is not None:
                comp.finish_reason, comp.stop_reason = out.finish_reason, out.stop_reason
        results = []
        for group in touched.values():
            results.append(self._output(group, new_tokens))
            if group.finished:
                del self.groups[group.request_id]
                for c in group.completions:
                    self.child_to_group.pop(c.request.request_id, None)
        return results

    def _output(self, group: _Group, new_tokens: dict[str, list[int]]) -> RequestOutput:
        outs = []
        for c in group.completions:
            done = c.finish_reason is not None
            outs.append(
                CompletionOutput(
                    index=c.index,
                    text=c.detok.output_text,
                    token_ids=list(c.request.output_token_ids),
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                    logprobs=c.logprobs,
                    metrics=c.request.metrics,
                    new_text=c.detok.take_delta(done),
                    new_token_ids=new_tokens.get(c.request.request_id, []),
                )
            )
        return RequestOutput(
            request_id=group.request_id,
            prompt=group.prompt,
            prompt_token_ids=group.prompt_token_ids,
            outputs=outs,
            finished=group.finished,
            metrics=group.completions[0].request.metrics,
        )


def _replace(params: SamplingParams, **changes) -> SamplingParams:
    import msgspec

    return msgspec.structs.replace(params, **changes)
