"""Part 2 of serving_bench.py: the request rate one frontend sustains before it, not the model,
is the bottleneck. Poisson arrivals at increasing rates against one `pdserve serve`; per rate the
completed req/s and output tokens/s, and the CPU time of the frontend (and its busiest thread),
the worker and this client, next to the worker's own busy time (its step times, from /metrics).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from lib.procstat import CpuMeter
from lib.quiet import measured, wait_quiet
from lib.server import Server, metric_total, prompts_for, send
from lib.serving_latency import run_offline
from lib.tables import ms
from pdserve.bench.metrics import summarize
from pdserve.bench.workload import with_rate

MODES = {
    # name: (command prefix of the server, extra serve args, CPUs of this client process)
    "unpinned": ([], [], None),
    "pinned": (["taskset", "-c", "0"], ["--cpus", "1"], {0}),  # frontend+client core 0, worker 1
}


def ceiling_part(model: str, a, workdir: Path) -> dict:
    name = Path(model).name
    print(
        f"\n== frontend ceiling: {name}, {a.ceiling_input_len} in / {a.ceiling_output_len} out ==",
        flush=True,
    )
    seeds = iter(range(100, 10_000))

    def fresh(n: int):  # new prompt text for every run: no prefix-cache hits across runs
        return prompts_for(model, n, a.ceiling_input_len, a.ceiling_output_len, next(seeds))

    out: dict = {
        "model": model,
        "input_len": a.ceiling_input_len,
        "output_len": a.ceiling_output_len,
    }
    burst, warm = fresh(a.burst_requests), fresh(50)

    def offline_burst():
        pf, of = workdir / "burst.json", workdir / "burst-out.json"
        pf.write_text(json.dumps([[r.prompt for r in burst], [r.prompt for r in warm]]))
        return run_offline(model, pf, of, a.ceiling_output_len, burst=True)

    out["offline_burst"], out["offline_burst_meta"] = measured(offline_burst, "offline burst")
    ob = out["offline_burst"]
    print(
        f"offline engine, {ob['num_requests']} requests in one generate(): "
        f"{ob['request_throughput']:.1f} req/s, {ob['output_throughput']:.0f} output tok/s, "
        f"{ob['cores']:.2f} cores",
        flush=True,
    )
    out["modes"] = {}
    for mode in a.ceiling_modes.split(","):
        print(f"-- {mode} --", flush=True)
        out["modes"][mode] = sweep(model, mode, fresh, a, workdir)
    return out


def sweep(model: str, mode: str, fresh, a, workdir: Path) -> dict:
    prefix, extra, client_cpus = MODES[mode]
    rates = [float(x) for x in a.rates.split(",")]
    n_max = max(a.min_requests, int(max(r for r in rates if np.isfinite(r)) * a.seconds_per_rate))
    out: dict = {"rates": []}
    old_affinity = os.sched_getaffinity(0)
    wait_quiet()
    srv = Server(["--model", model, *extra], workdir / f"serve-ceiling-{mode}.log", prefix=prefix)
    with srv:
        if client_cpus:
            os.sched_setaffinity(0, client_cpus)
        out["command"] = srv.command_line
        send(fresh(50), srv.base_url, model, max_concurrency=8)  # warm-up
        ((worker_name, worker_pid),) = srv.workers.items()
        pids = {"frontend": srv.proc.pid, "worker": worker_pid, "client": os.getpid()}
        saturated = 0
        for rate in rates:
            n = (
                a.burst_requests
                if not np.isfinite(rate)
                else max(a.min_requests, min(n_max, int(rate * a.seconds_per_rate)))
            )

            def one_rate(n=n, rate=rate):
                reqs = with_rate(fresh(n), rate, 1.0, seed=1)
                m0 = srv.metrics()
                with CpuMeter(pids) as cpu:
                    records = send(reqs, srv.base_url, model)
                return m0, srv.metrics(), cpu, records

            (m0, m1, cpu, records), meta = measured(one_rate, f"rate {rate}")
            s = summarize(records)
            step_s = metric_total(m1, "pdserve_step_time_seconds_sum") - metric_total(
                m0, "pdserve_step_time_seconds_sum"
            )
            steps = metric_total(m1, "pdserve_step_time_seconds_count") - metric_total(
                m0, "pdserve_step_time_seconds_count"
            )
            row = {
                "rate": rate if np.isfinite(rate) else "inf",
                "num_requests": n,
                "summary": s,
                "cpu": cpu.result,
                "worker_step_busy": step_s / cpu.result["wall_s"],
                "steps": steps,
                "ms_per_step": step_s / steps * 1e3 if steps else None,
                "meta": meta,
            }
            out["rates"].append(row)
            print_ceiling_row(row, first=len(out["rates"]) == 1)
            if np.isfinite(rate) and s["request_throughput"] < 0.85 * rate:
                saturated += 1
                if saturated >= 2:
                    print("  (two rates well above what completes: stopping the sweep)")
                    break
    os.sched_setaffinity(0, old_affinity)
    best = max(out["rates"], key=lambda r: r["summary"]["request_throughput"])
    out["max_request_throughput"] = best["summary"]["request_throughput"]
    out["max_output_throughput"] = best["summary"]["output_throughput"]
    out["at_rate"] = best["rate"]
    print(
        f"max completed: {out['max_request_throughput']:.1f} req/s, "
        f"{out['max_output_throughput']:.0f} output tokens/s (offered rate {out['at_rate']})",
        flush=True,
    )
    return out


def print_ceiling_row(row: dict, first: bool) -> None:
    if first:
        print(
            f"{'rate':>6}{'n':>5}{'req/s':>8}{'tok/s':>8}{'TTFT p50':>10}{'TTFT p99':>10}"
            f"{'ITL p50':>9}{'ITL p99':>9}{'front':>7}{'f.main':>7}{'worker':>7}"
            f"{'w.steps':>8}{'ms/step':>8}{'client':>7}{'machine':>8}{'other':>7}"
        )
    s, c = row["summary"], row["cpu"]["processes"]
    print(
        f"{row['rate']:>6}{row['num_requests']:>5}{s['request_throughput']:>8.1f}"
        f"{s['output_throughput']:>8.0f}{ms(s['ttft_ms']['p50']):>10}{ms(s['ttft_ms']['p99']):>10}"
        f"{ms(s['itl_ms']['p50']):>9}{ms(s['itl_ms']['p99']):>9}"
        f"{c['frontend']['cores']:>7.2f}{c['frontend']['busiest_thread_cores']:>7.2f}"
        f"{c['worker']['cores']:>7.2f}{row['worker_step_busy']:>8.2f}{ms(row['ms_per_step']):>8}"
        f"{c['client']['cores']:>7.2f}"
        f"{row['cpu']['machine_cores_busy']:>8.2f}{row['cpu']['other_cores']:>7.2f}",
        flush=True,
    )
