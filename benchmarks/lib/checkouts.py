"""Two checkouts measured in turn, each in fresh processes: the harness of the benchmarks that
compare this checkout with another (`--other`, e.g. a git worktree of an older commit)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from lib.paths import ROOT


def add_arguments(p: argparse.ArgumentParser, rounds: int, model_dir: Path) -> None:
    """`--other`, `--rounds`, `--model-dir`, `--output` and the hidden `--child CHECKOUT`."""
    p.add_argument("--other", help="a second checkout to alternate with this one")
    p.add_argument("--rounds", type=int, default=rounds)
    p.add_argument("--model-dir", type=Path, default=model_dir)
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--output", type=Path, help="write every round's figures here (JSON)")


def checkouts(other: str | None) -> list[str]:
    """This checkout, then `other` if given."""
    return [str(ROOT)] + ([str(Path(other).resolve())] if other else [])


def alternated(checkouts: list[str], rounds: int) -> Iterator[tuple[int, str]]:
    """(round, checkout) for every round and checkout; which goes first alternates, so a
    shared machine's swings fall on both."""
    for r in range(rounds):
        for c in checkouts if r % 2 == 0 else checkouts[::-1]:
            yield r, c


def run_child(script: str, checkout: str, model: str) -> dict:
    """`script --child CHECKOUT --model-dir MODEL` in a fresh interpreter; the JSON object its
    last line of output holds."""
    out = subprocess.run([sys.executable, script, "--child", checkout, "--model-dir", model],
                         capture_output=True, text=True, check=True)  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])
