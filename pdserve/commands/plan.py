"""`pdserve plan`: which deployment of a device budget serves a workload best, by simulation.

Candidates (colocated workers with several chunk sizes and `max_num_seqs`, one worker on all of
a CPU's cores, static P:D splits) are simulated on the workload with the profile; each one's
goodput is the highest request rate at which `--target` of the requests meet `--slo`. The table
ranks them by goodput per device and gives the `pdserve serve` flags of each.
"""

from __future__ import annotations

import argparse

HELP = "rank deployments of a device budget by simulated goodput per device"


def add_arguments(p: argparse.ArgumentParser) -> None:
    from pdserve.commands.bench import add_workload_arguments

    g = p.add_argument_group("plan")
    g.add_argument(
        "--profile", dest="sim_profile", metavar="FILE", required=True, help="profile JSON"
    )
    g.add_argument("--model", required=True, help="model folder (its config.json is read)")
    g.add_argument("--devices", type=int, required=True, help="device budget (CPU cores, GPUs)")
    g.add_argument(
        "--slo", default="ttft_ms=2000,tpot_ms=150", help="latency targets (ttft_ms=..,tpot_ms=..)"
    )
    g.add_argument(
        "--target", type=float, default=0.9, help="share of requests within the SLO (0.9)"
    )
    g.add_argument("--chunk-sizes", default="256,512,2048", help="token budgets to try")
    g.add_argument("--max-num-seqs", default="64", help="max-num-seqs values to try")
    g.add_argument("--output", metavar="FILE", help="write the ranking as JSON")
    add_workload_arguments(p)


def run(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from pdserve.bench.metrics import Slo
    from pdserve.commands.bench import workload_from
    from pdserve.config import ModelConfig
    from pdserve.planner.plan import candidates, rank
    from pdserve.planner.profile import Profile

    if args.devices < 1:
        raise ValueError(f"invalid --devices {args.devices}: must be >= 1")
    if not 0 < args.target <= 1:
        raise ValueError(f"invalid --target {args.target}: must be in (0, 1]")
    try:
        chunks = [int(x) for x in args.chunk_sizes.split(",")]
        seqs = [int(x) for x in args.max_num_seqs.split(",")]
    except ValueError:
        raise ValueError("--chunk-sizes and --max-num-seqs take comma-separated integers") from None
    profile = Profile.load(args.sim_profile)
    slo = Slo.parse(args.slo)
    _, specs = workload_from(args)
    max_len = ModelConfig.from_pretrained(args.model).max_model_len
    cands = candidates(
        args.model, args.devices, chunk_sizes=chunks, max_num_seqs=seqs,
        cpu=profile.kind == "measured",
    )  # fmt: skip
    ranked = rank(profile, specs, slo, cands, max_model_len=max_len, target=args.target)
    print(f"pdserve plan: {len(specs)} requests, SLO {slo.describe()} for {args.target:.0%}, ")
    print(f"{args.devices} devices, profile {profile.description} ({profile.kind})\n")
    print("| rank | deployment | goodput req/s | per device | attainment at the load | flags |")
    print("| --- | --- | --- | --- | --- | --- |")
    for i, r in enumerate(ranked, 1):
        att = "-" if r.attainment_at_load is None else f"{r.attainment_at_load:.0%}"
        flags = " ".join(r.candidate.serve_flags()) or "(defaults)"
        print(
            f"| {i} | {r.candidate.name} | {r.goodput:.3f} | {r.per_device:.3f} | {att} | "
            f"`{flags}` |"
        )
    best = ranked[0]
    print(
        f"\nrecommended: pdserve serve --model {args.model} {' '.join(best.candidate.serve_flags())}"
    )
    if args.output:
        rows = [
            {
                "name": r.candidate.name,
                "serve_flags": r.candidate.serve_flags(),
                "threads_per_worker": r.candidate.threads_per_worker,
                "goodput": r.goodput,
                "goodput_per_device": r.per_device,
                "attainment_at_load": r.attainment_at_load,
            }
            for r in ranked
        ]
        Path(args.output).write_text(json.dumps({"slo": slo.describe(), "ranking": rows}, indent=1))
        print(f"wrote {args.output}")
    return 0
