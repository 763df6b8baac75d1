"""The P:D controller's policy: which split of the workers the measured load asks for (no torch).

A pure function of what the frontend observes, so the same code can run inside the server, in a
simulator, and in unit tests that feed it metric sequences. A *split* `(p, d)` gives `p` workers
the prefill role and `d` the decode role; `(0, n)` means `n` colocated workers (role `both`).

Each sample is read as two pressures against the deployment's SLOs, 1.0 meaning "at the SLO":

- prefill pressure: the longest wait for a first token against the TTFT SLO, or the share of
  recent requests that missed it (whichever is worse);
- decode pressure: the decode step time against the TPOT SLO, or the share of recent requests
  that missed it.

The policy, for a deployment of `n` workers:

- colocated, decode missing its SLO while there is prefill work (prompts queued, or computed
  lately in steps that decodes shared) and prefill has headroom: prefills stall the decodes that
  share their steps, so split (1 prefill worker, `n - 1` decode);
- split, both phases missing their SLOs: back to colocated, where every worker gives its cores to
  whichever phase has work (a split only helps when one phase has capacity to spare);
- split, prefill missing its SLO while decode has headroom: move a decode worker to prefill, or
  back to colocated when only one decode worker is left (then every worker prefills);
- split, decode missing its SLO (or its KV cache nearly full) while prefill has headroom: move a
  prefill worker to decode (the last one back to colocated).

A wish counts only when it holds for `patience` samples in a row, and no switch follows another
within `min_dwell_s`: together these keep an oscillating load from flapping the deployment.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

Split = tuple[int, int]  # (prefill workers, decode workers); (0, n): n colocated workers

HIGH = 1.0  # a pressure at or above this misses the SLO
LOW = 0.6  # a pressure below this leaves headroom
KV_FULL = 0.9  # decode KV usage above this asks for more decode capacity


@dataclass(frozen=True)
class PhaseSLO:
    ttft_s: float
    tpot_s: float

    @classmethod
    def parse(cls, text: str) -> PhaseSLO:
        """`"ttft_ms=2000,tpot_ms=150"` (the `--slo` format of `serve` and `bench`)."""
        targets = {}
        for item in text.split(","):
            key, _, value = item.strip().partition("=")
            try:
                ms = float(value)
            except ValueError:
                ms = math.nan
            if key not in ("ttft_ms", "tpot_ms") or not (ms > 0 and math.isfinite(ms)):
                raise ValueError(f"--slo item {item.strip()!r}: expected ttft_ms=MS or tpot_ms=MS")
            targets[key] = ms / 1e3
        if set(targets) != {"ttft_ms", "tpot_ms"}:
            raise ValueError(f"--slo {text!r}: needs both ttft_ms and tpot_ms")
        return cls(targets["ttft_ms"], targets["tpot_ms"])


@dataclass(frozen=True)
class LoadSample:
    """What the frontend measured over the last interval, all workers together."""

    t: float  # seconds, any monotonic origin
    queued_prefill_tokens: int  # prompt tokens waiting to be computed
    oldest_wait_s: float  # the longest any waiting request has waited for its first token
    decode_step_s: float | None  # mean decode step time (None: no decode step ran)
    kv_usage: float  # the highest KV cache usage among workers that decode
    ttft_attainment: float | None = None  # share of recent requests within the TTFT SLO
    tpot_attainment: float | None = None  # share of recent requests within the TPOT SLO
    prefill_tokens_on_decoders: int = 0  # prompt tokens that workers which decode computed lately

    @property
    def prefill_work(self) -> bool:
        """Prompts are queued, or were computed in steps that decodes shared."""
        return self.queued_prefill_tokens > 0 or self.prefill_tokens_on_decoders > 0


@dataclass(frozen=True)
class Decision:
    t: float
    old: Split
    new: Split
    reason: str


def pressures(s: LoadSample, slo: PhaseSLO) -> tuple[float, float]:
    """(prefill, decode) pressure of one sample; 1.0 is at the SLO."""
    prefill = s.oldest_wait_s / slo.ttft_s
    if s.ttft_attainment is not None:
        prefill = max(prefill, (1.0 - s.ttft_attainment) * 10)  # 10% missed counts as 1.0
    decode = (s.decode_step_s or 0.0) / slo.tpot_s
    if s.tpot_attainment is not None:
        decode = max(decode, (1.0 - s.tpot_attainment) * 10)
    return prefill, decode


def wish(split: Split, s: LoadSample, slo: PhaseSLO) -> tuple[Split, str] | None:
    """The split this one sample asks for, with its reason; None: keep the current one."""
    p, d = split
    n = p + d
    pre, dec = pressures(s, slo)
    if p == 0:
        if n >= 2 and dec >= HIGH and pre < LOW and s.prefill_work:
            return (1, n - 1), (
                f"decode pressure {dec:.2f} with prompts to compute ({s.queued_prefill_tokens} "
                f"queued, {s.prefill_tokens_on_decoders} lately) and prefill headroom "
                f"({pre:.2f}): prefills stall colocated decodes"
            )
        return None
    if pre >= HIGH and (dec >= HIGH or s.kv_usage >= KV_FULL):
        return (0, n), f"both phases over their SLOs (prefill {pre:.2f}, decode {dec:.2f})"
    if pre >= HIGH and dec < LOW:
        new = (p + 1, d - 1) if d > 1 else (0, n)
        return new, f"prefill pressure {pre:.2f}, decode headroom ({dec:.2f})"
    if (dec >= HIGH or s.kv_usage >= KV_FULL) and pre < LOW:
        new = (p - 1, d + 1) if p > 1 else (0, n)
        why = f"decode pressure {dec:.2f}" if dec >= HIGH else f"KV usage {s.kv_usage:.0%}"
        return new, f"{why}, prefill headroom ({pre:.2f})"
    return None


class PDController:
    """Turns a stream of `LoadSample`s into split decisions, with patience and dwell time."""

    def __init__(
        self,
        num_workers: int,
        slo: PhaseSLO,
        *,
        start: Split | None = None,
        patience: int = 3,
        min_dwell_s: float = 30.0,
    ) -> None:
        if num_workers < 1:
            raise ValueError(f"invalid num_workers={num_workers}: must be >= 1")
        self.split: Split = start or (0, num_workers)
        if sum(self.split) != num_workers or min(self.split) < 0 or self.split[1] < 1:
            raise ValueError(f"invalid start split {self.split} for {num_workers} workers")
        self.slo = slo
        self.patience = patience
        self.min_dwell_s = min_dwell_s
        self.last_switch_t: float | None = None
        self._wanted: Split | None = None
        self._streak = 0
        self.decisions: list[Decision] = []

    def observe(self, s: LoadSample) -> Decision | None:
        """Feed one sample; returns a decision when the controller switches the split."""
        w = wish(self.split, s, self.slo)
        if w is None:
            self._wanted, self._streak = None, 0
            return None
        new, reason = w
        self._streak = self._streak + 1 if new == self._wanted else 1
        self._wanted = new
        if self._streak < self.patience:
            return None
        if self.last_switch_t is not None and s.t - self.last_switch_t < self.min_dwell_s:
            return None
        decision = Decision(s.t, self.split, new, reason)
        self.split, self.last_switch_t = new, s.t
        self._wanted, self._streak = None, 0
        self.decisions.append(decision)
        return decision


def describe(split: Split) -> str:
    p, d = split
    return f"{d} colocated" if p == 0 else f"{p}P+{d}D"
