"""`pdserve profile`: measure this machine's step-time model for a model folder.

Writes the profile JSON that `pdserve simulate` (and the planner) read: a fitted step-time model
per thread count and KV transfer rates (see pdserve/perf/step_profile.py for what runs), and
what serving adds to a step (pdserve/perf/serving_costs.py: a short `pdserve serve` run). The
engine flags are `pdserve serve`'s, so the profile is of the engine a deployment would run
(`--linear-backend`, `--dtype`, ...). A profile keeps the steps it measured, so `--refit`
fits them again (a later version's fit, or `--no-decode-split`) without measuring anything, and
`--anchor` scales a profile to this machine's speed of the moment by a probe of a few seconds.
`--speed-trace SECONDS` adds how that speed moves for decode steps over minutes
(pdserve/planner/speed.py), which `pdserve simulate` follows.
"""

from __future__ import annotations

import argparse
import os

HELP = "measure step times on this machine for a model (the simulator's cost model)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    from pdserve.commands.engine_args import add_engine_arguments

    g = p.add_argument_group("profile")
    g.add_argument("--output", metavar="FILE", required=True, help="profile JSON to write")
    g.add_argument(
        "--threads",
        help="thread counts to measure, e.g. 1,2 (default: 1 and every CPU this process may use)",
    )
    g.add_argument("--repeats", type=int, default=2, help="times each scenario runs (default 2)")
    g.add_argument(
        "--analytic",
        metavar="GPU",
        help="write an analytic profile of one GPU per worker instead (e.g. H100, A100, L4: "
        "datasheet peaks at --mfu and --mbu); nothing is measured and only config.json is read",
    )
    g.add_argument(
        "--no-serving-costs",
        dest="serving_costs",
        action="store_false",
        help="skip measuring what serving adds (a pdserve serve of the model on every allowed "
        "CPU and one split into a prefill and a decode worker, about two minutes: the "
        "frontend's CPU per output token, its latency, and how much longer a served step takes "
        "than the same step in-process)",
    )
    g.add_argument(
        "--no-decode-split",
        dest="split_decode",
        action="store_false",
        help="fit every decode-only step with one line, even where wide decode batches fit "
        "better apart (the kernel's tile of rows)",
    )
    g.add_argument(
        "--refit",
        metavar="FILE",
        help="measure nothing: fit the step models again to the steps a measured profile kept, "
        "with this version's fit (and --no-decode-split), and write them to --output",
    )
    g.add_argument(
        "--anchor",
        metavar="FILE",
        help="measure a few seconds of steps on a measured profile's thread counts and write it "
        "to --output with its step models scaled to this machine's speed of the moment (give the "
        "engine flags it was measured with); about half a minute",
    )
    g.add_argument(
        "--speed-trace",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="also measure how this machine's speed for decode steps moves over this many "
        "seconds (a few decode steps per thread count every half second, on the idle machine; "
        "e.g. 180): a shared VM's memory bandwidth moves in stretches that a profile of a few "
        "minutes may not see, and pdserve simulate follows the trace. With --anchor, the trace "
        "is added to that profile; at most 3600, not with --refit or --analytic (default 0: none)",
    )
    g.add_argument("--mfu", type=float, default=0.5, help="--analytic: MFU reached (0.5)")
    g.add_argument("--mbu", type=float, default=0.7, help="--analytic: MBU reached (0.7)")
    add_engine_arguments(p)


def run(args: argparse.Namespace) -> int:
    from pdserve.commands.engine_args import engine_args_from

    check_speed_trace(args)
    if args.refit:
        return _refit(args)
    engine = engine_args_from(args)
    if args.anchor:
        return _anchor(args, engine)
    if args.analytic:
        return _analytic(args, engine)
    allowed = len(os.sched_getaffinity(0))
    try:
        threads = sorted({int(t) for t in args.threads.split(",")}) if args.threads else None
    except ValueError:
        raise ValueError(f"invalid --threads={args.threads!r}: expected e.g. 1,2") from None
    threads = threads or sorted({1, allowed})
    if args.repeats < 1:
        raise ValueError(f"invalid --repeats {args.repeats}: must be >= 1")
    from pdserve.perf.step_profile import measure_profile

    profile = measure_profile(engine, threads, repeats=args.repeats, split_decode=args.split_decode)
    if args.serving_costs:
        from pdserve.perf.serving_costs import measure_serving_costs
        from pdserve.planner.profile import calibration_drift

        profile.serving = measure_serving_costs(engine, step_models=profile.step_model)
        drift = calibration_drift(profile)
        if drift is not None:
            note = (
                f"the calibration's in-process decode steps took x{drift:.2f} the step model's "
                "time, minutes after the steps were measured: this machine's speed moved by "
                "that much, and simulated figures with it"
            )
            profile.notes.append(note)
            print(note)
    _add_speed_trace(args, engine, profile)
    profile.save(args.output)
    print(f"wrote {args.output}")
    return 0


