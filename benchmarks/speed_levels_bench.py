"""Which of this machine's speeds moves: compute, memory bandwidth, and decode steps, side by side.

    python benchmarks/speed_levels_bench.py --windows 40      # about 3 minutes

On a shared VM the speed of a decode step moves in stretches (docs/PERFORMANCE.md). This names
the resource that moves: in each window, in turn, a second of two-thread decode steps of one
sequence (llama-125m by default, the median step), a second of 512 x 512 float32 matrix
products on every allowed CPU (GFLOP/s: compute) and a second of sums over a 256 MiB buffer
(GB/s read: memory bandwidth), then the same decode shape on one thread. Printed per window, then
how far each moved (p10 / p50 / p90, and the max over the min) and how closely each follows the
two-thread decode step across windows (Pearson correlation of decode time with 1 / GFLOP/s and
with 1 / GB/s). Run it on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lib.machine import code_info, machine_info  # noqa: E402
from lib.paths import DEFAULT_125M, ensure_125m  # noqa: E402

from pdserve.config import EngineArgs  # noqa: E402
from pdserve.engine.core import EngineCore  # noqa: E402
from pdserve.perf.step_profile import Driver  # noqa: E402


def rate(fn, seconds: float) -> float:
    """Calls of `fn` per second over about `seconds`."""
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        fn()
        n += 1
    return n / (time.perf_counter() - start)


def decode_ms(driver: Driver, seconds: float) -> float:
    """The median decode step of one sequence (256-token prompt) over about `seconds`."""
    driver.samples.clear()
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        driver.add(256, 40)
        driver.run(8192)
    steps = [t for s, t in driver.samples if s.is_decode]
    return 1e3 * statistics.median(steps)


def pinned_to(cpus: list[int]) -> None:
    os.sched_setaffinity(0, cpus)
    torch.set_num_threads(len(cpus))


def correlation(xs: list[float], ys: list[float]) -> float:
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    cov = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    sx = sum((x - mx) ** 2 for x in xs) ** 0.5
    sy = sum((y - my) ** 2 for y in ys) ** 0.5
    return cov / (sx * sy) if sx and sy else float("nan")


def spread(values: list[float]) -> str:
    v = sorted(values)
    q = lambda p: v[int(p * (len(v) - 1))]  # noqa: E731
    return f"{q(0.1):.1f} / {q(0.5):.1f} / {q(0.9):.1f} (max / min x{v[-1] / v[0]:.2f})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help=f"model folder (default: random llama-125m in {DEFAULT_125M})")
    p.add_argument("--windows", type=int, default=40)
    p.add_argument("--seconds", type=float, default=1.0, help="per measurement (default 1)")
    p.add_argument("--output", help="write every window as JSON")
    a = p.parse_args()
    model = a.model or ensure_125m(DEFAULT_125M)
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        raise SystemExit("needs two CPUs")
    pinned_to(allowed[:2])
    two = Driver(EngineCore(EngineArgs(model=model, num_threads=2)), seed=1)
    pinned_to(allowed[:1])
    one = Driver(EngineCore(EngineArgs(model=model, num_threads=1)), seed=2)
    a_mat, b_mat = torch.randn(512, 512), torch.randn(512, 512)
    buf = torch.ones(64 << 20)  # 256 MiB of float32
    for d, cpus in ((two, allowed[:2]), (one, allowed[:1])):
        pinned_to(cpus)
        d.warm_up()
    rows = []
    print("window  decode 2t ms  GFLOP/s 2t  read GB/s 2t  decode 1t ms", flush=True)
    for i in range(a.windows):
        pinned_to(allowed[:2])
        dec2 = decode_ms(two, a.seconds)
        gflops = rate(lambda: torch.mm(a_mat, b_mat), a.seconds) * 2 * 512**3 / 1e9
        gbps = rate(buf.sum, a.seconds) * buf.numel() * 4 / 1e9
        pinned_to(allowed[:1])
        dec1 = decode_ms(one, a.seconds)
        rows.append(
            {"decode_2t_ms": dec2, "gflops": gflops, "read_gbps": gbps, "decode_1t_ms": dec1}
        )
        print(f"{i:6d}  {dec2:12.1f}  {gflops:10.1f}  {gbps:12.1f}  {dec1:12.1f}", flush=True)
    pinned_to(allowed)
    col = {k: [r[k] for r in rows] for k in rows[0]}
    print("\np10 / p50 / p90 over the windows:")
    labels = {
        "decode_2t_ms": "decode, 2 threads, ms",
        "gflops": "matmul GFLOP/s",
        "read_gbps": "read GB/s",
        "decode_1t_ms": "decode, 1 thread, ms",
    }
    for k, label in labels.items():
        print(f"  {label:24s} {spread(col[k])}")
    decode = col["decode_2t_ms"]
    inv = lambda xs: [1 / x for x in xs]  # noqa: E731
    print(
        "correlation of the two-thread decode step with: "
        f"1 / GFLOP/s {correlation(decode, inv(col['gflops'])):+.2f}, "
        f"1 / read GB/s {correlation(decode, inv(col['read_gbps'])):+.2f}; "
        f"the one-thread step {correlation(decode, col['decode_1t_ms']):+.2f}"
    )
    if a.output:
        res = {"machine": machine_info(), "code": code_info(), "args": vars(a), "windows": rows}
        Path(a.output).write_text(json.dumps(res, indent=1))
        print(f"wrote {a.output}")


if __name__ == "__main__":
    main()
