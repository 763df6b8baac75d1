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
        "--seconds", type=float, default=10.0, help="time to spend measuring (default 10)"
    )


def run(args: argparse.Namespace) -> int:
    from pdserve.perf.hardware import load_hardware_profile, profile_path

    if args.seconds <= 0:
        raise ValueError(f"--seconds={args.seconds}: must be > 0")
    profile = load_hardware_profile(
        args.output, args.device, force=args.force, seconds=args.seconds
    )
    print(profile.describe())
    if profile.source == "measured":
        print(f"cached in {profile_path(args.output)}")
    return 0
