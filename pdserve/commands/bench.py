"""`pdserve bench`: measure TTFT / ITL / TPOT and goodput of any OpenAI-compatible server.

`pdserve bench --base-url URL ...` runs one workload (random lengths or a replayed trace) against
one server, or one per rate with `--sweep-rates`; `pdserve bench compare --config a.yaml
--config b.yaml ...` starts each deployment in turn and runs the same workload on each. Flags
are documented in docs/BENCHMARKING.md. Exit codes: 0 done, 1 a deployment could not be
benchmarked, 2 bad input or an unreachable server, 130 interrupted (results so far saved).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the bench modules load only when the command runs
    from pdserve.bench.compare import Outcome
    from pdserve.bench.progress import Interrupt
    from pdserve.bench.runner import BenchPlan, TargetResult

HELP = "benchmark an OpenAI-compatible server: TTFT, ITL, TPOT, goodput; sweeps; comparisons"
EXIT_INTERRUPTED = 130


def add_arguments(parser: argparse.ArgumentParser) -> None:
    _add_target_args(parser)
    _add_common_args(parser)
    sub = parser.add_subparsers(dest="bench_command", metavar="{compare}")
    compare = sub.add_parser(
        "compare",
        help="start each deployment in turn and run the same workload on each",
        description="Start each deployment of --config in turn, wait for its health route, run "
        "the same workload, stop it; print one side-by-side table.",
    )
    compare.add_argument(
        "--config",
        action="append",
        required=True,
        metavar="FILE",
        help="deployment file (YAML if PyYAML is installed, else JSON): serve, base_url, ... "
        "(repeat for each deployment)",
    )
    compare.add_argument(
        "--log-dir", metavar="DIR", help="where server logs go (default: a new temporary folder)"
    )
    compare.add_argument("--api-key", help="bearer token (default: $OPENAI_API_KEY)")
    _add_common_args(compare)
    # Flags given before `compare` land in the parent namespace; without this, the
    # subparser's defaults would overwrite them.
    for action in compare._actions:
        if action.dest not in ("help", "config", "log_dir"):
            action.default = argparse.SUPPRESS


def _add_target_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--base-url", default="http://127.0.0.1:8000", help="default %(default)s")
    g.add_argument("--model", help="model name to request (default: the first of /v1/models)")
    g.add_argument(
        "--api-key",
        default=os.environ.get("OPENAI_API_KEY"),
        help="bearer token (default: $OPENAI_API_KEY)",
    )
    g.add_argument(
        "--tokenizer",
        metavar="DIR",
        help="tokenizer folder that prompts are sized with (default: the served model's folder, "
        "when /v1/models names a local one)",
    )


def _add_common_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("requests")
    g.add_argument(
        "--endpoint",
        default="completions",
        help="completions or chat (or /v1/completions, /v1/chat/completions); default completions",
    )
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0)")
    g.add_argument(
        "--force-output-len",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="send ignore_eos and min_tokens so every output has its full length (default on)",
    )
    g.add_argument("--extra-body", metavar="JSON", help="JSON object merged into every request")
    g.add_argument(
        "--request-timeout", type=float, default=600.0, metavar="S", help="per request (600)"
    )

    add_workload_arguments(p)

    g = p.add_argument_group("report")
    g.add_argument(
        "--slo",
        help="latency targets, e.g. ttft_ms=500,tpot_ms=50[,e2e_ms=10000,max_itl_ms=300]",
    )
    g.add_argument("--sweep-rates", metavar="R1,R2,...", help="run once per request rate")
    g.add_argument(
        "--target-attainment",
        type=float,
        default=0.9,
        help="sweeps: SLO attainment the reported max rate must keep (0.9)",
    )
    g.add_argument("--output", metavar="FILE", help="write the summary and every request as JSON")
    g.add_argument("--plot", metavar="DIR", help="write PNG plots (CDFs; for sweeps, vs rate)")
    g.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bar on stderr (default: when stderr is a terminal)",
    )


def add_workload_arguments(p: argparse.ArgumentParser, seed: bool = True) -> None:
    """The workload flags (random lengths or a trace, arrivals): `bench`, `simulate` and
    `plan`. `seed=False`: the command has a --seed of its own (the engine's), used for both."""
    g = p.add_argument_group("workload")
    g.add_argument(
        "--dataset", choices=["random"], help="random lengths (the default without --trace)"
    )
    g.add_argument("--input-len", type=int, default=256, help="random: mean prompt tokens (256)")
    g.add_argument("--output-len", type=int, default=128, help="random: mean output tokens (128)")
    g.add_argument(
        "--length-dist",
        choices=["fixed", "uniform", "lognormal"],
        default="fixed",
        help="random: how lengths vary around the mean (fixed)",
    )
    g.add_argument(
        "--length-spread",
        type=float,
        default=0.5,
        help="uniform: +- this fraction of the mean; lognormal: sigma of log (0.5)",
    )
    g.add_argument("--trace", metavar="PATH", help="Azure CSV or Mooncake JSONL trace to replay")
    g.add_argument(
        "--time-scale", type=float, default=1.0, help="multiply trace times (0.5: twice as fast)"
    )
    g.add_argument(
        "--length-scale", type=float, default=1.0, help="multiply trace lengths (and blocks)"
    )
    g.add_argument("--max-input-len", type=int, help="clip prompt lengths to this many tokens")
    g.add_argument("--max-output-len", type=int, help="clip output lengths to this many tokens")
    g.add_argument(
        "--request-rate",
        type=float,
        help="req/s with Poisson arrivals instead of trace timing (default: the trace's timing, "
        "or all at once for random)",
    )
    g.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="gamma shape of the gaps: 1 Poisson, <1 burstier",
    )
    g.add_argument(
        "--num-requests", type=int, help="requests to send (default: 200, or the whole trace)"
    )
    g.add_argument("--max-concurrency", type=int, help="at most this many requests in flight")
    if seed:
        g.add_argument(
            "--seed", type=int, default=0, help="seed of lengths, arrivals and prompts (0)"
        )


