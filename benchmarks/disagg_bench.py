"""Disaggregated prefill/decode against colocated serving, on one mixed load, on this machine.

    python benchmarks/disagg_bench.py [--model DIR] [--request-rates R,R] [--output FILE]

Three deployments of the same model (default: a random llama-125m, float32), each started as
`pdserve serve` on a free port, get the very same requests (Azure conversation trace rows,
lengths capped, Poisson arrivals at each of `--request-rates`, one seed) from `pdserve bench`'s
client, one deployment and one rate at a time:

  colocated-chunked  one worker on CPUs 0-1, chunked prefill with a small token budget
  colocated-nochunk  one worker on CPUs 0-1, each prompt prefilled in one step
  disagg-1p1d        a prefill worker on CPU 0 and a decode worker on CPU 1 (KV over shm)

For each: TTFT / ITL / TPOT / E2E percentiles; goodput and SLO attainment under each `--slo`;
the gap between the first and second token apart from the later gaps (in disaggregation that
gap holds the handoff to the decode worker); pauses (gaps over `--stall-ms`) and the longest
pause of each request; the workers' step time per phase and, for disaggregation, the KV
transfer counters, from the server's /metrics before and after the run; and the CPU time of
the frontend, each worker and the client. `--reanalyze FILE` recomputes the latency figures of
a saved run under other SLOs without running anything.

Each run waits until no other benchmark, test or pdserve process runs, and runs again (up to
`--attempts`) when one appeared while it ran.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serving_bench import (  # noqa: E402
    DEFAULT_125M,
    ROOT,
    CpuMeter,
    Server,
    code_info,
    ensure_125m,
    machine_info,
    measured,
    metric_sums,
    metric_total,
    ms,
    send,
)

from pdserve.bench.client import ClientConfig, run_requests  # noqa: E402
from pdserve.bench.metrics import (  # noqa: E402
    COMPLETED,
    RequestRecord,
    Slo,
    latency_stats,
    summarize,
)
from pdserve.bench.tokenizer import HFPromptTokenizer, load_tokenizer  # noqa: E402
from pdserve.bench.traces import read_trace  # noqa: E402
from pdserve.bench.workload import (  # noqa: E402
    WorkloadConfig,
    build_prompts,
    make_specs,
    with_rate,
)

TRACE = ROOT.parent / "shared" / "traces" / "azure_conv_2023.csv"
# an interactive target for this machine and model (a reader sees ~7 tokens/s and no pause over
# half a second), and a loose one
DEFAULT_SLOS = ("ttft_ms=2000,tpot_ms=150,max_itl_ms=500", "ttft_ms=5000,tpot_ms=200")


def deployments(model: str, budget: int, linear_backend: str) -> dict[str, list[str]]:
    m = ["--model", model, "--linear-backend", linear_backend]
    return {
        "colocated-chunked": [*m, "--cpus", "0-1", "--max-num-batched-tokens", str(budget)],
        "colocated-nochunk": [*m, "--cpus", "0-1", "--no-chunked-prefill"],
        "disagg-1p1d": [
            *m,
            "--prefill-workers",
            "1",
            "--decode-workers",
            "1",
            "--prefill-cpus",
            "0",
            "--decode-cpus",
            "1",
        ],  # fmt: skip
    }


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


def serve_and_run(args: list[str], requests, warmup, log: Path):
    with Server(args, log) as srv:
        model = args[args.index("--model") + 1]
        send(warmup, srv.base_url, model, max_concurrency=1)  # untimed, other prompts
        pids = {"frontend": srv.proc.pid, **srv.workers, "client": os.getpid()}
        m0 = srv.metrics()
        cfg = ClientConfig(srv.base_url, model, "completions", temperature=0.0)
        with CpuMeter(pids) as cpu:
            records = asyncio.run(run_requests(requests, cfg))
        return srv.command_line, m0, srv.metrics(), cpu, records


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


def run_one(
    name: str,
    rate: float,
    args: list[str],
    requests,
    warmup,
    slos: list[Slo],
    workdir: Path,
    attempts: int,
    stall_ms: float,
) -> dict:
    entry: dict = {"name": name, "rate": rate}
    print(f"\n== {name} at {rate} req/s ==", flush=True)
    log = workdir / f"{name}-{rate}.log"
    (command, m0, m1, cpu, records), meta = measured(
        lambda: serve_and_run(args, requests, warmup, log), name, attempts
    )
    entry["command"], entry["meta"] = command, meta
    entry["disturbed"] = meta["disturbed"]
    analyze(entry, records, slos, stall_ms)
    entry["cpu"] = cpu.result
    entry["steps"] = per_worker_steps(m0, m1)
    delta = lambda n, f="": metric_total(m1, n, f) - metric_total(m0, n, f)  # noqa: E731
    entry["kv"] = {
        "bytes": delta("pdserve_kv_transfer_bytes_total"),
        "transfer_s_sum": delta("pdserve_kv_transfer_seconds_sum"),
        "transfers": delta("pdserve_kv_transfer_seconds_count"),
        "exposed_s": metric_total(m1, "pdserve_kv_transfer_exposed_seconds")
        - metric_total(m0, "pdserve_kv_transfer_exposed_seconds"),
        "fallbacks": delta("pdserve_kv_transfer_fallbacks_total"),
        "router": {
            k: v - metric_sums(m0, "pdserve_router_decisions_total").get(k, 0.0)
            for k, v in metric_sums(m1, "pdserve_router_decisions_total").items()
        },
    }
    entry["preemptions"] = metric_total(m1, "pdserve_preemptions")
    entry["records"] = [r.to_dict() for r in records]
    print_entry(entry)
    return entry


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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help=f"model folder (default: random llama-125m in {DEFAULT_125M})")
    p.add_argument("--trace", default=str(TRACE))
    p.add_argument("--num-requests", type=int, default=80)
    p.add_argument("--length-scale", type=float, default=1.0)
    p.add_argument("--max-input-len", type=int, default=1024)
    p.add_argument("--max-output-len", type=int, default=128)
    p.add_argument("--request-rates", default="0.2,0.4", help="comma-separated, req/s")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--slo",
        action="append",
        help="latency targets, e.g. ttft_ms=2000,tpot_ms=100; repeat for several (default: "
        + " and ".join(DEFAULT_SLOS)
        + ")",
    )
    p.add_argument(
        "--budget",
        type=int,
        default=256,
        help="--max-num-batched-tokens of the chunked colocated deployment",
    )
    p.add_argument(
        "--linear-backend",
        default="torch",
        help="--linear-backend of every deployment (default torch: `auto` picks oneDNN for a "
        "colocated worker but F.linear for disaggregated pools, which would confound the two)",
    )
    p.add_argument(
        "--stall-ms",
        type=float,
        default=400.0,
        help="a gap between two tokens longer than this counts as a pause (default 400: above "
        "any decode step of the default load, below a long prefill)",
    )
    p.add_argument("--configs", help="comma-separated subset of the deployments to run")
    p.add_argument(
        "--attempts",
        type=int,
        default=2,
        help="runs of a deployment when another benchmark disturbed the previous one",
    )
    p.add_argument("--output", help="write every result (with per-request records) as JSON")
    p.add_argument(
        "--reanalyze",
        metavar="FILE",
        help="run nothing: recompute the figures of a saved --output under these --slo and "
        "--stall-ms, print them (and write them to --output)",
    )
    a = p.parse_args()
    slos = [Slo.parse(t) for t in (a.slo or DEFAULT_SLOS)]
    if a.reanalyze:
        res = reanalyze(a.reanalyze, slos, a.stall_ms)
        for e in res["deployments"]:
            print(f"\n== {e['name']} at {e['rate']} req/s ==")
            print_entry(e)
        print_table(res["deployments"])
        if a.output:
            Path(a.output).write_text(json.dumps(res, indent=1))
        return
    model = a.model or ensure_125m(DEFAULT_125M)
    rates = [float(r) for r in a.request_rates.split(",")]
    wl = WorkloadConfig(
        num_requests=a.num_requests, length_scale=a.length_scale,
        max_input_len=a.max_input_len, max_output_len=a.max_output_len,
        request_rate=rates[0], seed=a.seed,
    )  # fmt: skip
    specs = make_specs(wl, read_trace(a.trace))
    tok = HFPromptTokenizer(load_tokenizer(model))
    requests = build_prompts(specs, tok, a.seed)
    # warm-up prompts share no text with the measured ones (no prefix-cache hits)
    wcfg = WorkloadConfig(num_requests=2, input_len=256, output_len=8, seed=a.seed + 1000)
    warmup = build_prompts(make_specs(wcfg), tok, a.seed + 1000)
    ins = np.array([r.input_len for r in requests])
    outs = np.array([r.output_len for r in requests])
    print(
        f"workload: {len(requests)} requests; input tokens p50 "
        f"{np.median(ins):.0f} mean {ins.mean():.0f} max {ins.max()}; output p50 "
        f"{np.median(outs):.0f} mean {outs.mean():.0f} max {outs.max()}"
    )
    print(
        f"same requests as: pdserve bench --trace {a.trace} --num-requests {a.num_requests} "
        f"--length-scale {a.length_scale} --max-input-len {a.max_input_len} --max-output-len "
        f"{a.max_output_len} --request-rate RATE --seed {a.seed}"
    )
    print(f"pdserve from {code_info()['pdserve']}")
    workdir = Path(tempfile.mkdtemp(prefix="disagg_bench-"))
    print(f"logs in {workdir}")
    deps = deployments(model, a.budget, a.linear_backend)
    chosen = a.configs.split(",") if a.configs else list(deps)
    entries = []
    for rate in rates:
        timed = with_rate(requests, rate, 1.0, a.seed)
        for name in chosen:
            entries.append(
                run_one(
                    name, rate, deps[name], timed, warmup, slos, workdir, a.attempts, a.stall_ms
                )
            )
    print_table(entries)
    if a.output:
        res = {
            "machine": machine_info(),
            "code": code_info(),
            "args": vars(a),
            "workload": {
                "num_requests": len(requests),
                "input_p50": float(np.median(ins)), "input_mean": float(ins.mean()),
                "input_max": int(ins.max()), "output_p50": float(np.median(outs)),
                "output_mean": float(outs.mean()), "output_max": int(outs.max()),
            },
            "deployments": entries,
        }  # fmt: skip
        Path(a.output).write_text(json.dumps(res, indent=1))
        print(f"wrote {a.output}")


if __name__ == "__main__":
    main()
