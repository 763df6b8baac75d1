"""Per-request records and the summary derived from them: latencies, throughput, goodput.

Pure functions of the raw client-side timestamps (seconds since the run started), with the
project's definitions: TTFT = t_first - t_arrive; ITL = each gap between consecutive token
chunks; TPOT = (t_end - t_first) / (n_out - 1), undefined for one output token (such a request
meets any TPOT target); E2E = t_end - t_arrive; goodput = completed requests per second that
meet every SLO given; SLO attainment = fraction of requests (failed ones count as missing)
that meet every SLO. Cancelled requests (an interrupted run) are left out of every figure.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, fields

import numpy as np

COMPLETED, FAILED, CANCELLED = "completed", "failed", "cancelled"
PERCENTILES = (50, 90, 99)
LATENCIES = ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms")


@dataclass(slots=True)
class RequestRecord:
    """What the client saw of one request. Times are seconds since the start of the run."""

    index: int
    input_len: int  # intended prompt tokens
    output_len: int  # max_tokens asked for
    prompt_len: int  # prompt tokens counted with the tokenizer when the prompt was built
    t_scheduled: float  # when the workload said to send it
    t_arrive: float | None = None  # sent
    t_first: float | None = None  # first token chunk received
    token_times: list[float] = field(default_factory=list)  # every token chunk received
    t_end: float | None = None  # response finished (or failed)
    status: str = CANCELLED  # completed | failed | cancelled
    error: str | None = None  # failure kind: "HTTP 500", "connection dropped", ...
    error_detail: str | None = None
    prompt_tokens: int | None = None  # from the server's `usage`, when it sent one
    completion_tokens: int | None = None
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, when sent
    server_timings: dict | None = None  # the server's own `timings` (pdserve), when sent

    @property
    def num_input_tokens(self) -> int:
        return self.prompt_tokens if self.prompt_tokens is not None else self.prompt_len

    @property
    def num_output_tokens(self) -> int:
        """`usage.completion_tokens`, else the number of token chunks in the stream."""
        if self.completion_tokens is not None:
            return self.completion_tokens
        return len(self.token_times)

    @property
    def ttft(self) -> float | None:
        return _diff(self.t_first, self.t_arrive)

    @property
    def e2e(self) -> float | None:
        return _diff(self.t_end, self.t_arrive)

    @property
    def itl(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def tpot(self) -> float | None:
        n = self.num_output_tokens
        if n < 2 or self.t_first is None or self.t_end is None:
            return None
        return (self.t_end - self.t_first) / (n - 1)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> RequestRecord:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


def _diff(b: float | None, a: float | None) -> float | None:
    return None if a is None or b is None else b - a


@dataclass(frozen=True)
class Slo:
    """Latency targets in milliseconds; None: no target on that figure."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None
    # the longest gap between two tokens of a request: a stream that pauses (behind another
    # request's prefill, say) can keep a good TPOT on average and still stall its reader
    max_itl_ms: float | None = None

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None and not (value > 0 and math.isfinite(value)):
                raise ValueError(f"slo {f.name}={value!r}: must be a number > 0")

    @classmethod
    def parse(cls, text: str | None) -> Slo:
        """`"ttft_ms=200,tpot_ms=50[,e2e_ms=5000,max_itl_ms=500]"` (empty or None: no targets)."""
        targets: dict[str, float] = {}
        known = [f.name for f in fields(cls)]
        for item in (text or "").split(","):
            if not item.strip():
                continue
            key, sep, value = item.partition("=")
            key = key.strip()
            if not sep or key not in known:
                raise ValueError(
                    f"--slo item {item.strip()!r}: expected KEY=MS, KEY one of {known}"
                )
            try:
                targets[key] = float(value)
            except ValueError:
                raise ValueError(f"--slo {key}={value.strip()!r}: not a number") from None
        return cls(**targets)

    @property
    def is_empty(self) -> bool:
        return all(getattr(self, f.name) is None for f in fields(self))

    def describe(self) -> str:
        parts = [
            f"{f.name}<={getattr(self, f.name):g}" for f in fields(self) if getattr(self, f.name)
        ]
        return ", ".join(parts) or "none"

    def met_by(self, record: RequestRecord) -> bool:
        """A completed request within every target (TPOT and ITL undefined for one token: met)."""
        if record.status != COMPLETED:
            return False
        itl = record.itl
        checks = (
            (self.ttft_ms, record.ttft),
            (self.tpot_ms, record.tpot),
            (self.e2e_ms, record.e2e),
            (self.max_itl_ms, max(itl) if itl else None),
        )
        return all(
            target is None or value is None or value * 1000.0 <= target for target, value in checks
        )


def summarize(records: Iterable[RequestRecord], slo: Slo | None = None) -> dict:
    """Every summary figure of one run, JSON-ready (latencies in ms, rates per second)."""
    slo = slo or Slo()
    considered = [r for r in records if r.status != CANCELLED]
    done = [r for r in considered if r.status == COMPLETED]
    failed = [r for r in considered if r.status == FAILED]
    duration = run_duration(considered)
    meeting = sum(slo.met_by(r) for r in done)
    input_tokens = sum(r.num_input_tokens for r in done)
    output_tokens = sum(r.num_output_tokens for r in done)
    return {
        "completed": len(done),
        "failed": len(failed),
        "errors": dict(Counter(r.error or "unknown" for r in failed).most_common()),
        "duration_s": duration,
        "request_throughput": _rate(len(done), duration),
        "input_throughput": _rate(input_tokens, duration),
        "output_throughput": _rate(output_tokens, duration),
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "ttft_ms": latency_stats(r.ttft for r in done),
        "itl_ms": latency_stats(gap for r in done for gap in r.itl),
        "tpot_ms": latency_stats(r.tpot for r in done),
        "e2e_ms": latency_stats(r.e2e for r in done),
        "slo": {k: v for k, v in asdict(slo).items() if v is not None},
        "num_meeting_slo": meeting,
        "goodput": _rate(meeting, duration),
        "slo_attainment": meeting / len(considered) if considered else None,
    }


def run_duration(records: Sequence[RequestRecord]) -> float:
    """From the first request sent to the last one finished (0 with no requests)."""
    starts = [r.t_arrive for r in records if r.t_arrive is not None]
    ends = [r.t_end for r in records if r.t_end is not None]
    if not starts or not ends:
        return 0.0
    return max(ends) - min(starts)


def latency_stats(values_s: Iterable[float | None]) -> dict[str, float | None]:
    """Mean and percentiles in milliseconds of the defined values (all None if there are none)."""
    ms = np.array([v * 1000.0 for v in values_s if v is not None], dtype=float)
    keys = ["mean", *(f"p{p}" for p in PERCENTILES)]
    if ms.size == 0:
        return dict.fromkeys(keys)
    return dict(zip(keys, [float(ms.mean()), *map(float, np.percentile(ms, PERCENTILES))]))


def _rate(count: float, duration_s: float) -> float:
    return count / duration_s if duration_s > 0 else 0.0
