"""Engine options shared by every command that builds an engine (`generate`, `serve`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from pdserve.commands.flags import add_flags, from_args
from pdserve.config.engine import EngineArgs


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """A flag per `EngineArgs` setting, in the "model", "KV cache" and "scheduler" sections."""
    add_flags(parser, EngineArgs, "model", {})


def engine_args_from(args: argparse.Namespace) -> EngineArgs:
    if not Path(args.model).is_dir():  # before anything slow is imported
        raise ValueError(f"invalid --model {args.model!r}: no such folder")
    return from_args(EngineArgs, args)
