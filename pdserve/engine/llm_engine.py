"""LLMEngine: text in, text out, around an in-process `EngineCore`.

Tokenizes prompts, hands each request's core requests to the core, and turns the core's token
outputs into text through the `OutputProcessor` (the same one the server frontend uses). A stop
string match finishes the core request at once, returning its blocks.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from pdserve.config import EngineArgs
from pdserve.engine.core import EngineCore
from pdserve.frontend.output_processor import OutputProcessor, child_requests
from pdserve.frontend.tokenizer import load_tokenizer
from pdserve.types import RequestOutput, SamplingParams


def tokenize(tokenizer, prompt: str | Sequence[int]) -> tuple[str | None, list[int]]:
    """A prompt as (text or None, token ids); raises ValueError for an empty or malformed one."""
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("invalid prompt: it is empty")
        return prompt, tokenizer.encode(prompt)
    ids = list(prompt)
    if not ids:
        raise ValueError("invalid prompt: it is empty")
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise ValueError("invalid prompt: token ids must be integers")
    return None, ids


class LLMEngine:
    def __init__(self, args: EngineArgs, core: EngineCore | None = None) -> None:
        self.args = args
        self.core = core or EngineCore(args)
        self.tokenizer = load_tokenizer(args.tokenizer or args.model)
        self.output_processor = OutputProcessor(self.tokenizer)

    @property
    def max_model_len(self) -> int:
        return self.core.max_model_len

    def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams,
        arrival_time: float | None = None,
    ) -> None:
        """Validate and queue a request; raises ValueError (nothing queued) on bad input."""
        arrival_time = time.perf_counter() if arrival_time is None else arrival_time
        text, ids = tokenize(self.tokenizer, prompt)
        if request_id in self.output_processor.groups:
            raise ValueError(f"invalid request_id={request_id!r}: already in use")
        # Validate every child before registering anything.
        reqs = [
            self.core.make_request(cid, ids, p, arrival_time)
            for cid, p in child_requests(request_id, params)
        ]
        self.output_processor.add_request(request_id, text, ids, params, arrival_time)
        for req in reqs:
            self.core.add_request(req)

    def abort_request(self, request_id: str) -> None:
        self.core.abort_requests(self.output_processor.remove(request_id))

    @property
    def has_unfinished(self) -> bool:
        return self.output_processor.has_unfinished

    def step(self) -> list[RequestOutput]:
        processed = self.output_processor.process(self.core.step())
        if processed.core_ids_to_stop:
            self.core.stop_requests(processed.core_ids_to_stop)
        return processed.request_outputs
