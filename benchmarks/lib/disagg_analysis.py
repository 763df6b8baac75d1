"""disagg_bench.py's figures and report: latency percentiles, goodput under each SLO, the first
token gap apart from the later ones, pauses in the token streams, per-worker step time; printed
per run and side by side. `reanalyze` recomputes them from a saved run's per-request records."""

from __future__ import annotations

import json
import os
from pathlib import Path

from lib.server import metric_sums
from lib.tables import ms
from pdserve.bench.metrics import COMPLETED, RequestRecord, Slo, latency_stats, summarize


def gap_stats(records) -> dict:
    """ITL split into the first gap (token 1 -> 2) and the later ones."""
    done = [r for r in records if r.status == COMPLETED and len(r.token_times) > 1]
    first = [r.token_times[1] - r.token_times[0] for r in done]
    later = [g for r in done for g in r.itl[1:]]
    return {"first_gap_ms": latency_stats(first), "later_itl_ms": latency_stats(later)}


def stall_stats(token_times: list[list[float]], stall_ms: float) -> dict:
    """Pauses in the token streams: gaps longer than `stall_ms` (a decode step at this load
    takes well under it; a long prefill run in the same step, or ahead of it, does not), and the
    longest pause each request saw."""
    gaps = [b - a for t in token_times for a, b in zip(t, t[1:])]
    stalls = [g for g in gaps if g * 1e3 > stall_ms]
    worst = [max(b - a for a, b in zip(t, t[1:])) for t in token_times if len(t) > 1]
    return {
        "stall_ms": stall_ms,
        "gaps": len(gaps),
        "stalls": len(stalls),
        "stall_fraction": len(stalls) / len(gaps) if gaps else None,
        "stalled_s": sum(stalls),
        "requests_stalled": sum(1 for w in worst if w * 1e3 > stall_ms),
        "worst_gap_ms": latency_stats(worst),
    }


def per_worker_steps(m0: str, m1: str) -> dict:
    """Step count and busy seconds per (worker label, phase) over the run."""
    out = {}
    s0, s1 = (metric_sums(t, "pdserve_step_time_seconds_sum") for t in (m0, m1))
    c0, c1 = (metric_sums(t, "pdserve_step_time_seconds_count") for t in (m0, m1))
    for k in s1:
        steps = c1.get(k, 0) - c0.get(k, 0)
        if steps:
            out[k] = {"steps": steps, "busy_s": s1[k] - s0.get(k, 0.0)}
    return out


def analyze(entry: dict, records, slos: list[Slo], stall_ms: float) -> None:
    """The latency figures of one run, from its per-request records."""
    entry["summary"] = summarize(records, slos[0])
    entry["goodput"] = [
        {
            "slo": slo.describe(),
            "goodput": (g := summarize(records, slo))["goodput"],
            "attainment": g["slo_attainment"],
        }
        for slo in slos
    ]
    entry.update(gap_stats(records))
    done = [r.token_times for r in records if r.status == COMPLETED]
    entry["stalls"] = stall_stats(done, stall_ms)


def reanalyze(path: str, slos: list[Slo], stall_ms: float) -> dict:
    """A saved run's figures recomputed (other SLOs, another pause threshold)."""
    res = json.loads(Path(path).read_text())
    for e in res["deployments"]:
        analyze(e, [RequestRecord.from_dict(r) for r in e["records"]], slos, stall_ms)
        e.setdefault("rate", res["args"].get("request_rate"))
    return res


