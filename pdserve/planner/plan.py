"""Search deployments with the simulator and rank them by goodput per device (no torch).

A candidate is a deployment of a device budget (CPU cores or GPUs): colocated workers (one
worker on every device, or one worker per device behind the router) with a chunk size and a
`max_num_seqs`, or a static P:D split. Each is simulated on the workload at a growing request
rate: its *goodput* is the highest rate (requests/s) at which at least `target` of the requests
meet the SLO (DistServe's definition), found by bisection on a multiple of the workload's own
rate, and the ranking is by goodput per device.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from pdserve.bench.metrics import Slo, summarize
from pdserve.bench.workload import RequestSpec
from pdserve.config import DisaggConfig, EngineArgs
from pdserve.planner.profile import Profile
from pdserve.planner.simulator import Simulation


@dataclass(frozen=True)
class Candidate:
    """One deployment of `devices` devices."""

    name: str
    engine: EngineArgs
    disagg: DisaggConfig
    threads_per_worker: int
    devices: int

    def serve_flags(self) -> list[str]:
        """The `pdserve serve` flags that make this deployment (besides --model)."""
        e, d, out = self.engine, self.disagg, []
        default = EngineArgs(model=e.model)
        for name, flag in (
            ("max_num_batched_tokens", "--max-num-batched-tokens"),
            ("max_num_seqs", "--max-num-seqs"),
            ("long_prefill_token_threshold", "--long-prefill-token-threshold"),
        ):
            if getattr(e, name) != getattr(default, name):
                out += [flag, str(getattr(e, name))]
        if not e.enable_chunked_prefill:
            out.append("--no-chunked-prefill")
        if d.num_prefill_workers:
            out += ["--prefill-workers", str(d.num_prefill_workers)]
        if d.num_workers > 1:
            out += ["--decode-workers", str(d.num_decode_workers)]
        return out


@dataclass
class Ranked:
    candidate: Candidate
    goodput: float  # req/s at which `target` of the requests meet the SLO
    attainment_at_load: float | None  # at the workload's own rate
    summary_at_goodput: dict = field(default_factory=dict)
    capped: bool = False  # met the target at the highest rate tried: goodput is a lower bound

    @property
    def per_device(self) -> float:
        return self.goodput / self.candidate.devices


def candidates(
    model: str,
    devices: int,
    *,
    chunk_sizes: Sequence[int] = (256, 512, 2048),
    max_num_seqs: Sequence[int] = (64,),
    cpu: bool = True,
) -> list[Candidate]:
    """The deployments of `devices` devices to compare. On a CPU (`cpu=True`) a worker may also
    take several cores (one colocated worker on all of them)."""
    out = []
    for chunk in chunk_sizes:
        for seqs in max_num_seqs:
            engine = EngineArgs(model=model, max_num_batched_tokens=chunk, max_num_seqs=seqs)
            tag = f"chunk {chunk}, max-num-seqs {seqs}"
            if cpu and devices > 1:
                out.append(
                    Candidate(
                        f"1 colocated x {devices} cores ({tag})",
                        engine,
                        DisaggConfig(),
                        devices,
                        devices,
                    )
                )
            out.append(
                Candidate(
                    f"{devices} colocated ({tag})",
                    engine,
                    DisaggConfig(num_decode_workers=devices),
                    1,
                    devices,
                )
            )
    base = EngineArgs(model=model, max_num_seqs=max(max_num_seqs))
    for p in range(1, devices):
        disagg = DisaggConfig(num_prefill_workers=p, num_decode_workers=devices - p)
        out.append(Candidate(f"{p}P+{devices - p}D", base, disagg, 1, devices))
    return out


def goodput(
    run: Callable[[float], list],
    slo: Slo,
    target: float = 0.9,
    *,
    low: float = 0.05,
    high: float = 8.0,
    steps: int = 8,
) -> tuple[float, dict]:
    """The largest rate scale in [low, high] whose run keeps `target` of the requests within
    `slo` (bisection in log space), and the summary there. `run(scale)` returns the records of
    the workload with its arrival rate multiplied by `scale`."""

    def ok(scale: float) -> tuple[bool, dict]:
        s = summarize(run(scale), slo)
        return (s["slo_attainment"] or 0.0) >= target, s

    good, summary = ok(low)
    if not good:
        return 0.0, summary
    best, best_summary = low, summary
    lo, hi = low, high
    top_ok, top_summary = ok(high)
    if top_ok:
        return high, top_summary
    for _ in range(steps):
        mid = (lo * hi) ** 0.5
        fine, s = ok(mid)
        if fine:
            lo, best, best_summary = mid, mid, s
        else:
            hi = mid
    return best, best_summary


def scaled(requests: Sequence[RequestSpec], scale: float) -> list[RequestSpec]:
    """The same requests arriving `scale` times as fast."""
    return [dataclasses.replace(r, send_at_s=r.send_at_s / scale) for r in requests]


def rank(
    profile: Profile,
    requests: Sequence[RequestSpec],
    slo: Slo,
    cands: Sequence[Candidate],
    *,
    max_model_len: int,
    target: float = 0.9,
    high: float = 8.0,
    local_client: bool = False,
    min_span_s: float | None = None,
) -> list[Ranked]:
    """Every candidate's goodput on `requests` (its rate found by scaling their arrival times,
    up to `high` times their own rate), best goodput per device first. `min_span_s` caps the
    scale so that the arrivals still span that long: sped up further, a finite set of requests
    is one burst, whose attainment says what a burst of that size costs, not what rate the
    deployment sustains (a goodput at the cap is then a lower bound: `Ranked.capped`)."""
    if not requests:
        raise ValueError("no requests to plan for")
    duration = max(r.send_at_s for r in requests) or 1.0
    base_rate = len(requests) / duration
    if min_span_s is not None:
        high = min(high, duration / min_span_s)
    out = []
    for c in cands:

        def run(scale: float, c=c) -> list:
            sim = Simulation(
                profile,
                c.engine,
                c.disagg,
                max_model_len=max_model_len,
                threads_per_worker=c.threads_per_worker,
                local_client=local_client,
            )
            return sim.run(scaled(requests, scale)).records

        at_load = summarize(run(1.0), slo)["slo_attainment"]
        scale, summary = goodput(run, slo, target, low=min(0.05, high), high=high)
        out.append(Ranked(c, scale * base_rate, at_load, summary, capped=scale >= high))
    out.sort(key=lambda r: (-r.per_device, r.candidate.name))
    return out
