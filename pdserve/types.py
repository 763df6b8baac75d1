"""Plain request data shared by the engine, the server and the benchmark (no torch here).

`SamplingParams` is a msgspec Struct so it crosses process boundaries as-is; it validates itself
on construction and raises `ValueError` naming the field and the value. `RequestMetrics` holds the
raw timestamps of one request and derives every latency figure from them, with the definitions of
docs/ARCHITECTURE.md (queue, prefill, TTFT, ITL, TPOT, E2E).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

import msgspec


class SamplingParams(msgspec.Struct, kw_only=True):
    """How to sample one request's output. Defaults follow the OpenAI API (temperature 1)."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16  # None: up to the model's context
    min_tokens: int = 0
    stop: list[str] = msgspec.field(default_factory=list)
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # top-k logprobs per output token (0: only the sampled one)
    prompt_logprobs: int | None = None  # top-k logprobs per prompt token (0: only its own)
    skip_special_tokens: bool = True
    # Structured output: an llguidance grammar the output must match (`pdserve.structured`).
    grammar: str | None = None
    # Scheduling, not sampling, but carried with the request to every worker it meets:
    priority: int = 0  # lower is admitted first (see pdserve.sched.scheduler)
    deadline_s: float | None = None  # the first token is wanted within this time of arrival

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        _check(self.n >= 1, "n", self.n, "must be >= 1")
        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            _check(
                isinstance(value, (int, float)) and math.isfinite(value),
                name,
                value,
                "must be a finite number",
            )
        _check(self.temperature >= 0, "temperature", self.temperature, "must be >= 0")
        _check(
            self.seed is None or -(2**63) <= self.seed < 2**63,
            "seed",
            self.seed,
            "must be a 64-bit signed integer",
        )
        _check(0 < self.top_p <= 1, "top_p", self.top_p, "must be in (0, 1]")
        _check(self.top_k >= -1, "top_k", self.top_k, "must be -1, 0 (disabled) or >= 1")
        _check(0 <= self.min_p <= 1, "min_p", self.min_p, "must be in [0, 1]")
        _check(
            -2 <= self.presence_penalty <= 2,
            "presence_penalty",
            self.presence_penalty,
            "must be in [-2, 2]",
        )
        _check(
            -2 <= self.frequency_penalty <= 2,
            "frequency_penalty",
            self.frequency_penalty,
            "must be in [-2, 2]",
        )
        _check(
            self.repetition_penalty > 0,
            "repetition_penalty",
            self.repetition_penalty,
            "must be > 0",
        )
        _check(
            self.max_tokens is None or self.max_tokens >= 0,
            "max_tokens",
            self.max_tokens,
            "must be >= 0 (0: score the prompt, generate nothing)",
        )
        _check(self.min_tokens >= 0, "min_tokens", self.min_tokens, "must be >= 0")
        _check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            "min_tokens",
            self.min_tokens,
            f"must be <= max_tokens ({self.max_tokens})",
        )
        _check(
            all(isinstance(s, str) and s for s in self.stop),
            "stop",
            self.stop,
            "must be non-empty strings",
        )
        _check(
            all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids",
            self.stop_token_ids,
            "must be non-negative token ids",
        )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(
                value is None or 0 <= value <= MAX_LOGPROBS,
                name,
                value,
                f"must be in [0, {MAX_LOGPROBS}]",
            )
        _check(
            isinstance(self.priority, int) and -(2**31) <= self.priority < 2**31,
            "priority",
            self.priority,
            "must be a 32-bit integer",
        )
        _check(
            self.deadline_s is None
            or (isinstance(self.deadline_s, (int, float)) and 0 < self.deadline_s < math.inf),
            "deadline_s",
            self.deadline_s,
            "must be a finite number of seconds > 0",
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def is_greedy(self) -> bool:
        """Whether the token is the argmax of the (penalized, masked) logits."""
        return self.greedy or self.temperature < MIN_TEMPERATURE

    def takes_raw_argmax(self, num_output_tokens: int) -> bool:
        """Whether the next token is the argmax of the raw logits and nothing else is wanted
        of them: greedy, no logprobs, no penalties, no grammar, and past `min_tokens` (no ban on
        the stop tokens)."""
        return (
            self.is_greedy
            and self.logprobs is None
            and self.grammar is None
            and num_output_tokens >= self.min_tokens
            and not self.has_penalties
        )

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )


# Temperatures below this sample greedily: dividing the logits by them overflows float32.
MIN_TEMPERATURE = 1e-5


# The engine's own bound on top logprobs per token (the server's default limit is lower).
MAX_LOGPROBS = 1024
_FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)


def _check(ok: bool, name: str, value: object, why: str) -> None:
    if not ok:
        raise ValueError(f"invalid {name}={value!r}: {why}")


class Role(enum.StrEnum):
    """What an engine worker does: everything (colocated), or one phase of a P/D split.

    `PARKED` is a run-time role only (`--pd-merge`): the worker takes no new work, finishes
    what it holds, then lends its CPUs to the one colocated worker left."""

    BOTH = "both"
    PREFILL = "prefill"
    DECODE = "decode"
    PARKED = "parked"

    @property
    def decodes(self) -> bool:
        """It generates tokens after the first (and so can take a request end to end)."""
        return self in (Role.BOTH, Role.DECODE)


class KVTransportKind(enum.StrEnum):
    """How a prefill worker's KV reaches a decode worker."""

    SHM = "shm"  # one host: the decode worker's cache in a shared-memory file
    TCP = "tcp"  # across hosts: layer rows on plain TCP streams
    # both: signals on TCP streams, rows written into the shared-memory cache by prefill
    # workers on the decode worker's host and sent on the stream by the others
    AUTO = "auto"

    @property
    def streams(self) -> bool:
        """Whether the KV channel is plain TCP streams (else a ZMQ socket on this host)."""
        return self != KVTransportKind.SHM