def _analytic(args: argparse.Namespace, engine) -> int:
    import json
    from pathlib import Path

    from pdserve.planner.profile import analytic_profile

    for name in ("mfu", "mbu"):
        if not 0 < getattr(args, name) <= 1:
            raise ValueError(f"invalid --{name} {getattr(args, name)}: must be in (0, 1]")
    config = json.loads((Path(engine.model) / "config.json").read_text())
    dtype = "bfloat16" if engine.dtype == "auto" else engine.dtype
    profile = analytic_profile(config, args.analytic, dtype=dtype, mfu=args.mfu, mbu=args.mbu)
    profile.save(args.output)
    print("\n".join(profile.notes))
    print(f"wrote {args.output}")
    return 0


def _refit(args: argparse.Namespace) -> int:
    from pdserve.planner.profile import Profile, refit

    profile = refit(Profile.load(args.refit), split_decode=args.split_decode)
    for size, model in sorted(profile.step_models.items()):
        wide = getattr(model, "wide_decode", None)
        split = f"decode batches of more than {model.wide_rows} apart" if wide else "no split"
        print(f"{size} thread(s): {len(profile.samples[size])} steps refitted ({split})")
    if profile.serving is not None:
        s = profile.serving
        part, part_prompt = s.part_decode_step_factor, s.part_prefill_step_factor
        print(f"served-step factors x{s.decode_step_factor:.2f} (decode), "
              f"{s.prefill_step_overhead_s * 1e3:.1f} ms + x{s.prefill_step_factor:.2f} (prompt)"
              + (f", x{part:.2f} (decode on {s.part_cpus} CPU(s))" if part else "")
              + (f", x{part_prompt:.2f} (prompt on part)" if part_prompt else ""))  # fmt: skip
    profile.save(args.output)
    print(f"wrote {args.output}")
    return 0


def _anchor(args: argparse.Namespace, engine) -> int:
    from pdserve.perf.step_profile import measure_anchors
    from pdserve.planner.profile import Profile

    profile = Profile.load(args.anchor)
    profile = profile.anchored(measure_anchors(engine, profile))
    _add_speed_trace(args, engine, profile)
    profile.save(args.output)
    print(f"wrote {args.output}")
    return 0


MAX_SPEED_TRACE_S = 3600.0


def check_speed_trace(args: argparse.Namespace) -> None:
    """`--speed-trace` in range, and only where something measured takes it."""
    seconds = args.speed_trace
    if not 0 <= seconds <= MAX_SPEED_TRACE_S:  # NaN fails too
        raise ValueError(
            f"invalid --speed-trace {seconds}: must be 0 to {MAX_SPEED_TRACE_S:.0f} seconds"
        )
    if seconds and (args.refit or args.analytic):
        flag = "--refit" if args.refit else "--analytic"
        raise ValueError(f"--speed-trace measures this machine: not with {flag}")


def _add_speed_trace(args: argparse.Namespace, engine, profile) -> None:
    """`--speed-trace`: measure it into `profile` (against its fitted models) and say so."""
    if not args.speed_trace:
        return
    from pdserve.perf.step_profile import measure_speed

    print(f"speed trace: {args.speed_trace:.0f} s of decode probes")
    profile.speed = measure_speed(engine, profile, args.speed_trace)
    for size, trace in sorted(profile.speed.items()):
        profile.notes.append(f"speed trace, {size} thread(s): {trace.describe()}")