def run(args: argparse.Namespace) -> int:
    from pdserve.bench.progress import Interrupt

    plan = _make_plan(args)
    with Interrupt() as interrupt:
        if args.bench_command == "compare":
            return _run_compare(args, plan, interrupt)
        return _run_single(args, plan, interrupt)


def _make_plan(args: argparse.Namespace) -> BenchPlan:
    from pdserve.bench.client import endpoint_name
    from pdserve.bench.metrics import Slo
    from pdserve.bench.runner import BenchPlan
    from pdserve.bench.sweep import parse_rates

    if not 0 <= args.target_attainment <= 1:
        raise ValueError(f"--target-attainment {args.target_attainment}: must be in [0, 1]")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency {args.max_concurrency}: must be >= 1")
    if not (args.request_timeout > 0 and math.isfinite(args.request_timeout)):
        raise ValueError(f"--request-timeout {args.request_timeout}: must be > 0")
    workload, specs = workload_from(args)
    return BenchPlan(
        workload=workload,
        specs=specs,
        trace=args.trace,
        endpoint=endpoint_name(args.endpoint),
        slo=Slo.parse(args.slo),
        sweep_rates=parse_rates(args.sweep_rates) if args.sweep_rates else None,
        target_attainment=args.target_attainment,
        max_concurrency=args.max_concurrency,
        api_key=args.api_key,
        temperature=args.temperature,
        force_output_len=args.force_output_len,
        extra_body=_parse_extra_body(args.extra_body),
        timeout_s=args.request_timeout,
        show_progress=args.progress,
    )


def workload_from(args: argparse.Namespace):
    """The `WorkloadConfig` and the request specs of the workload flags."""
    from pdserve.bench.traces import read_trace
    from pdserve.bench.workload import WorkloadConfig, make_specs

    if args.trace and args.dataset:
        raise ValueError("--dataset and --trace: choose one")
    workload = WorkloadConfig(
        num_requests=args.num_requests,
        input_len=args.input_len,
        output_len=args.output_len,
        length_dist=args.length_dist,
        length_spread=args.length_spread,
        time_scale=args.time_scale,
        length_scale=args.length_scale,
        max_input_len=args.max_input_len,
        max_output_len=args.max_output_len,
        request_rate=args.request_rate,
        burstiness=args.burstiness,
        seed=args.seed,
    )
    trace = read_trace(args.trace) if args.trace else None
    return workload, make_specs(workload, trace)


def _parse_extra_body(text: str | None) -> dict:
    if not text:
        return {}
    try:
        body = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--extra-body: not valid JSON ({e.msg})") from None
    if not isinstance(body, dict):
        raise ValueError("--extra-body: must be a JSON object")
    return body


def _run_single(args: argparse.Namespace, plan: BenchPlan, interrupt: Interrupt) -> int:
    from pdserve.bench.client import normalize_base_url
    from pdserve.bench.runner import bench_target

    base_url = normalize_base_url(args.base_url)
    _note(f"pdserve bench: {len(plan.specs)} requests to {base_url} ({plan.endpoint})")
    target = bench_target(plan, base_url, args.model, args.tokenizer, interrupt)
    title = f"pdserve bench: {target.base_url} {plan.endpoint}, model {target.model}"
    print(_target_text(target, plan, title))
    payload = {"config": _target_config(plan, target), **_target_payload(target, plan)}
    _write_outputs(args, payload, {"": target}, plan)
    return EXIT_INTERRUPTED if target.interrupted else 0


