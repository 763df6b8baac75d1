"""Adaptive prefill/decode splitting against static deployments, on a load whose phase shifts.

    python benchmarks/phase_shift_bench.py --output phase.json --plot phase.png   # ~25 minutes
    python benchmarks/phase_shift_bench.py --stretch-s 15 --deployments auto      # smoke, ~2 min
    python benchmarks/phase_shift_bench.py --probe              # capacity per stretch, ~3 min
    python benchmarks/phase_shift_bench.py --reanalyze phase.json --stretch-slo prefill-heavy=

The load: three consecutive stretches of `--stretch-s` seconds each (default 100), in
`--order`, each of Poisson arrivals at a rate of its own, built by `pdserve bench`'s workload code
(prompts of random one-token words, exact lengths, every output forced to its length with
ignore_eos) from the shared traces (../shared/traces):

  prefill-heavy  azure_code_2023.csv rows 0.. : prompts <= 1024 tokens (p50 1024), outputs <= 16
                 (p50 14, mean 12); `--prefill-rate`, default 0.43 req/s
  decode-heavy   azure_conv_2023.csv rows 2000.. : prompts <= 128 tokens, outputs exactly 256;
                 `--decode-rate`, default 0.31 req/s
  mixed          azure_conv_2023.csv rows 0.. (the load of disagg_bench.py): prompts <= 1024,
                 outputs <= 128; `--mixed-rate`, default 0.28 req/s

Each request is tagged with its stretch; stretch k's arrivals start at k * stretch_s and are
drawn from (`--seed`, the stretch's kind), so the same seed gives the same requests to every
deployment. Default rates: 85% of the throughput colocated-chunked reached on each stretch's
first 16 requests sent at once (`--probe`, oneDNN; 2026-12-01 on this 2-core machine, quiet while
measured: prefill-heavy 0.506 req/s, decode-heavy 0.363, mixed 0.332). A burst ends with a tail
of few running requests, so this is a lower bound of what the deployment sustains: the load sits
near, not beyond, its capacity.

Five deployments of the same model (default: a random llama-125m, float32), each started as
`pdserve serve` on a free port, run one after another on the very same requests (all with
`--linear-backend onednn` unless `--linear-backend` says otherwise):

  colocated-chunked  --cpus 0-1 --max-num-batched-tokens 256 (one worker, both cores)
  static-1p1d        --prefill-workers 1 --decode-workers 1 --prefill-cpus 0 --decode-cpus 1
  two-colocated      --decode-workers 2 --decode-cpus 0 --decode-cpus 1
                     --max-num-batched-tokens 256 (two colocated workers behind the router, one
                     core each)
  auto               static-1p1d's command plus --max-num-batched-tokens 256 --pd-ratio auto --slo <the --slo's TTFT and
                     TPOT> --pd-min-dwell-s 10: the P:D controller moves the split between
                     1P+1D and 2 colocated workers as the load shifts
  auto-merged        two-colocated's command plus auto's flags and --pd-merge: starts as one
                     worker on both cores (the other parked), and the controller moves between
                     that and 1P+1D

While a switchable deployment runs, GET /deployment is polled every `--poll-s` (1 s): the split
over time and every decision (from, to, reason; its time is that of the first poll that showed
it; /deployment also reports each decision's age).

SLOs, stated before any run: `--slo` (default ttft_ms=2000,tpot_ms=150, `pdserve bench --slo`'s
format) for every stretch but those given their own with `--stretch-slo NAME=SPEC`. By default
the prefill-heavy stretch gets ttft_ms=5000 and no TPOT target: on this machine a 1024-token
prompt alone takes 2.6 s to prefill on two cores and 4.5 s on one (F.linear, measured on
2026-12-01; oneDNN prefills about as fast), so 2 s is out of any split's
reach there, and an answer of at most 16 tokens is read whole: its pace between tokens is not
what its reader waits for (`--stretch-slo prefill-heavy=` judges it by `--slo` too). Each
request is judged by its stretch's SLO; the auto deployment's controller steers by `--slo`'s
TTFT and TPOT alone.

Reported per deployment: goodput (requests meeting their SLO per second of offered load, i.e.
per stretch length) and SLO attainment per stretch and overall, TTFT and TPOT p50/p99 per
stretch; each adaptive deployment's goodput over the best static one's (of the other three), per
stretch and overall; the adaptive deployments' share of each stretch in each split and its decisions. A markdown
table is printed; `--output` saves everything (per-request records too), `--plot` draws the
split over time with the stretch boundaries and the rolling attainment of every deployment.
`--reanalyze FILE` recomputes the figures of a saved run under other SLOs.

Each run waits until no other benchmark, test or pdserve process runs, and runs again (up to
`--attempts`) when one appeared while it ran. Duration: per deployment ~20 s to start and warm
up, 3 x `--stretch-s` of load, then the drain of what is still running (10-60 s): about 6
minutes each, 30 for all five at the defaults (more while waiting for a quiet CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lib.disagg_analysis import per_worker_steps  # noqa: E402
from lib.machine import code_info, machine_info  # noqa: E402
from lib.paths import DEFAULT_125M, TRACE, ensure_125m  # noqa: E402
from lib.phase_shift import (  # noqa: E402
    STRETCHES,
    DeploymentPoller,
    Stretch,
    analyze,
    compare,
    print_tables,
    shape,
    split_shares,
    stretch_specs,
)
from lib.phase_shift import plot as draw  # noqa: E402
from lib.procstat import CpuMeter  # noqa: E402
from lib.quiet import Watch, measured  # noqa: E402
from lib.server import Server, metric_sums, metric_total, send  # noqa: E402
from lib.tables import ms  # noqa: E402

from pdserve.bench.metrics import Slo, summarize  # noqa: E402
from pdserve.bench.tokenizer import HFPromptTokenizer, load_tokenizer  # noqa: E402
from pdserve.bench.traces import read_trace  # noqa: E402
from pdserve.bench.workload import WorkloadConfig, build_prompts, make_specs  # noqa: E402

CODE_TRACE = TRACE.parent / "azure_code_2023.csv"
DEFAULT_SLO = "ttft_ms=2000,tpot_ms=150"
# a 1024-token prompt takes 4.5 s to prefill on one core, 2.6 s on two; answers <= 16 tokens
DEFAULT_STRETCH_SLOS = {"prefill-heavy": "ttft_ms=5000"}
DEFAULT_RATES = {"prefill-heavy": 0.43, "decode-heavy": 0.31, "mixed": 0.28}
# first trace row of each stretch: decode-heavy and mixed both read the conversation trace
FIRST_ROW = {"prefill-heavy": 0, "decode-heavy": 2000, "mixed": 0}


def deployments(a, model: str) -> dict[str, list[str]]:
    m = ["--model", model, "--linear-backend", a.linear_backend]
    # workers that decode chunk prompts alike (a prefill-only worker keeps the default budget)
    multi = ["--max-num-batched-tokens", str(a.budget)]
    split = ["--prefill-workers", "1", "--decode-workers", "1"]
    split += ["--prefill-cpus", "0", "--decode-cpus", "1"]
    two = ["--decode-cpus", "0", "--decode-cpus", "1"]
    auto = ["--pd-ratio", "auto", "--slo", controller_slo(a.slo)]
    auto += ["--pd-min-dwell-s", f"{a.pd_min_dwell_s:g}"]
    return {
        "colocated-chunked": [*m, "--cpus", "0-1", "--max-num-batched-tokens", str(a.budget)],
        "static-1p1d": [*m, *split],
        "two-colocated": [*m, *multi, "--decode-workers", "2", *two],
        "auto": [*m, *multi, *split, *auto],
        "auto-merged": [*m, *multi, "--decode-workers", "2", *two, *auto, "--pd-merge"],
    }


def controller_slo(text: str) -> str:
    """The part of `--slo` the P:D controller takes (TTFT and TPOT, both needed)."""
    slo = Slo.parse(text)
    if slo.ttft_ms is None or slo.tpot_ms is None:
        raise SystemExit(f"--slo {text!r}: the auto deployment needs ttft_ms and tpot_ms")
    return f"ttft_ms={slo.ttft_ms:g},tpot_ms={slo.tpot_ms:g}"


def stretch_defs(a) -> dict[str, Stretch]:
    conv, code = str(a.conv_trace), str(a.code_trace)
    return {
        "prefill-heavy": Stretch("prefill-heavy", code, FIRST_ROW["prefill-heavy"],
                                 a.prefill_max_input_len, a.prefill_max_output_len, None,
                                 a.prefill_rate),
        "decode-heavy": Stretch("decode-heavy", conv, FIRST_ROW["decode-heavy"],
                                a.decode_max_input_len, a.decode_output_len,
                                a.decode_output_len, a.decode_rate),
        "mixed": Stretch("mixed", conv, FIRST_ROW["mixed"], a.mixed_max_input_len,
                         a.mixed_max_output_len, None, a.mixed_rate),
    }  # fmt: skip


def build_load(a, tok, order: list[str], num: int | None = None):
    """(requests, stretch of each request index, workload description). With `num`, the first
    `num` requests of each stretch, all sent at once (the probe)."""
    defs = stretch_defs(a)
    traces: dict[str, list] = {}
    specs, tags, meta = [], {}, []
    for k, name in enumerate(order):
        st = defs[name]
        rows = traces.setdefault(st.trace, read_trace(st.trace))
        start = 0.0 if num else k * a.stretch_s
        part = stretch_specs(st, rows, start, a.stretch_s, a.seed, len(specs), num)
        if num:
            part = [replace(s, send_at_s=0.0) for s in part]
        specs += part
        tags.update((s.index, name) for s in part)
        meta.append(
            {
                "name": name,
                "start_s": start,
                "end_s": start + a.stretch_s,
                "rate": st.rate,
                "what": st.describe(),
                "requests": len(part),
                "input": shape([s.input_len for s in part]),
                "output": shape([s.output_len for s in part]),
            }
        )
    return build_prompts(specs, tok, a.seed), tags, meta


def serve_and_run(args: list[str], requests, warmup, log: Path, poll_s: float):
    with Server(args, log) as srv:
        model = args[args.index("--model") + 1]
        send(warmup, srv.base_url, model, max_concurrency=1)  # untimed, other prompts
        dep_url = srv.base_url + "/deployment"
        first = httpx.get(dep_url, timeout=10, trust_env=False).json()
        pids = {"frontend": srv.proc.pid, **srv.workers, "client": os.getpid()}
        m0 = srv.metrics()
        poller = DeploymentPoller(srv.base_url, poll_s) if first["control"] != "static" else None
        with CpuMeter(pids) as cpu:
            if poller:
                poller.start(time.perf_counter())
            try:
                records = send(requests, srv.base_url, model)
            finally:
                timeline = poller.stop() if poller else None
        last = httpx.get(dep_url, timeout=10, trust_env=False).json()
        return srv.command_line, m0, srv.metrics(), cpu, records, first, last, timeline


def run_one(name: str, args: list[str], requests, warmup, tags, a, workdir: Path) -> dict:
    print(f"\n== {name} ==", flush=True)
    log = workdir / f"{name}.log"
    (command, m0, m1, cpu, records, first, last, timeline), meta = run_measured(
        lambda: serve_and_run(args, requests, warmup, log, a.poll_s), name, a
    )
    delta = lambda n: metric_total(m1, n) - metric_total(m0, n)  # noqa: E731
    entry = {
        "name": name,
        "command": command,
        "meta": meta,
        "disturbed": meta["disturbed"],
        "control": first["control"],
        "deployment_start": first,
        "deployment_end": last,
        "timeline": timeline,
        "cpu": cpu.result,
        "steps": per_worker_steps(m0, m1),
        "kv": {
            "bytes": delta("pdserve_kv_transfer_bytes_total"),
            "transfers": delta("pdserve_kv_transfer_seconds_count"),
            "fallbacks": delta("pdserve_kv_transfer_fallbacks_total"),
        },
        "role_switches": {
            k: v - metric_sums(m0, "pdserve_role_switches_total").get(k, 0.0)
            for k, v in metric_sums(m1, "pdserve_role_switches_total").items()
        },
        "preemptions": metric_total(m1, "pdserve_preemptions"),
        "records": [{**r.to_dict(), "stretch": tags[r.index]} for r in records],
    }
    return entry


def print_entry(e: dict, names: list[str]) -> None:
    for part, p in [*((n, e["stretches"][n]) for n in names), ("overall", e["overall"])]:
        print(
            f"  {part:<14} {p['requests']:>4} requests, {p['failed']} failed; goodput "
            f"{p['goodput']:.3f} req/s, attainment {p['attainment'] or 0:.0%}; TTFT p50/p99 "
            f"{ms(p['ttft_ms']['p50'])}/{ms(p['ttft_ms']['p99'])} ms, TPOT p50/p99 "
            f"{ms(p['tpot_ms']['p50'])}/{ms(p['tpot_ms']['p99'])} ms"
        )
    tl = e.get("timeline")
    if tl:
        print(f"  /deployment: {len(tl['samples'])} polls, {len(tl['decisions'])} decisions")
        for d in tl["decisions"]:
            print(f"    t={d['t']:.0f} s {d['from']} -> {d['to']}: {d['reason']}")
    cpu = e["cpu"]
    print(
        "  CPU cores used: "
        + ", ".join(f"{n} {p['cores']:.2f}" for n, p in cpu["processes"].items())
        + f"; machine {cpu['machine_cores_busy']:.2f} of {os.cpu_count()}"
    )
    if e["disturbed"]:
        print(f"  DISTURBED by: {e['disturbed']}")


def finish(res: dict, a) -> None:
    """Figures of every deployment from its records, the comparison, tables, files."""
    base = Slo.parse(res["slo"]["base"])
    over = {k: Slo.parse(v) for k, v in res["slo"]["per_stretch"].items()}
    windows = {s["name"]: (s["start_s"], s["end_s"]) for s in res["workload"]["stretches"]}
    for e in res["deployments"]:
        analyze(e, windows, base, over)
        if e.get("timeline"):
            e["split_shares"] = split_shares(e["timeline"], windows)
    res["comparison"] = compare(res["deployments"], list(windows))
    print_tables(res)
    if a.output:
        Path(a.output).write_text(json.dumps(res, indent=1))
        print(f"\nwrote {a.output}")
    if a.plot and res["deployments"]:
        print(f"wrote {draw(res, a.plot, a.window_s)}")


def probe(a, model: str, tok, order: list[str], workdir: Path) -> None:
    """Throughput of colocated-chunked on each stretch's first requests sent all at once
    (printed as each stretch ends, for every attempt)."""
    requests, tags, _ = build_load(a, tok, order, num=a.probe_requests)
    args = deployments(a, model)["colocated-chunked"]
    warm = warmup_requests(a, tok)

    def go():
        with Server(args, workdir / "probe.log") as srv:
            send(warm, srv.base_url, model, max_concurrency=1)
            print("\n| stretch | requests | duration s | req/s | TTFT p50 ms | TPOT p50 ms | 85% |")
            print("| --- | --- | --- | --- | --- | --- | --- |")
            for name in order:
                part = [r for r in requests if tags[r.index] == name]
                s = summarize(send(part, srv.base_url, model))
                print(
                    f"| {name} | {s['completed']} | {s['duration_s']:.0f} | "
                    f"{s['request_throughput']:.3f} | {ms(s['ttft_ms']['p50'])} | "
                    f"{ms(s['tpot_ms']['p50'])} | {0.85 * s['request_throughput']:.2f} |",
                    flush=True,
                )

    _, meta = run_measured(go, "probe", a)
    if meta["disturbed"]:
        print(f"DISTURBED by: {meta['disturbed']}")


def run_measured(fn, label: str, a):
    """`measured` (wait for a quiet CPU, run again when disturbed), or with --no-wait one run
    as it comes, its disturbance recorded."""
    if not a.no_wait:
        return measured(fn, label, a.attempts)
    with Watch() as w:
        result = fn()
    return result, {"waits_s": [], "attempts": 1, "disturbed": w.disturbed}


def warmup_requests(a, tok):
    # warm-up prompts share no text with the measured ones (no prefix-cache hits)
    wcfg = WorkloadConfig(num_requests=2, input_len=256, output_len=8, seed=a.seed + 1000)
    return build_prompts(make_specs(wcfg), tok, a.seed + 1000)


def parse_stretch_slos(items: list[str] | None) -> dict[str, str]:
    out = dict(DEFAULT_STRETCH_SLOS)
    for item in items or []:
        name, _, spec = item.partition("=")
        if name not in STRETCHES:
            raise SystemExit(f"--stretch-slo {item!r}: NAME one of {', '.join(STRETCHES)}")
        Slo.parse(spec)  # an error now, not after the runs
        if spec.strip():
            out[name] = spec
        else:
            out.pop(name, None)
    return out


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", help=f"model folder (default: random llama-125m in {DEFAULT_125M})")
    p.add_argument("--conv-trace", default=str(TRACE), help="decode-heavy and mixed rows")
    p.add_argument("--code-trace", default=str(CODE_TRACE), help="prefill-heavy rows")
    p.add_argument("--stretch-s", type=float, default=100.0, help="length of each stretch")
    p.add_argument("--order", default=",".join(STRETCHES), help="stretches, in this order")
    for name in STRETCHES:
        flag = name.split("-")[0]
        p.add_argument(
            f"--{flag}-rate",
            type=float,
            default=DEFAULT_RATES[name],
            help=f"{name} arrivals, req/s (default {DEFAULT_RATES[name]})",
        )
    p.add_argument("--prefill-max-input-len", type=int, default=1024)
    p.add_argument("--prefill-max-output-len", type=int, default=16)
    p.add_argument("--decode-max-input-len", type=int, default=128)
    p.add_argument("--decode-output-len", type=int, default=256, help="every decode-heavy answer")
    p.add_argument("--mixed-max-input-len", type=int, default=1024)
    p.add_argument("--mixed-max-output-len", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--slo",
        help=f"latency targets of every stretch (default {DEFAULT_SLO}); its TTFT and TPOT are "
        "the auto deployment's --slo",
    )
    p.add_argument(
        "--stretch-slo",
        action="append",
        metavar="NAME=SPEC",
        help="another SLO for one stretch, e.g. prefill-heavy=ttft_ms=5000,tpot_ms=150 "
        "(repeatable; NAME= alone: the --slo). Default: "
        + "; ".join(f"{k}={v}" for k, v in DEFAULT_STRETCH_SLOS.items()),
    )
    p.add_argument(
        "--budget",
        type=int,
        default=256,
        help="--max-num-batched-tokens of colocated-chunked and of the workers of two-colocated "
        "and auto (static-1p1d keeps the default: its decode worker never prefills)",
    )
    p.add_argument(
        "--linear-backend",
        default="onednn",
        help="--linear-backend of every deployment (default onednn, the fastest kernel here; "
        "`auto` would pick oneDNN for a single colocated worker but F.linear for several "
        "workers, which would confound the comparison)",
    )
    p.add_argument("--pd-min-dwell-s", type=float, default=10.0, help="auto's --pd-min-dwell-s")
    p.add_argument("--poll-s", type=float, default=1.0, help="GET /deployment every this long")
    p.add_argument("--deployments", help="comma-separated subset of the deployments to run")
    p.add_argument(
        "--attempts",
        type=int,
        default=2,
        help="runs of a deployment when another benchmark disturbed the previous one",
    )
    p.add_argument(
        "--no-wait",
        action="store_true",
        help="run each deployment once, without waiting for a quiet CPU (smoke runs on a shared "
        "machine); other processes seen meanwhile are still recorded as `disturbed`",
    )
    p.add_argument("--window-s", type=float, default=20.0, help="rolling attainment window")
    p.add_argument("--output", help="write every result (with per-request records) as JSON")
    p.add_argument("--plot", help="PNG: the split over time and rolling attainment")
    p.add_argument(
        "--probe",
        action="store_true",
        help="run only colocated-chunked on each stretch's first --probe-requests requests sent "
        "all at once, and print its throughput (what the default rates were chosen from)",
    )
    p.add_argument("--probe-requests", type=int, default=16)
    p.add_argument(
        "--reanalyze",
        metavar="FILE",
        help="run nothing: recompute a saved --output under these --slo / --stretch-slo (the "
        "saved ones where not given), print it (and write --output, --plot)",
    )
    a = p.parse_args()
    # a SIGTERM (timeout, kill) unwinds like Ctrl-C: the servers started here are stopped
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if a.reanalyze:
        res = json.loads(Path(a.reanalyze).read_text())
        if a.slo:
            res["slo"]["base"] = a.slo
        if a.stretch_slo is not None:
            res["slo"]["per_stretch"] = parse_stretch_slos(a.stretch_slo)
        finish(res, a)
        return
    a.slo = a.slo or DEFAULT_SLO
    per_stretch = parse_stretch_slos(a.stretch_slo)
    order = a.order.split(",")
    if sorted(set(order)) != sorted(order) or not set(order) <= set(STRETCHES):
        raise SystemExit(f"--order {a.order!r}: distinct names of {', '.join(STRETCHES)}")
    model = a.model or ensure_125m(DEFAULT_125M)
    deps = deployments(a, model)
    chosen = a.deployments.split(",") if a.deployments else list(deps)
    unknown = [n for n in chosen if n not in deps]
    if unknown:
        raise SystemExit(f"--deployments: unknown {unknown}; known: {', '.join(deps)}")
    tok = HFPromptTokenizer(load_tokenizer(model))
    workdir = Path(tempfile.mkdtemp(prefix="phase_shift_bench-"))
    print(f"logs in {workdir}")
    if a.probe:
        probe(a, model, tok, order, workdir)
        return
    requests, tags, stretches = build_load(a, tok, order)
    warmup = warmup_requests(a, tok)
    print(f"load: {len(requests)} requests in {len(order)} stretches of {a.stretch_s:g} s")
    for s in stretches:
        print(
            f"  {s['start_s']:>5.0f}-{s['end_s']:<5.0f} s {s['name']:<14} {s['requests']:>3} "
            f"requests; {s['what']}; input p50 {s['input']['p50']:.0f} mean "
            f"{s['input']['mean']:.0f}, output p50 {s['output']['p50']:.0f} mean "
            f"{s['output']['mean']:.0f}; SLO {Slo.parse(per_stretch.get(s['name'], a.slo)).describe()}"
        )
    print(f"pdserve from {code_info()['pdserve']}")
    res = {
        "machine": machine_info(),
        "code": code_info(),
        "args": vars(a),
        "workload": {"num_requests": len(requests), "stretches": stretches},
        "slo": {"base": a.slo, "per_stretch": per_stretch, "controller": controller_slo(a.slo)},
        "deployments": [],
    }
    for name in chosen:
        entry = run_one(name, deps[name], requests, warmup, tags, a, workdir)
        res["deployments"].append(entry)
        finish_one(res, entry, a)
    finish(res, a)


def finish_one(res: dict, entry: dict, a) -> None:
    """One deployment's figures, printed as soon as it ran; the partial results saved."""
    base = Slo.parse(res["slo"]["base"])
    over = {k: Slo.parse(v) for k, v in res["slo"]["per_stretch"].items()}
    windows = {s["name"]: (s["start_s"], s["end_s"]) for s in res["workload"]["stretches"]}
    analyze(entry, windows, base, over)
    print_entry(entry, list(windows))
    if a.output:
        Path(a.output).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
