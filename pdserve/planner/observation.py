"""One window of a deployment's load, in the figures the advisor judges it by (no torch).

An `Observation` comes from a `Window` of `/metrics` scrapes (a live server, or the scrapes a
`pdserve bench` run saved around itself), from the per-request records of a bench run, or from
both (the server's view of phases, the client's view of latencies). Every field that a source
cannot tell stays None, and the advisor leaves the rules that need it aside.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from pdserve.planner.scrape import Window

P = "pdserve_"
ROLES = ("prefill", "decode", "both")


@dataclass(frozen=True)
class Observation:
    window_s: float
    slo_ttft_s: float | None = None
    slo_tpot_s: float | None = None
    # requests finished in the window, and their latencies (server-side, or client-side for a
    # bench run's records)
    num_finished: int = 0
    request_rate: float = 0.0
    ttft_p50_s: float | None = None
    ttft_p90_s: float | None = None
    tpot_p50_s: float | None = None
    tpot_p90_s: float | None = None
    itl_p99_s: float | None = None
    queue_mean_s: float | None = None  # arrival -> first scheduled
    prefill_mean_s: float | None = None  # first scheduled -> first token
    # the client's TTFT p50 minus the server's (a bench run with pdserve's timings): time spent
    # outside the engine, in the frontend or on the way
    outside_ttft_p50_s: float | None = None
    # workers
    workers: dict[str, int] = field(default_factory=dict)  # live workers per role
    busy: dict[str, float] = field(default_factory=dict)  # per worker "role/id": step time share
    step_time_s: dict[str, float] = field(default_factory=dict)  # per phase: seconds in steps
    step_mean_s: dict[str, float] = field(default_factory=dict)  # per phase: mean step time
    decode_batch_mean: float | None = None  # sequences per step that decoded
    prefill_tokens_per_s: float | None = None  # prompt tokens computed per second
    running_mean: float | None = None
    waiting_mean: float | None = None
    kv_usage_max: float | None = None
    num_preemptions: float = 0.0
    num_rejected: float = 0.0
    mfu: dict[str, float] = field(default_factory=dict)  # per phase, the window's mean
    mbu: dict[str, float] = field(default_factory=dict)
    frontend_cpu_cores: float | None = None  # the frontend process' CPU time per second

    @property
    def num_workers(self) -> int:
        return sum(self.workers.values())

    def busy_of(self, role: str) -> float | None:
        """The mean busy share of the workers of `role`."""
        shares = [v for k, v in self.busy.items() if k.split("/")[0] == role]
        return sum(shares) / len(shares) if shares else None

    @property
    def busy_mean(self) -> float | None:
        return sum(self.busy.values()) / len(self.busy) if self.busy else None

    def phase_share(self, phase: str) -> float | None:
        """The share of all step time spent in steps of `phase` (prefill, decode, mixed)."""
        total = sum(self.step_time_s.values())
        return self.step_time_s.get(phase, 0.0) / total if total > 0 else None


def from_window(
    w: Window, slo_ttft_s: float | None = None, slo_tpot_s: float | None = None
) -> Observation:
    """What a window of a pdserve server's scrapes says."""
    secs = max(w.seconds, 1e-9)
    ttft = w.histogram(P + "time_to_first_token_seconds")
    tpot = w.histogram(P + "time_per_output_token_seconds")
    steps = w.increases_by(P + "step_time_seconds_sum", "phase")
    counts = w.increases_by(P + "step_time_seconds_count", "phase")
    busy = {}
    for labels, seconds in w.increases(P + "step_time_seconds_sum").items():
        lab = dict(labels)
        key = f"{lab.get('role')}/{lab.get('worker')}"
        busy[key] = busy.get(key, 0.0) + seconds / secs
    decode_steps = counts.get("decode", 0.0) + counts.get("mixed", 0.0)
    decoded = w.increase(P + "scheduled_tokens_total", kind="decode")
    workers = {r: int(v) for r, v in w.gauge_by(P + "workers", "role").items() if v >= 0.5}
    cpu = (
        w.increase("process_cpu_seconds_total") if w.last.has("process_cpu_seconds_total") else None
    )
    finished = w.increase(P + "requests_total")
    sampled = len(w.scrapes) >= 3
    return Observation(
        window_s=w.seconds,
        slo_ttft_s=slo_ttft_s,
        slo_tpot_s=slo_tpot_s,
        num_finished=int(round(finished)),
        request_rate=finished / secs,
        ttft_p50_s=ttft.quantile(0.5),
        ttft_p90_s=ttft.quantile(0.9),
        tpot_p50_s=tpot.quantile(0.5),
        tpot_p90_s=tpot.quantile(0.9),
        itl_p99_s=w.histogram(P + "inter_token_latency_seconds").quantile(0.99),
        queue_mean_s=w.histogram(P + "request_queue_time_seconds").mean,
        prefill_mean_s=w.histogram(P + "request_prefill_time_seconds").mean,
        workers=workers,
        busy={k: min(v, 1.0) for k, v in busy.items()},
        step_time_s=steps,
        step_mean_s={ph: steps[ph] / counts[ph] for ph in steps if counts.get(ph)},
        decode_batch_mean=decoded / decode_steps if decode_steps else None,
        prefill_tokens_per_s=w.increase(P + "scheduled_tokens_total", kind="prefill") / secs,
        # two scrapes (a bench run's, before and after it) say nothing of the gauges in between
        running_mean=w.gauge(P + "num_requests_running") if sampled else None,
        waiting_mean=w.gauge(P + "num_requests_waiting") if sampled else None,
        kv_usage_max=_max_series(w, P + "kv_cache_usage_ratio") if sampled else None,
        num_preemptions=w.increase(P + "preemptions"),
        num_rejected=w.increase(P + "requests_rejected_total"),
        mfu=w.gauge_by(P + "mfu_ratio", "phase"),
        mbu=w.gauge_by(P + "mbu_ratio", "phase"),
        frontend_cpu_cores=None if cpu is None else cpu / secs,
    )