def _run_compare(args: argparse.Namespace, plan: BenchPlan, interrupt: Interrupt) -> int:
    from pdserve.bench.compare import load_deployment, run_comparison
    from pdserve.bench.report import comparison_table

    deployments = [load_deployment(path) for path in args.config]
    names = [d.name for d in deployments]
    if len(set(names)) != len(names):
        raise ValueError(f"deployment names must differ (set `name:`), got {names}")
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="pdserve-bench-"))
    _note(f"pdserve bench compare: {len(deployments)} deployments, server logs in {log_dir}")
    outcomes = run_comparison(plan, deployments, interrupt, log_dir)
    results = {o.deployment.name: o.result for o in outcomes}
    for o in outcomes:
        if o.result is not None:
            title = f"== {o.deployment.name}: {o.result.base_url}, model {o.result.model}"
            print(_target_text(o.result, plan, title) + "\n")
    if plan.sweep_rates:
        print(_sweep_comparison(results, plan.target_attainment))
    else:
        summaries = {n: r.runs[0].summary if r else None for n, r in results.items()}
        print(comparison_table(summaries, f"comparison (SLO {plan.slo.describe()})"))
    for o in outcomes:
        if o.error:
            print(f"{o.deployment.name}: {o.error}")
    payload = {
        "config": plan.describe(),
        "deployments": [_outcome_payload(o, plan) for o in outcomes],
    }
    _write_outputs(args, payload, {n: r for n, r in results.items() if r}, plan)
    if interrupt.requested:
        return EXIT_INTERRUPTED
    return 1 if any(o.error for o in outcomes) else 0


def _target_text(target: TargetResult, plan: BenchPlan, title: str) -> str:
    from pdserve.bench.report import summary_table, sweep_table
    from pdserve.bench.sweep import sweep_payload

    if not target.sweep:
        note = "\n(interrupted: results so far)" if target.interrupted else ""
        return summary_table(target.runs[0].summary, title) + note
    best = sweep_payload(target.runs, plan.target_attainment)["max_rate_meeting_target"]
    return f"{title}\n{sweep_table(target.runs, plan.target_attainment, best)}"


def _sweep_comparison(results: dict[str, TargetResult | None], target: float) -> str:
    from pdserve.bench.sweep import format_rate, max_rate_meeting

    lines = [f"comparison: goodput (req/s) / SLO attainment by rate, target {target:.0%}"]
    names = list(results)
    rates = sorted({r.request_rate for res in results.values() if res for r in res.runs})
    width = max(20, *(len(n) + 2 for n in names))
    lines.append(f"{'rate':>8}" + "".join(f"{n:>{width}}" for n in names))
    for rate in rates:
        cells = []
        for res in results.values():
            run = next((r for r in res.runs if r.request_rate == rate), None) if res else None
            s = run.summary if run else None
            cells.append(_goodput_cell(s))
        lines.append(f"{format_rate(rate):>8}" + "".join(f"{c:>{width}}" for c in cells))
    best = []
    for res in results.values():
        points = [(r.request_rate, r.summary["slo_attainment"]) for r in res.runs] if res else []
        rate = max_rate_meeting(points, target) if res else None
        best.append("-" if rate is None else format_rate(rate))
    lines.append(f"{'max rate':>8}" + "".join(f"{b:>{width}}" for b in best))
    return "\n".join(lines)


def _goodput_cell(summary: dict | None) -> str:
    if summary is None:
        return "-"
    attain = summary["slo_attainment"]
    return f"{summary['goodput']:.2f} / " + ("-" if attain is None else f"{attain:.0%}")


def _target_config(plan: BenchPlan, target: TargetResult) -> dict:
    return {
        **plan.describe(),
        "base_url": target.base_url,
        "model": target.model,
        "tokenizer": target.tokenizer,
    }


def _target_payload(target: TargetResult, plan: BenchPlan) -> dict:
    from pdserve.bench.sweep import sweep_payload

    if target.sweep:
        sweep = sweep_payload(target.runs, plan.target_attainment)
        return {"interrupted": target.interrupted, "sweep": sweep}
    return target.runs[0].to_dict()


def _outcome_payload(outcome: Outcome, plan: BenchPlan) -> dict:
    dep = outcome.deployment
    entry = {
        "name": dep.name,
        "base_url": dep.base_url,
        "serve": list(dep.serve),
        "error": outcome.error,
    }
    if outcome.result is not None:
        entry |= {"model": outcome.result.model, "tokenizer": outcome.result.tokenizer}
        entry |= _target_payload(outcome.result, plan)
    return entry


def _write_outputs(
    args: argparse.Namespace, payload: dict, named_targets: dict, plan: BenchPlan
) -> None:
    from pdserve.bench.report import plot_cdfs, plot_sweeps, write_json
    from pdserve.bench.sweep import format_rate

    try:
        if args.output:
            _note(f"wrote {write_json(args.output, payload)}")
        if args.plot and named_targets:
            if plan.sweep_rates:
                paths = plot_sweeps(args.plot, {n: t.runs for n, t in named_targets.items()})
                if len(named_targets) == 1:  # one sweep: one CDF curve per rate
                    (target,) = named_targets.values()
                    named = {f"rate {format_rate(r.request_rate)}": r.records for r in target.runs}
                    paths += plot_cdfs(args.plot, named, plan.slo)
            else:
                named = {n: t.runs[0].records for n, t in named_targets.items()}
                paths = plot_cdfs(args.plot, named, plan.slo)
            _note("wrote " + ", ".join(str(p) for p in paths))
    except OSError as e:
        raise ValueError(f"cannot write results: {e}") from None


def _note(text: str) -> None:
    print(text, file=sys.stderr, flush=True)
