"""`pdserve profile-hardware`: measure (or look up) the device's peaks and cache them."""

from __future__ import annotations

import argparse

HELP = "measure this machine's peak FLOP/s and memory bandwidth (cached)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--output",
        metavar="FILE",
        help="profile JSON to read or write (default: $PDSERVE_HARDWARE_PROFILE or "
        "~/.cache/pdserve/hardware.json)",
    )
    parser.add_argument("--force", action="store_true", help="measure again even if cached")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda[:N] (datasheet figures)")
    parser.add_argument(
        "--seconds", type=float, default=10.0, help="time to spend per measurement (default 10)"
    )
    parser.add_argument(
        "--threads",
        help="CPU thread counts to measure, e.g. 1,4 (default: 1 and every CPU this process may "
        "use; the engine uses the measurement for its own thread count, or scales the nearest)",
    )


def run(args: argparse.Namespace) -> int:
    import os

    import torch

    from pdserve.perf.hardware import load_hardware_profile, profile_path

    if args.seconds <= 0:
        raise ValueError(f"--seconds={args.seconds}: must be > 0")
    counts = [None]  # a GPU, or one named file: as it is
    if args.device == "cpu" and not args.output:
        try:
            counts = sorted({int(t) for t in args.threads.split(",")}) if args.threads else None
        except ValueError:
            raise ValueError(f"invalid --threads={args.threads!r}: expected e.g. 1,4") from None
        counts = counts or sorted({1, len(os.sched_getaffinity(0))})
    for threads in counts:
        if threads is not None:
            torch.set_num_threads(threads)
        profile = load_hardware_profile(
            args.output, args.device, force=args.force, seconds=args.seconds
        )
        print(profile.describe())
    if profile.source == "measured":
        print(f"cached in {profile_path(args.output)}")
    return 0
