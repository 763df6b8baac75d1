"""A native product of two checkouts, alternated in one process: what a kernel change buys.

    git worktree add /tmp/old REV
    python benchmarks/kernel_ab.py /tmp/old [--rows 1] [--rounds 60]      # ~1 min at one row
    python benchmarks/kernel_ab.py /tmp/old --kernel int4 --flags=-mno-avx512f  # the AVX2 path
    python benchmarks/kernel_ab.py /tmp/old --kernel int8 --rows 8

Loads this checkout's kernel library and the other checkout's (each built from its own sources,
with `--flags` added: `-mno-avx512f` builds an AVX-512 machine's AVX2 paths), packs the same
weights with each checkout's own layer (`NativeLinear`, `Int8Linear`, or `Int4Linear` rounding to
nearest, groups of 32) onto huge pages where the machine has them (as the engine keeps its
weights), and times the chain of one llama-125m decode step's projections (4 per
layer x 12 layers: qkv, o, gate_up, down, and the 32000 x 768 head; 490 MiB in float32;
before 2026-12-06 the qkv had 12 KV heads, 526 MiB) on `--rows`
activation rows, the two chains alternated `--rounds` times (which goes first alternates too). The
speedup is taken per pair, so the swings of a shared machine's bandwidth from one minute to the
next cancel: on a machine whose engine-level decode moves by 1.7x between rounds, this is what
still resolves 5-10%.
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

from pdserve.kernels import huge_pages  # noqa: E402

# qkv (12 query and 4 KV heads of 64), o, gate_up, down: the random llama-125m's layer
LAYER = [(1280, 768), (768, 768), (6144, 768), (768, 3072)]
SHAPES = LAYER * 12 + [(32000, 768)]


def checkout_library(checkout: str, flags: list[str]) -> ctypes.CDLL:
    """The kernels of `checkout`'s sources, built (or found in the cache) by its own build.py."""
    code = f"from pdserve.kernels.build import build; print(build(extra_flags={tuple(flags)!r}))"
    path = subprocess.run([sys.executable, "-c", code], cwd=checkout, capture_output=True,
                          text=True, check=True).stdout.strip().splitlines()[-1]  # fmt: skip
    return ctypes.CDLL(path)


def checkout_layer(checkout: str, kernel: str):
    """`checkout`'s layer class for `kernel` (only its packing is used, never its forward)."""
    name = "packed_linear" if kernel == "f32" else "quant_linear"
    cls = {"f32": "NativeLinear", "int8": "Int8Linear", "int4": "Int4Linear"}[kernel]
    spec = importlib.util.spec_from_file_location(
        f"{Path(checkout).name}_{name}", Path(checkout) / f"pdserve/models/{name}.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, cls)


class Chain:
    """One checkout's library and packed weights, and the call of its product."""

    def __init__(self, checkout: str, kernel: str, flags: list[str], weights, rows: int) -> None:
        self.lib = checkout_library(checkout, flags)
        self.kernel = kernel
        P, I64 = ctypes.c_void_p, ctypes.c_int64
        if kernel == "f32":
            self.lib.pd_f32_linear.argtypes = [P, I64, I64, P, P, I64, P]
            self.packed = [(checkout_layer(checkout, kernel)(w, None).w,) for w in weights]
        elif kernel == "int8":
            self.lib.pd_int8_linear.argtypes = [P, I64, I64, P, P, I64, P]
            layer = checkout_layer(checkout, kernel)
            self.packed = [(m.q, m.scale) for m in (layer(w, None) for w in weights)]
        else:
            self.lib.pd_int4_linear.argtypes = [P, I64, I64, P, P, I64, I64, P]
            layer = checkout_layer(checkout, kernel)
            self.packed = [(m.q, m.scale) for m in (layer(w, None, group_size=32)
                                                    for w in weights)]  # fmt: skip
        if huge_pages.available():  # where the engine keeps its weights
            flat = huge_pages.arena([t for packed in self.packed for t in packed])
            it = iter(flat)
            self.packed = [tuple(next(it) for _ in packed) for packed in self.packed]
        self.ys = [torch.empty(rows, w.shape[0]) for w in weights]

    def __call__(self, xs, rows: int) -> None:
        for packed, x, y in zip(self.packed, xs, self.ys):
            n, k = y.shape[1], x.shape[1]
            if self.kernel == "f32":
                self.lib.pd_f32_linear(x.data_ptr(), rows, k, packed[0].data_ptr(), None, n,
                                       y.data_ptr())  # fmt: skip
            elif self.kernel == "int8":
                rc = self.lib.pd_int8_linear(x.data_ptr(), rows, k, packed[0].data_ptr(),
                                             packed[1].data_ptr(), n, y.data_ptr())  # fmt: skip
                assert rc == 0
            else:
                rc = self.lib.pd_int4_linear(x.data_ptr(), rows, k, packed[0].data_ptr(),
                                             packed[1].data_ptr(), n, 32, y.data_ptr())  # fmt: skip
                assert rc == 0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("other", help="another checkout (e.g. a git worktree of an older commit)")
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--rounds", type=int, default=60)
    p.add_argument("--kernel", choices=("f32", "int8", "int4"), default="f32")
    p.add_argument("--flags", action="append", default=[], help="added to both builds")
    p.add_argument("--output")
    a = p.parse_args()
    torch.manual_seed(0)
    weights = [torch.randn(n, k) * 0.02 for n, k in SHAPES]
    xs = [torch.randn(a.rows, k) for _, k in SHAPES]
    chains = {"other": Chain(a.other, a.kernel, a.flags, weights, a.rows),
              "this": Chain(str(HERE.parent), a.kernel, a.flags, weights, a.rows)}  # fmt: skip
    nbytes = sum(t.numel() * t.element_size() for p in chains["this"].packed for t in p)

    def run(name: str) -> float:
        t0 = time.perf_counter()
        chains[name](xs, a.rows)
        return time.perf_counter() - t0

    for name in chains:  # warm-up, and both compute the same products
        run(name)
    for y0, y1 in zip(chains["this"].ys, chains["other"].ys):
        torch.testing.assert_close(y0, y1, rtol=1e-4, atol=1e-4)
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

    result = {"kernel": a.kernel, "flags": a.flags, "threads": torch.get_num_threads(),
              "rows": a.rows, "rounds": a.rounds, "mib": round(nbytes / 2**20),
              "gbs_other_p10_p50_p90": deciles(rates["other"]),
              "gbs_this_p10_p50_p90": deciles(rates["this"]),
              "speedup_p10_p50_p90": deciles(ratios)}  # fmt: skip
    print(json.dumps(result))
    if a.output:
        Path(a.output).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