class RoleControl(enum.StrEnum):
    """Who sets the workers' roles (`--pd-ratio`)."""

    STATIC = "static"  # fixed at startup by --prefill-workers / --decode-workers
    MANUAL = "manual"  # switchable workers; an operator sets the split (POST /deployment)
    AUTO = "auto"  # switchable workers; the P:D controller sets the split from the load


class KVRole(enum.StrEnum):
    """A request's part in a handoff, on the worker that holds it."""

    SEND = "send"  # prefill worker: compute the prompt, ship its KV, hand the request off
    RECEIVE = "receive"  # decode worker: reserve blocks, wait for the KV, decode on


class PrefillFailurePolicy(enum.StrEnum):
    """What a decode worker does when the prefill of a handed-off request fails."""

    RECOMPUTE = "recompute"  # compute the prompt itself
    FAIL = "fail"  # end the request with 503


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"  # EOS, stop token or stop string
    FINISHED_LENGTH = "finished_length"  # max_tokens or the model's context
    FINISHED_ABORTED = "finished_aborted"  # client abort or error
    FINISHED_REMOTE = "finished_remote"  # prefill worker: prompt done, request handed off

    @property
    def finished(self) -> bool:
        return self.value.startswith("finished")

    @property
    def finish_reason(self) -> str | None:
        return {
            RequestStatus.FINISHED_STOPPED: "stop",
            RequestStatus.FINISHED_LENGTH: "length",
            RequestStatus.FINISHED_ABORTED: "abort",
        }.get(self)


@dataclass(slots=True)
class RequestMetrics:
    """Raw timestamps of one request (seconds, `time.perf_counter` clock) and derived latencies."""

    arrival_time: float
    scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    token_times: list[float] = field(default_factory=list)  # one per output token
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    num_preemptions: int = 0
    num_spec_proposed: int = 0  # speculative decoding: tokens proposed for verification
    num_spec_accepted: int = 0  # and accepted by the model
    num_spec_steps: int = 0  # steps that verified proposals for it

    @property
    def spec_acceptance_rate(self) -> float | None:
        return self.num_spec_accepted / self.num_spec_proposed if self.num_spec_proposed else None

    @property
    def spec_mean_accepted_length(self) -> float | None:
        """Proposals accepted per verifying step (the step emits one token more)."""
        return self.num_spec_accepted / self.num_spec_steps if self.num_spec_steps else None

    @property
    def queue_time(self) -> float | None:
        return _diff(self.scheduled_time, self.arrival_time)

    @property
    def prefill_time(self) -> float | None:
        return _diff(self.first_token_time, self.scheduled_time)

    @property
    def ttft(self) -> float | None:
        return _diff(self.first_token_time, self.arrival_time)

    @property
    def decode_time(self) -> float | None:
        return _diff(self.finished_time, self.first_token_time)

    @property
    def e2e(self) -> float | None:
        return _diff(self.finished_time, self.arrival_time)

    @property
    def itl(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def tpot(self) -> float | None:
        n = len(self.token_times)
        if n < 2 or self.finished_time is None or self.first_token_time is None:
            return None
        return (self.finished_time - self.first_token_time) / (n - 1)


def _diff(b: float | None, a: float | None) -> float | None:
    return None if a is None or b is None else b - a


@dataclass(slots=True)
class Logprob:
    """Log-probability of one token, with the top alternatives at that position."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)
    rank: int | None = None  # 1 + how many tokens were more likely (prompt logprobs)


@dataclass(slots=True)
class Verdict:
    """What a request that verified proposed tokens emits in a step (`pdserve.spec.verify`)."""

    tokens: list[int]  # the accepted proposals, then one token of the model's
    logprobs: list[Logprob] | None = None  # one per token, where the request asked for them


@dataclass(slots=True)
class EngineCoreOutput:
    """What one engine step produced for one (child) request: token ids, no text. Plain data, so
    it crosses the worker/frontend boundary as it is (msgspec encodes dataclasses)."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: str | int | None = None
    new_logprobs: list[Logprob] | None = None
    # Set on a request's first output: durations measured where the request was scheduled.
    queue_time_s: float | None = None
    num_cached_tokens: int | None = None
    num_preemptions: int = 0
    num_spec_proposed: int = 0  # speculative decoding, so far: tokens proposed, and accepted
    num_spec_accepted: int = 0
    num_spec_steps: int = 0  # and the steps that verified them
    error: str | None = None  # why an aborted request was ended by the engine
    error_code: str | None = None  # "queue_timeout", or the `InvalidRequest` code (a 400)
    error_param: str | None = None  # the request parameter at fault, when there is one
    # With the first output, when asked for: one entry per prompt token (the first is None).
    prompt_logprobs: list[Logprob | None] | None = None


@dataclass(slots=True)
class CompletionOutput:
    """One of the `n` completions of a request. `text` and `token_ids` are cumulative."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    logprobs: list[Logprob] | None = None
    metrics: RequestMetrics | None = None
    new_text: str = ""  # what this step added (for streaming)
    new_token_ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class RequestOutput:
    """What the engine reports for one request after a step (or at the end, offline)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    error: str | None = None  # why the engine refused the request
    error_code: str | None = None  # "queue_timeout", or what was invalid (see `EngineCoreOutput`)
    error_param: str | None = None
    prompt_logprobs: list[Logprob | None] | None = None  # when asked for: one per prompt token

    # Convenience accessors for the common n=1 case.
    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason
