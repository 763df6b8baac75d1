"""What machine, and which pdserve, a result came from."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path
from typing import Any

from lib.paths import ROOT


def engine_machine() -> dict[str, Any]:
    """engine_bench.py's `machine`: the CPU with torch's thread count, and the software."""
    import torch

    from pdserve.perf.hardware import cpu_name

    return {
        "cpu": cpu_name(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "logical_cpus": os.cpu_count(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "loadavg_at_start": os.getloadavg(),
    }


def machine_info() -> dict:
    """serving_bench.py's and disagg_bench.py's `machine`: CPUs and memory."""
    from pdserve.perf.hardware import cpu_model

    return {
        "cpus": os.cpu_count(),
        "cpu_model": cpu_model(),
        "mem_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
    }


def code_info() -> dict:
    """Which pdserve is measured (set PYTHONPATH to a clean export to pin a commit)."""
    import pdserve

    git = ["git", "-C", str(ROOT)]
    head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    dirty = subprocess.run(
        [*git, "status", "--porcelain", "pdserve"], capture_output=True, text=True
    ).stdout.split("\n")
    return {
        "pdserve": str(Path(pdserve.__file__).parent),
        "repo_head": head.strip(),
        "repo_pdserve_dirty": [d for d in dirty if d],
    }