def _max_series(w: Window, name: str) -> float | None:
    """The highest value any one series of a gauge reached (one worker's KV usage)."""
    values = [v for s in w.scrapes for v in s.series(name).values()]
    return max(values) if values else None


def from_records(
    records: Iterable, slo_ttft_s: float | None = None, slo_tpot_s: float | None = None,
    server: Observation | None = None,
) -> Observation:  # fmt: skip
    """What a bench run's per-request records say (client-side latencies; queue and prefill
    time from pdserve's `timings` when the server sent them), over `server`'s phase figures
    when the run also saved scrapes of the server."""
    import numpy as np

    from pdserve.bench.metrics import COMPLETED, run_duration

    records = list(records)
    done = [r for r in records if r.status == COMPLETED]
    duration = run_duration(records)

    def pct(values, q):
        values = [v for v in values if v is not None]
        return float(np.percentile(values, q)) if values else None

    def mean_ms(key):
        values = [r.server_timings.get(key) for r in done if r.server_timings]
        values = [v / 1e3 for v in values if v is not None]
        return sum(values) / len(values) if values else None

    server_ttft = [
        r.server_timings["ttft_ms"] / 1e3
        for r in done
        if r.server_timings and r.server_timings.get("ttft_ms") is not None
    ]
    client_p50 = pct((r.ttft for r in done), 50)
    outside = None
    if server_ttft and client_p50 is not None:
        outside = client_p50 - float(np.percentile(server_ttft, 50))
    base = server or Observation(window_s=duration)
    in_flight = sum(r.e2e for r in done if r.e2e is not None) / duration if duration > 0 else None
    return replace(
        base,
        window_s=duration,
        slo_ttft_s=slo_ttft_s,
        slo_tpot_s=slo_tpot_s,
        num_finished=len(done),
        request_rate=len(done) / duration if duration > 0 else 0.0,
        ttft_p50_s=client_p50,
        ttft_p90_s=pct((r.ttft for r in done), 90),
        tpot_p50_s=pct((r.tpot for r in done), 50),
        tpot_p90_s=pct((r.tpot for r in done), 90),
        itl_p99_s=pct((g for r in done for g in r.itl), 99),
        queue_mean_s=mean_ms("queue_ms") if server is None else base.queue_mean_s,
        prefill_mean_s=mean_ms("prefill_ms") if server is None else base.prefill_mean_s,
        outside_ttft_p50_s=outside,
        # Little's law: the mean number of requests in the server
        running_mean=base.running_mean if base.running_mean is not None else in_flight,
    )
