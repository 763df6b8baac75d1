"""The one check of a tokenized request against an engine's limits (no torch).

The frontend runs it before queueing anything (a 400 the client can act on), the engine core runs
it again when the request reaches a worker (the offline `LLM`, and a worker whose own limits are
tighter, for example a smaller KV cache): the same code, so the same message either way. A
failure raises `InvalidRequest`, which names the parameter at fault and an OpenAI-style code.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


class InvalidRequest(ValueError):
    """A request the engine cannot serve as asked: the client's to fix (HTTP 400)."""

    def __init__(self, message: str, param: str = "prompt", code: str = "invalid_value") -> None:
        super().__init__(message)
        self.param = param
        self.code = code


@dataclass(frozen=True)
class EngineLimits:
    max_model_len: int  # tokens of context, prompt and output together
    vocab_size: int
    kv_capacity: int | None = None  # tokens the whole KV cache holds (None: not checked)
    max_unchunked_prompt: int | None = None  # chunked prefill off: the step's token budget

    def check(self, prompt_ids: Sequence[int], max_tokens: int | None) -> int:
        """Validate a prompt and its `max_tokens`; returns the output budget: `max_tokens`, or
        without one what the context (and the KV cache, when known) leaves."""
        n = len(prompt_ids)
        if n == 0:
            raise InvalidRequest("invalid prompt: it is empty")
        bad = next((t for t in prompt_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise InvalidRequest(
                f"invalid prompt: token id {bad} is outside the vocabulary [0, {self.vocab_size})"
            )
        room = self.max_model_len - n
        if room < 1:
            raise self.too_long(n)
        if max_tokens is not None and max_tokens > room:
            raise InvalidRequest(
                f"invalid max_tokens={max_tokens}: the prompt has {n} tokens and the context is "
                f"{self.max_model_len}, so at most {room} can be generated",
                param="max_tokens",
                code="context_length_exceeded",
            )
        if self.max_unchunked_prompt is not None and n > self.max_unchunked_prompt:
            raise InvalidRequest(
                f"invalid prompt: {n} tokens exceeds max_num_batched_tokens "
                f"({self.max_unchunked_prompt}) with chunked prefill disabled"
            )
        budget = room if max_tokens is None else max_tokens
        if self.kv_capacity is None:
            return budget
        if max_tokens is None:  # up to the context, or as much as the whole KV cache holds
            budget = min(room, self.kv_capacity - n)
        if n + budget > self.kv_capacity or (max_tokens is None and budget < 1):
            raise InvalidRequest(
                f"invalid request: {n} prompt + {budget} output tokens exceed the KV "
                f"cache ({self.kv_capacity} tokens); raise --kv-cache-memory or lower max_tokens",
                param="max_tokens" if max_tokens is not None else "prompt",
            )
        return budget

    def too_long(self, num_tokens: int) -> InvalidRequest:
        return InvalidRequest(
            f"the prompt has {num_tokens} tokens, but this model's context is "
            f"{self.max_model_len} tokens (room for at least one output token is needed); "
            "shorten it or set truncate_prompt_tokens",
            code="context_length_exceeded",
        )
