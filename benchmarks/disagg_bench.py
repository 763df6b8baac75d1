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
import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lib.disagg_analysis import analyze, per_worker_steps, print_entry, print_table, reanalyze  # noqa: E402
from lib.machine import code_info, machine_info  # noqa: E402
from lib.paths import DEFAULT_125M, TRACE, ensure_125m  # noqa: E402
from lib.procstat import CpuMeter  # noqa: E402
from lib.quiet import measured  # noqa: E402
from lib.server import Server, metric_sums, metric_total, send  # noqa: E402

from pdserve.bench.metrics import Slo  # noqa: E402
from pdserve.bench.tokenizer import HFPromptTokenizer, load_tokenizer  # noqa: E402
from pdserve.bench.traces import read_trace  # noqa: E402
from pdserve.bench.workload import (  # noqa: E402
    WorkloadConfig,
    build_prompts,
    make_specs,
    with_rate,
)

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


def serve_and_run(args: list[str], requests, warmup, log: Path):
    with Server(args, log) as srv:
        model = args[args.index("--model") + 1]
        send(warmup, srv.base_url, model, max_concurrency=1)  # untimed, other prompts
        pids = {"frontend": srv.proc.pid, **srv.workers, "client": os.getpid()}
        m0 = srv.metrics()
        with CpuMeter(pids) as cpu:
            records = send(requests, srv.base_url, model)
        return srv.command_line, m0, srv.metrics(), cpu, records


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
