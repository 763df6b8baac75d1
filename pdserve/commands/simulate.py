"""`pdserve simulate`: run a workload through a simulated deployment (no model, no torch).

The deployment is given with `pdserve serve`'s own engine and pool flags (chunk size, budget,
max-num-seqs, prefill and decode workers, `--pd-ratio auto`, `--slo`), the workload with `pdserve
bench`'s (a trace or random lengths, rates), the hardware with a profile (`pdserve profile`).
The output is `pdserve bench`'s: the summary table, and with `--output` the same JSON (summary
and every request), plus what was simulated and how fast.
"""

from __future__ import annotations

import argparse
import time

HELP = "simulate a deployment on a workload with a step-time profile (see pdserve profile)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    from pdserve.commands.bench import add_workload_arguments
    from pdserve.commands.engine_args import add_engine_arguments
    from pdserve.commands.flags import Groups, add_flags
    from pdserve.config.disagg import DISAGG_GROUP, DisaggConfig

    g = p.add_argument_group("simulation")
    g.add_argument(
        "--profile",
        dest="sim_profile",
        metavar="FILE",
        required=True,
        help="step-time profile JSON (pdserve profile)",
    )
    g.add_argument(
        "--threads-per-worker",
        type=int,
        default=1,
        help="threads (or devices) of a worker without a CPU set (default 1)",
    )
    g.add_argument(
        "--local-client",
        action="store_true",
        help="the load comes from a client on the measured machine (as in a benchmark there): "
        "its CPU per token, from the profile, shares the workers' cores too",
    )
    g.add_argument(
        "--step-noise",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="each step's time takes a ratio drawn from how the profile's measured steps of its "
        "kind scattered around their fit, seeded by --seed (default on; a profile that kept no "
        "steps, as an analytic one, has none): percentiles that rest on a few short steps follow "
        "their scatter",
    )
    g.add_argument(
        "--speed-trace",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="where the profile holds a speed trace (pdserve profile --speed-trace), decode-bound "
        "steps take the fitted time times the trace's ratio along a path cut from it at offsets "
        "seeded by --seed (default on): a shared machine's memory bandwidth moves in stretches, "
        "and most requests of a run sit in one stretch or another",
    )
    g.add_argument("--output", metavar="FILE", help="write the summary and every request as JSON")
    add_engine_arguments(p)
    groups: Groups = {DISAGG_GROUP: p.add_argument_group(DISAGG_GROUP)}
    add_flags(p, DisaggConfig, DISAGG_GROUP, groups)
    add_workload_arguments(p, seed=False)  # --seed (the engine's) seeds the workload too


def run(args: argparse.Namespace) -> int:
    from pdserve.bench.metrics import Slo, summarize
    from pdserve.bench.report import summary_table, write_json
    from pdserve.commands.bench import workload_from
    from pdserve.commands.flags import from_args
    from pdserve.config import DisaggConfig, EngineArgs, ModelConfig
    from pdserve.planner.profile import Profile
    from pdserve.planner.simulator import Simulation

    if args.max_concurrency is not None:
        raise ValueError("--max-concurrency is not simulated: use a request rate or a trace")
    if args.threads_per_worker < 1:
        raise ValueError(f"invalid --threads-per-worker {args.threads_per_worker}: must be >= 1")
    engine = from_args(EngineArgs, args)
    disagg = from_args(DisaggConfig, args)
    model = ModelConfig.from_pretrained(engine.model)
    max_model_len = min(engine.max_model_len or model.max_model_len, model.max_model_len)
    profile = Profile.load(args.sim_profile)
    workload, specs = workload_from(args)
    t0 = time.perf_counter()
    sim = Simulation(
        profile,
        engine,
        disagg,
        max_model_len=max_model_len,
        threads_per_worker=args.threads_per_worker,
        local_client=args.local_client,
        step_noise=args.step_noise,
        speed_trace=args.speed_trace,
        seed=engine.seed,
    )
    result = sim.run(specs)
    wall = time.perf_counter() - t0
    slo = Slo.parse(disagg.slo)
    summary = summarize(result.records, slo)
    title = f"pdserve simulate: {len(specs)} requests, profile {profile.description}"
    print(summary_table(summary, title))
    print(
        f"simulated {result.end_s:.1f} s of serving in {wall:.2f} s of wall time "
        f"({len(specs) / wall:.0f} requests/s, {len(result.steps)} steps)"
    )
    if profile.kind != "measured":
        print(f"note: {profile.kind} profile: " + "; ".join(profile.notes))
    for d in result.decisions:
        print(f"  t={d['t']:.1f} s: split {d['new']}: {d['reason']}")
    if args.output:
        payload = {
            "config": {"simulated": True, "workload": workload.__dict__, "slo": slo.describe()},
            "simulation": {
                "profile": profile.to_dict(),
                "engine": {k: v for k, v in engine.__dict__.items()},
                "disagg": {k: str(v) for k, v in disagg.__dict__.items()},
                "wall_s": wall,
                "simulated_s": result.end_s,
                "requests_per_wall_s": len(specs) / wall if wall else None,
                "num_steps": len(result.steps),
                "step_noise": args.step_noise,
                "speed_trace": args.speed_trace and bool(profile.speed),
                "decisions": result.decisions,
            },
            "request_rate": workload.request_rate,
            "interrupted": False,
            "summary": summary,
            "requests": [r.to_dict() for r in result.records],
        }
        print(f"wrote {write_json(args.output, payload)}")
    return 0