def print_entry(e: dict) -> None:
    s = e["summary"]
    print(
        f"completed {s['completed']} failed {s['failed']} in {s['duration_s']:.0f} s; "
        f"{s['request_throughput']:.2f} req/s, {s['output_throughput']:.0f} out tok/s"
    )
    for g in e["goodput"]:
        print(f"  {g['slo']}: goodput {g['goodput']:.3f} req/s, attainment {g['attainment']:.0%}")
    for key in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"):
        v = s[key]
        print(
            f"  {key[:-3].upper():<5} p50 {ms(v['p50']):>7} p90 {ms(v['p90']):>7} "
            f"p99 {ms(v['p99']):>7} mean {ms(v['mean']):>7}"
        )
    print(
        f"  first gap p50 {ms(e['first_gap_ms']['p50'])} p99 {ms(e['first_gap_ms']['p99'])}; "
        f"later ITL p50 {ms(e['later_itl_ms']['p50'])} p99 {ms(e['later_itl_ms']['p99'])}"
    )
    st = e["stalls"]
    print(
        f"  pauses > {st['stall_ms']:g} ms: {st['stalls']} of {st['gaps']} gaps, "
        f"{st['stalled_s']:.1f} s in all, in {st['requests_stalled']} requests; worst pause per "
        f"request p50 {ms(st['worst_gap_ms']['p50'])} p99 {ms(st['worst_gap_ms']['p99'])} ms"
    )
    for k, v in e["steps"].items():
        print(f"  steps {k}: {v['steps']:.0f} steps, {v['busy_s']:.1f} s busy")
    cpu = e["cpu"]
    print(
        "  CPU cores used: "
        + ", ".join(f"{n} {p['cores']:.2f}" for n, p in cpu["processes"].items())
        + f"; machine {cpu['machine_cores_busy']:.2f} of {os.cpu_count()}"
    )
    if e["kv"]["transfers"]:
        kv = e["kv"]
        print(
            f"  KV: {kv['transfers']:.0f} transfers, {kv['bytes'] / 1e6:.0f} MB, "
            f"{kv['transfer_s_sum'] / kv['transfers'] * 1e3:.1f} ms mean, exposed "
            f"{kv['exposed_s'] * 1e3:.0f} ms total, fallbacks {kv['fallbacks']:.0f}"
        )
    if e["disturbed"]:
        print(f"  DISTURBED by: {e['disturbed']}")


def print_table(entries: list[dict]) -> None:
    names = [f"{e['name']}@{e['rate']:g}" for e in entries]
    print(f"\n{'':<22}" + "".join(f"{n:>22}" for n in names))

    def row(label, fn):
        print(f"{label:<22}" + "".join(f"{fn(e):>22}" for e in entries))

    row("completed/failed", lambda e: f"{e['summary']['completed']}/{e['summary']['failed']}")
    row("duration s", lambda e: f"{e['summary']['duration_s']:.0f}")
    row("req/s", lambda e: f"{e['summary']['request_throughput']:.3f}")
    row("output tok/s", lambda e: f"{e['summary']['output_throughput']:.1f}")
    for key, label in (
        ("ttft_ms", "TTFT"),
        ("itl_ms", "ITL"),
        ("tpot_ms", "TPOT"),
        ("e2e_ms", "E2E"),
    ):
        for pct in ("p50", "p90", "p99"):
            row(f"{label} {pct} ms", lambda e, k=key, q=pct: ms(e["summary"][k][q]))
    row(
        "first gap p50/p99 ms",
        lambda e: f"{ms(e['first_gap_ms']['p50'])}/{ms(e['first_gap_ms']['p99'])}",
    )
    row(
        "later ITL p50/p99 ms",
        lambda e: f"{ms(e['later_itl_ms']['p50'])}/{ms(e['later_itl_ms']['p99'])}",
    )
    row(
        "pauses > stall_ms",
        lambda e: f"{e['stalls']['stalls']} ({e['stalls']['stalled_s']:.1f} s)",
    )
    row(
        "worst pause p50/p99",
        lambda e: (
            f"{ms(e['stalls']['worst_gap_ms']['p50'])}/{ms(e['stalls']['worst_gap_ms']['p99'])}"
        ),
    )
    for i, g in enumerate(entries[0]["goodput"]):
        print(g["slo"])
        row("  goodput req/s", lambda e, i=i: f"{e['goodput'][i]['goodput']:.3f}")
        row("  SLO attainment", lambda e, i=i: f"{e['goodput'][i]['attainment']:.1%}")
