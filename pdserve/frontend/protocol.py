"""OpenAI-compatible request bodies (pydantic: FastAPI validates them and serves their schema).

Fields follow the OpenAI API; engine extras follow vLLM (`top_k`, `min_p`, `repetition_penalty`,
`ignore_eos`, `min_tokens`, `stop_token_ids`, `truncate_prompt_tokens`, `priority`), plus pdserve's
`deadline_ms` (the first token is wanted within that time, else a 503). Every integer is bounded
to what the engine can represent, so an absurd value is a 400, never an overflow deeper down. A
field pdserve does not know is a 400 naming it, except the metadata fields in `IGNORED_FIELDS`,
which are accepted and ignored. `to_sampling_params` turns a body into `SamplingParams`, whose own
validation names the field and the value of any bad setting; the configurable per-request limits
(`--max-n`, ...) are checked in `pdserve.frontend.limits` before any work is done.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, model_validator

from pdserve.types import SamplingParams

INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

Int32 = Annotated[StrictInt, Field(ge=-INT32_MAX - 1, le=INT32_MAX)]
Count = Annotated[StrictInt, Field(ge=0, le=INT32_MAX)]  # how many of something
Int64 = Annotated[StrictInt, Field(ge=INT64_MIN, le=INT64_MAX)]
TokenIds = list[StrictInt]  # checked against the vocabulary before any work

# OpenAI request metadata with no effect on generation: accepted and ignored (documented).
IGNORED_FIELDS = frozenset(
    {"user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key"}
)


class UnknownFieldError(ValueError):
    def __init__(self, field: str) -> None:
        super().__init__(f"unsupported field '{field}': pdserve does not implement it")
        self.field = field


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")

    @model_validator(mode="after")
    def _no_unknown_fields(self):
        for name in self.model_extra or {}:
            if name not in IGNORED_FIELDS:
                raise UnknownFieldError(name)
        return self


class StreamOptions(_Body):
    include_usage: StrictBool = False


class _SamplingBody(_Body):
    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: Count = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: Int64 | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # vLLM-style extras
    top_k: Int32 | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: StrictBool = False
    min_tokens: Count = 0
    stop_token_ids: list[Int32] | None = None
    truncate_prompt_tokens: Annotated[StrictInt, Field(ge=1, le=INT32_MAX)] | None = None
    skip_special_tokens: StrictBool = True
    include_stop_str_in_output: StrictBool = False
    prompt_logprobs: Int32 | None = None
    priority: Int32 = 0  # lower is admitted first (FCFS within a priority)
    deadline_ms: Annotated[StrictInt, Field(ge=1, le=INT32_MAX)] | None = None
    # Structured output (one of them; `pdserve.structured.spec`)
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @property
    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def _sampling(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        if self.stream_options is not None and not self.stream:
            raise ValueError("invalid stream_options: only allowed when stream is true")
        return SamplingParams(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            min_p=self.min_p or 0.0,
            seed=self.seed,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=self.stop_list,
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logprobs=logprobs,
            prompt_logprobs=self.prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            priority=self.priority,
            deadline_s=None if self.deadline_ms is None else self.deadline_ms / 1e3,
        )


class CompletionRequest(_SamplingBody):
    prompt: str | list[str] | TokenIds | list[TokenIds]
    max_tokens: Int32 | None = 16
    logprobs: Int32 | None = None
    echo: StrictBool = False
    suffix: str | None = None
    best_of: Count | None = None
    logit_bias: dict[str, float] | None = None

    def to_sampling_params(self) -> SamplingParams:
        params = self._sampling(self.max_tokens, self.logprobs)
        if self.echo and self.logprobs is not None and params.prompt_logprobs is None:
            # echo + logprobs scores the prompt too (what log-likelihood clients rely on)
            params = msgspec.structs.replace(params, prompt_logprobs=self.logprobs)
        return params


class FunctionDef(_Body):
    name: Annotated[str, Field(min_length=1, max_length=256)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError("invalid messages: only text content parts are supported")
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(_SamplingBody):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Int32 | None = None
    max_completion_tokens: Int32 | None = None
    logprobs: StrictBool = False
    top_logprobs: Int32 | None = None
    add_generation_prompt: StrictBool = True
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool = True
    logit_bias: dict[str, float] | None = None

    def to_sampling_params(self) -> SamplingParams:
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise ValueError("invalid top_logprobs: needs logprobs set to true")
            if self.top_logprobs < 0:
                raise ValueError(f"invalid top_logprobs={self.top_logprobs}: must be >= 0")
        max_tokens = self.max_completion_tokens or self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling(max_tokens, logprobs)
