"""LLM: the offline API. Give it prompts, get completions back in input order.

from pdserve import LLM, SamplingParams
llm = LLM(model="path/to/hf-folder", max_num_seqs=32)
outs = llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=64))
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pdserve.config import EngineArgs
from pdserve.engine.llm_engine import LLMEngine
from pdserve.types import RequestOutput, SamplingParams

Prompt = str | Sequence[int]


class LLM:
    def __init__(self, model: str, **engine_args: Any) -> None:
        unknown = set(engine_args) - EngineArgs.field_names()
        if unknown:
            raise ValueError(f"invalid engine argument(s): {', '.join(sorted(unknown))}")
        self.engine = LLMEngine(EngineArgs(model=model, **engine_args))
        self._next_id = 0

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLM:
        llm = cls.__new__(cls)
        llm.engine = LLMEngine(args)
        llm._next_id = 0
        return llm

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def close(self) -> None:
        """End the engine's helper processes (tensor-parallel ranks) now, not when this object
        is collected. The engine cannot run after it."""
        self.engine.core.close()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        prompts = _as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(
                    f"invalid sampling_params: {len(params)} given for {len(prompts)} prompts"
                )
        ids = []
        try:
            for prompt, p in zip(prompts, params):
                rid = f"offline-{self._next_id}"
                self._next_id += 1
                self.engine.add_request(rid, prompt, p)
                ids.append(rid)
        except ValueError:
            for rid in ids:  # all or nothing: a bad prompt queues none of the batch
                self.engine.abort_request(rid)
            raise
        return self._run(ids)

    def _run(self, ids: list[str]) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished:
            for out in self.engine.step():
                if out.finished:
                    done[out.request_id] = out
        return [done[rid] for rid in ids]


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if not prompts:
        raise ValueError("invalid prompts: the list is empty")
    if all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt of token ids
    return prompts
