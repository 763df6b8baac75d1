"""`pdserve` command line: one subcommand per module in `pdserve/commands/`.

Each command module exposes `HELP` (one line), `add_arguments(parser)` and `run(args) -> int`;
modules are imported only when their command runs, so `pdserve --help` stays fast. A module may
also expose `profile_defaults(args) -> dict`: defaults that depend on a flag (`serve --profile`),
applied by parsing a second time with them as the command's defaults, so that any flag given
still overrides them.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = {
    "bench": "pdserve.commands.bench",
    "serve": "pdserve.commands.serve",
    "generate": "pdserve.commands.generate",
    "make-model": "pdserve.commands.make_model",
    "profile-hardware": "pdserve.commands.profile_hardware",
    "profile": "pdserve.commands.profile",
    "simulate": "pdserve.commands.simulate",
    "plan": "pdserve.commands.plan",
    "advise": "pdserve.commands.advise",
}

HELP = {
    "bench": "benchmark an OpenAI-compatible server: TTFT, ITL, TPOT, goodput; sweeps; comparisons",
    "serve": "serve a model over an OpenAI-compatible HTTP API",
    "generate": "generate text offline and print a per-phase timing summary",
    "make-model": "write a random-weight Hugging Face model folder (for tests and benchmarks)",
    "profile-hardware": "measure this machine's peak FLOP/s and memory bandwidth (cached)",
    "profile": "measure step times on this machine for a model (the simulator's cost model)",
    "simulate": "simulate a deployment on a workload with a step-time profile (no model run)",
    "plan": "rank deployments of a device budget by simulated goodput per device",
    "advise": "say which phase limits a server (live, or from a pdserve bench JSON) and what to change",
}


def build_parser(argv: list[str], defaults: dict | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdserve", description="pdserve: an LLM engine built around prefill and decode."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        p = sub.add_parser(name, help=HELP[name], description=HELP[name])
        # Only the chosen command's module is imported (torch is slow to import).
        if name in argv:
            importlib.import_module(COMMANDS[name]).add_arguments(p)
            if defaults:
                p.set_defaults(**defaults)
    return parser


def parse_args(argv: list[str]) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    """The parser and the parsed flags, with the command's flag-dependent defaults applied."""
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if args.command is not None:
        module = importlib.import_module(COMMANDS[args.command])
        hook = getattr(module, "profile_defaults", None)
        defaults = hook(args) if hook is not None else {}
        if defaults:
            parser = build_parser(argv, defaults)
            args = parser.parse_args(argv)
    return parser, args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser, args = parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return importlib.import_module(COMMANDS[args.command]).run(args) or 0
    except ValueError as e:  # user mistakes: a clear message, no traceback
        print(f"pdserve {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
