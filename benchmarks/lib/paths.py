"""Where the benchmarks find the checkout, the shared models and traces, and the random model."""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the checkout: benchmarks/lib/ is two levels down
BENCHMARKS = ROOT / "benchmarks"
STORIES = ROOT.parent / "shared" / "models" / "stories260K"
TRACE = ROOT.parent / "shared" / "traces" / "azure_conv_2023.csv"
DEFAULT_125M = Path(tempfile.gettempdir()) / "pdbench" / "llama-125m"


def ensure_125m(path: Path) -> str:
    """The random llama-125m at `path`, written with `pdserve make-model` when missing."""
    if not (path / "config.json").exists():
        subprocess.run(["pdserve", "make-model", "--preset", "llama-125m", str(path)], check=True)
    return str(path)
