"""Admission: which requests the server takes on, decided before any work is done (no torch).

Two bounds apply to every request the API admits:

- `--max-waiting-requests`: a cap on the requests waiting for their first token (`Admission`
  counts them from admission to their first token or their end).
- SLO-aware admission (`--slo-admission`, and any request's own `deadline_ms`): a request whose
  predicted time to first token is beyond its target is refused at once with 503 and a
  `Retry-After`, instead of being served late and making everyone behind it late too.

The prediction (`TTFTPredictor`) is deliberately simple, so that an operator can check it:

    predicted TTFT = (prompt tokens queued ahead + this prompt's tokens) / prefill rate

"Queued ahead" counts the prompts admitted and still without a first token whose priority is the
same or more urgent (a lower `priority` value); a prompt partly prefilled counts whole, so the
prediction errs late. The prefill rate is measured: each worker's prompt tokens per second of
step time (a moving average over its steps that computed prompt tokens), summed over the workers
that prefill now. Until a worker has computed a prompt there is no rate and everything is
admitted. The target is the TTFT SLO (`--slo ttft_ms=...`, with `--slo-admission`) or the
request's `deadline_ms`, whichever is tighter; a request is refused when the prediction exceeds
the target by more than `--admission-margin` (a fraction of the target). A request with nothing
queued ahead of it is always admitted: refusing it would make nobody faster, and its prefill
keeps the measured rate current (a rate measured low, on a busy machine, is corrected by the next
prompt rather than refusing everything from then on).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

SMOOTHING = 0.2  # weight of the newest step in a worker's prefill rate


class PrefillRate:
    """Prompt tokens per second of step time, per worker (an exponential moving average)."""

    def __init__(self) -> None:
        self.per_worker: dict[int, float] = {}

    def observe(self, worker_id: int, num_prefill_tokens: int, step_time_s: float) -> None:
        if num_prefill_tokens <= 0 or step_time_s <= 0:
            return
        rate = num_prefill_tokens / step_time_s
        old = self.per_worker.get(worker_id)
        self.per_worker[worker_id] = rate if old is None else old + SMOOTHING * (rate - old)

    def forget(self, worker_id: int) -> None:
        self.per_worker.pop(worker_id, None)

    def total(self, worker_ids) -> float | None:
        """The deployment's rate: the sum over `worker_ids` (those that prefill now) that have
        been measured; None when none has."""
        rates = [self.per_worker[w] for w in worker_ids if w in self.per_worker]
        return sum(rates) if rates else None


@dataclass(frozen=True)
class Verdict:
    admit: bool
    predicted_s: float | None = None  # None: no prediction (no rate measured yet, or no target)
    target_s: float | None = None
    retry_after_s: int = 0  # refused: about when the queue ahead will have drained enough


class TTFTPredictor:
    """The prompts admitted and waiting for their first token, and what a new one would wait."""

    def __init__(self, ttft_slo_s: float | None, margin: float = 0.0) -> None:
        self.ttft_slo_s = ttft_slo_s  # None: only requests with a deadline are checked
        self.margin = margin
        self.queued: dict[str, tuple[int, int]] = {}  # key -> (prompt tokens, priority)

    def predict(self, num_tokens: int, priority: int, rate: float | None) -> float | None:
        if not rate:
            return None
        ahead = sum(n for n, p in self.queued.values() if p <= priority)
        return (ahead + num_tokens) / rate

    def check(
        self, num_tokens: int, priority: int, deadline_s: float | None, rate: float | None
    ) -> Verdict:
        targets = [t for t in (self.ttft_slo_s, deadline_s) if t is not None]
        if not targets:
            return Verdict(True)
        target = min(targets)
        predicted = self.predict(num_tokens, priority, rate)
        if (
            predicted is None
            or predicted <= target * (1 + self.margin)
            or not self._ahead(priority)
        ):
            return Verdict(True, predicted, target)
        return Verdict(False, predicted, target, max(1, math.ceil(predicted - target)))

    def _ahead(self, priority: int) -> bool:
        return any(p <= priority for _, p in self.queued.values())

    def add(self, key: str, num_tokens: int, priority: int) -> None:
        self.queued[key] = (num_tokens, priority)

    def remove(self, key: str) -> None:
        self.queued.pop(key, None)
