"""The float32 native product of two checkouts, alternated in one process: what a kernel change buys.

    git worktree add /tmp/old REV
    python benchmarks/kernel_ab.py /tmp/old [--rows 1] [--rounds 60]      # ~1 min at one row

Loads this checkout's kernel library and the other checkout's (built from its sources, as it
would build them), packs the same weights with each checkout's own `NativeLinear`, and times the
chain of one llama-125m decode step's float32 projections (4 per layer x 12 layers: qkv, o,
gate_up, down, and the 32000 x 768 head; 526 MiB) on `--rows` activation rows, the two chains
alternated `--rounds` times (which goes first alternates too). The speedup is taken per pair, so
the swings of a shared machine's bandwidth from one minute to the next cancel: on a machine
whose engine-level decode moves by 1.7x between rounds, this is what still resolves 5-10%.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # this checkout's pdserve

from pdserve.kernels.build import library  # noqa: E402

LAYER = [(2304, 768), (768, 768), (6144, 768), (768, 3072)]  # qkv, o, gate_up, down
SHAPES = LAYER * 12 + [(32000, 768)]


def other_library(checkout: str) -> ctypes.CDLL:
    code = "from pdserve.kernels.build import library; print(library()._name)"
    path = subprocess.run([sys.executable, "-c", code], cwd=checkout, capture_output=True,
                          text=True, check=True).stdout.strip().splitlines()[-1]  # fmt: skip
    return ctypes.CDLL(path)


def other_packing(checkout: str):
    """The other checkout's `NativeLinear` (only its packing is used)."""
    spec = importlib.util.spec_from_file_location(
        "other_packed_linear", Path(checkout) / "pdserve/models/packed_linear.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.NativeLinear


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("other", help="another checkout (e.g. a git worktree of an older commit)")
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--rounds", type=int, default=60)
    p.add_argument("--output")
    a = p.parse_args()
    from pdserve.models.packed_linear import NativeLinear

    sides = {"other": (other_library(a.other), other_packing(a.other)),
             "this": (library(), NativeLinear)}  # fmt: skip
    torch.manual_seed(0)
    weights = [torch.randn(n, k) * 0.02 for n, k in SHAPES]
    xs = [torch.randn(a.rows, k) for _, k in SHAPES]
    nbytes = sum(w.numel() * 4 for w in weights)
    chains = {}
    for name, (lib, cls) in sides.items():
        lib.pd_f32_linear.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                      ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                      ctypes.c_void_p]  # fmt: skip
        packed = [cls(w, None).w for w in weights]
        ys = [torch.empty(a.rows, n) for n, _ in SHAPES]
        chains[name] = (lib, packed, ys)

    def run(name: str) -> float:
        lib, packed, ys = chains[name]
        t0 = time.perf_counter()
        for w, x, y, (n, k) in zip(packed, xs, ys, SHAPES):
            lib.pd_f32_linear(x.data_ptr(), a.rows, k, w.data_ptr(), None, n, y.data_ptr())
        return time.perf_counter() - t0

    for name in chains:  # warm-up, and both compute the same products
        run(name)
    torch.testing.assert_close(chains["this"][2], chains["other"][2], rtol=1e-4, atol=1e-4)
    ratios, rates = [], {"other": [], "this": []}
    for r in range(a.rounds):
        order = ("other", "this") if r % 2 == 0 else ("this", "other")
        t = {name: run(name) for name in order}
        ratios.append(t["other"] / t["this"])
        for name in t:
            rates[name].append(nbytes / t[name] / 1e9)

    def deciles(v: list[float]) -> list[float]:
        q = statistics.quantiles(v, n=10)
        return [round(q[0], 3), round(statistics.median(v), 3), round(q[-1], 3)]

    result = {"rows": a.rows, "rounds": a.rounds, "mib": round(nbytes / 2**20),
              "gbs_other_p10_p50_p90": deciles(rates["other"]),
              "gbs_this_p10_p50_p90": deciles(rates["this"]),
              "speedup_p10_p50_p90": deciles(ratios)}  # fmt: skip
    print(json.dumps(result))
    if a.output:
        Path(a.output).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
