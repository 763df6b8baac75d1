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
  share their steps, so split (1 prefill worker, `n - 1` decode); unless the recent requests'
  TTFTs, n times longer on one worker's share of the cores, would miss the TTFT SLO (then the
  split would trade the decodes' misses for the prompts');
- split, both phases missing their SLOs: back to colocated, where every worker gives its cores to
  whichever phase has work (a split only helps when one phase has capacity to spare);
- split, prefill missing its SLO while decode has headroom: move a decode worker to prefill, or
  back to colocated when only one decode worker is left (then every worker prefills);
- split, decode missing its SLO (or its KV cache nearly full) while prefill has headroom: move a
  prefill worker to decode (the last one back to colocated).

With `merge` (`--pd-merge`), the colocated option is one worker on every worker's CPUs, the
others parked (`MERGED`, the split `(0, 1)`): a prompt then prefills on all the cores, and a
decode step uses them all. Every "back to colocated" above goes there instead, and `n` spread
colocated workers (after a restart, or an operator's split) merge.

A wish counts only when it holds for `patience` samples in a row, and no switch follows another
within `min_dwell_s`: together these keep an oscillating load from flapping the deployment.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

Split = tuple[int, int]  # (prefill workers, decode workers); (0, n): n colocated workers
MERGED: Split = (0, 1)  # with --pd-merge: one colocated worker on every worker's CPUs

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
    recent_ttfts_s: tuple[float, ...] = ()  # TTFTs of the requests behind `ttft_attainment`

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
    num_workers: int | None = None  # live workers then, parked ones included

    def describe(self) -> tuple[str, str]:
        return describe(self.old, self.num_workers), describe(self.new, self.num_workers)


def pressures(s: LoadSample, slo: PhaseSLO) -> tuple[float, float]:
    """(prefill, decode) pressure of one sample; 1.0 is at the SLO."""
    prefill = s.oldest_wait_s / slo.ttft_s
    if s.ttft_attainment is not None:
        prefill = max(prefill, (1.0 - s.ttft_attainment) * 10)  # 10% missed counts as 1.0
    decode = (s.decode_step_s or 0.0) / slo.tpot_s
    if s.tpot_attainment is not None:
        decode = max(decode, (1.0 - s.tpot_attainment) * 10)
    return prefill, decode


def split_ttft_pressure(s: LoadSample, slo: PhaseSLO, num_workers: int) -> float | None:
    """The prefill pressure colocated workers would have split into 1 prefill worker + the rest
    decode: that worker has a `num_workers`-th of the cores (or of the workers) that prefill now,
    so each recent TTFT is scaled by `num_workers` (queueing and compute alike). None: no recent
    request to judge by."""
    if not s.recent_ttfts_s:
        return None
    within = sum(t * num_workers <= slo.ttft_s for t in s.recent_ttfts_s)
    return (1.0 - within / len(s.recent_ttfts_s)) * 10


def wish(
    split: Split, s: LoadSample, slo: PhaseSLO, num_workers: int | None = None, merge: bool = False
) -> tuple[Split, str] | None:
    """The split this one sample asks for, with its reason; None: keep the current one.
    `num_workers` counts the parked ones too (default: the split's workers)."""
    p, d = split
    n = max(num_workers or 0, p + d)
    colocated = MERGED if merge else (0, n)
    pre, dec = pressures(s, slo)
    if p == 0:
        if merge and d > 1:
            return MERGED, f"{d} colocated workers merge: one worker on all their CPUs"
        if n >= 2 and dec >= HIGH and pre < LOW and s.prefill_work:
            after = split_ttft_pressure(s, slo, n)
            if after is not None and after >= HIGH:  # one worker's share could not keep TTFT
                return None
            return (1, n - 1), (
                f"decode pressure {dec:.2f} with prompts to compute ({s.queued_prefill_tokens} "
                f"queued, {s.prefill_tokens_on_decoders} lately) and prefill headroom "
                f"({pre:.2f}"
                + ("" if after is None else f", {after:.2f} on one worker's share")
                + "): prefills stall colocated decodes"
            )
        return None
    if pre >= HIGH and (dec >= HIGH or s.kv_usage >= KV_FULL):
        return colocated, f"both phases over their SLOs (prefill {pre:.2f}, decode {dec:.2f})"
    if pre >= HIGH and dec < LOW:
        new = (p + 1, d - 1) if d > 1 else colocated
        return new, f"prefill pressure {pre:.2f}, decode headroom ({dec:.2f})"
    if (dec >= HIGH or s.kv_usage >= KV_FULL) and pre < LOW:
        new = (p - 1, d + 1) if p > 1 else colocated
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
        merge: bool = False,
    ) -> None:
        if num_workers < 1:
            raise ValueError(f"invalid num_workers={num_workers}: must be >= 1")
        self.num_workers = num_workers  # live ones, parked included (the role manager updates it)
        self.merge = merge
        start = start or (0, num_workers)
        if merge and start[0] == 0:
            start = MERGED  # colocated means merged
        fits = sum(start) == num_workers or (merge and start == MERGED)
        if not fits or min(start) < 0 or start[1] < 1:
            raise ValueError(f"invalid start split {start} for {num_workers} workers")
        self.split: Split = start
        self.slo = slo
        self.patience = patience
        self.min_dwell_s = min_dwell_s
        self.last_switch_t: float | None = None
        self._wanted: Split | None = None
        self._streak = 0
        self.decisions: list[Decision] = []

    def observe(self, s: LoadSample) -> Decision | None:
        """Feed one sample; returns a decision when the controller switches the split."""
        w = wish(self.split, s, self.slo, self.num_workers, self.merge)
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
        decision = Decision(s.t, self.split, new, reason, self.num_workers)
        self.split, self.last_switch_t = new, s.t
        self._wanted, self._streak = None, 0
        self.decisions.append(decision)
        return decision


def describe(split: Split, num_workers: int | None = None) -> str:
    """`1P+1D`, `2 colocated`, or with parked workers (`num_workers` more than the split's)
    `1 colocated + 1 parked`."""
    p, d = split
    if p == 0:
        parked = (num_workers or d) - d
        return f"{d} colocated" + (f" + {parked} parked" if parked > 0 else "")
    return f"{p}P+{d}D"
