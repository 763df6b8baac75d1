"""Peak FLOP/s and memory bandwidth of the device: the denominators of MFU and MBU.

CPUs are measured (dense GEMMs for FLOP/s, a large copy and a large reduction for bandwidth) and
the result is cached as JSON; GPUs are looked up in a datasheet table by device name (dense, no
sparsity). The cache lives at `~/.cache/pdserve/hardware.json`, or at $PDSERVE_HARDWARE_PROFILE,
or at the path a caller passes (`--hardware-profile FILE`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from pdserve.perf.datasheets import datasheet

ENV_VAR = "PDSERVE_HARDWARE_PROFILE"
DEFAULT_PATH = Path("~/.cache/pdserve/hardware.json")
GEMM_SIZES = (1024, 2048, 4096)
COPY_BYTES = 512 * 2**20
CPU_DTYPES = ("float32", "bfloat16")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class HardwareProfile:
    """What one device can do at best.

    peak_flops: dtype name (`float32`, `bfloat16`, `float16`) -> dense matmul FLOP/s.
    mem_bandwidth_bytes_s: read bandwidth (bytes read per second).
    copy_bandwidth_bytes_s: copy bandwidth, counting bytes read plus bytes written.
    source: `measured` or `datasheet`.
    """

    name: str
    peak_flops: dict[str, float]
    mem_bandwidth_bytes_s: float
    copy_bandwidth_bytes_s: float
    source: str = "measured"

    def __post_init__(self) -> None:
        if not self.peak_flops or any(v <= 0 for v in self.peak_flops.values()):
            raise ValueError(f"peak_flops={self.peak_flops!r}: need positive figures")
        for field in ("mem_bandwidth_bytes_s", "copy_bandwidth_bytes_s"):
            if getattr(self, field) <= 0:
                raise ValueError(f"{field}={getattr(self, field)!r}: must be > 0")

    def peak_flops_for(self, dtype: str | torch.dtype) -> float:
        """Peak FLOP/s for `dtype` (a name or a torch dtype)."""
        name = str(dtype).removeprefix("torch.")
        if name not in self.peak_flops:
            raise ValueError(
                f"dtype {name!r} not in profile {self.name!r}; has: {', '.join(self.peak_flops)}"
            )
        return self.peak_flops[name]

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str) -> HardwareProfile:
        """Parse `to_json` output; ValueError if it is not a profile."""
        try:
            data: dict[str, Any] = json.loads(text)
            data["peak_flops"] = {k: float(v) for k, v in data["peak_flops"].items()}
            return cls(**data)
        except (KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"not a hardware profile: {e!r}") from e

    def save(self, path: str | Path) -> Path:
        path = Path(path).expanduser()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(self.to_json(), encoding="utf-8")
        tmp.replace(path)  # atomic: a concurrent reader never sees half a file
        return path

    @classmethod
    def load(cls, path: str | Path) -> HardwareProfile:
        path = Path(path).expanduser()
        try:
            return cls.from_json(path.read_text(encoding="utf-8"))
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from e

    def describe(self) -> str:
        lines = [f"{self.name} ({self.source})"]
        for dtype, flops in self.peak_flops.items():
            lines.append(f"  peak {dtype:<9} {flops / 1e12:10.3f} TFLOP/s")
        lines.append(f"  read bandwidth   {self.mem_bandwidth_bytes_s / 1e9:10.1f} GB/s")
        lines.append(f"  copy bandwidth   {self.copy_bandwidth_bytes_s / 1e9:10.1f} GB/s (r+w)")
        return "\n".join(lines)


def datasheet_profile(device_name: str) -> HardwareProfile:
    """The datasheet profile of a GPU named as `torch.cuda.get_device_name()` names it."""
    sheet = datasheet(device_name)
    return HardwareProfile(
        name=f"{sheet.label} ({device_name})",
        peak_flops={
            "float32": sheet.fp32_flops,
            "bfloat16": sheet.half_flops,
            "float16": sheet.half_flops,
        },
        mem_bandwidth_bytes_s=sheet.bandwidth,
        copy_bandwidth_bytes_s=sheet.bandwidth,
        source="datasheet",
    )


# ---------------------------------------------------------------------------------------------
# CPU measurement


def cpu_model() -> str:
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return model


def cpu_name(threads: int | None = None) -> str:
    """The CPU model and a thread count (torch's current one by default): peaks depend on both."""
    return f"{cpu_model()} ({threads or torch.get_num_threads()} threads)"


def _threads_of(profile: HardwareProfile) -> int | None:
    if profile.name.endswith(" threads)"):
        return int(profile.name.rsplit("(", 1)[1].split()[0])
    return None


def measure_gemm_flops(
    dtype: str | torch.dtype = "float32",
    seconds: float = 2.0,
    sizes: Sequence[int] = GEMM_SIZES,
) -> float:
    """Best FLOP/s of square matmuls (n x n @ n x n = 2 n^3 FLOPs) in `dtype`, all threads.

    Sizes go from small to large; a size is tried only if a warm-up and one timed run fit in the
    time left (extrapolated from the previous size), so a small `seconds` measures only the
    smallest size, whose two runs (warm-up included) always happen."""
    dt = _dtype(dtype)
    deadline = time.perf_counter() + seconds
    best_flops_s = 0.0
    prev: tuple[int, float] | None = None  # (n, best seconds of one matmul)
    for n in sizes:
        if prev is not None:
            expected_s = prev[1] * (n / prev[0]) ** 3
            if time.perf_counter() + 2 * expected_s > deadline:
                break
        a = torch.randn(n, n).to(dt)
        b = torch.randn(n, n).to(dt)
        out = torch.empty(n, n, dtype=dt)
        matmul = functools.partial(torch.mm, a, b, out=out)
        run_s = _best_time(matmul, deadline - time.perf_counter(), max_runs=6)
        best_flops_s = max(best_flops_s, 2.0 * n**3 / run_s)
        prev = (n, run_s)
    return best_flops_s


def _dtype(dtype: str | torch.dtype) -> torch.dtype:
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"dtype {name!r}: expected one of {', '.join(_DTYPES)}")
    return _DTYPES[name]


def measure_bandwidth(seconds: float = 2.0, num_bytes: int = COPY_BYTES) -> tuple[float, float]:
    """(read, copy) bandwidth in bytes/s over float32 buffers of `num_bytes` each.

    Read: best time of a sum of the buffer (num_bytes read): torch's `x.sum()` and, on a CPU
    where pdserve's native kernels build, their streaming sum (`kernels/cpu_memory.c`), also of
    a copy on huge pages where this machine has them (the native kernels' weights live there:
    `kernels/huge_pages.py`), whichever is fastest: a roofline must bound every kernel, and on
    some machines `x.sum()` reads slower than a single-row matrix product does. Copy: best time
    of `y.copy_(x)`, counted as 2 * num_bytes (read plus write). Buffers should be far larger
    than the last-level cache."""
    numel = max(num_bytes // 4, 1)
    src = torch.ones(numel)  # touched now, so page faults are not timed
    dst = torch.zeros(numel)
    reads = _native_reads(src)
    share = seconds / (2 + len(reads))
    copy_s = _best_time(lambda: dst.copy_(src), share)
    read_s = _best_time(src.sum, share)
    for read in reads:
        read_s = min(read_s, _best_time(read, share))
    return numel * 4 / read_s, 2 * numel * 4 / copy_s


def _native_reads(src: torch.Tensor) -> list[Callable[[], object]]:
    """The native streaming sum of `src` and, where huge pages are available, of a copy on
    them; none where the native kernels do not build."""
    from pdserve.kernels import huge_pages, memory

    if not memory.available()[0]:
        return []
    reads: list[Callable[[], object]] = [lambda: memory.read_sum(src)]
    if huge_pages.supported():  # whether or not the engine is told to use them
        (huge,) = huge_pages.arena([src])
        reads.append(lambda: memory.read_sum(huge))
    return reads


def _best_time(fn: Callable[[], object], seconds: float, max_runs: int = 10) -> float:
    """Best wall time of `fn` over runs that fit in `seconds` (at least two: a warm-up)."""
    deadline = time.perf_counter() + seconds
    best_s = float("inf")
    for i in range(max_runs):
        start = time.perf_counter()
        fn()
        elapsed_s = time.perf_counter() - start
        best_s = min(best_s, elapsed_s)
        if i >= 1 and time.perf_counter() + elapsed_s > deadline:
            break
    return best_s


def measure_cpu_profile(
    dtypes: Sequence[str | torch.dtype] = CPU_DTYPES,
    seconds: float = 10.0,
    copy_bytes: int = COPY_BYTES,
) -> HardwareProfile:
    """Measure this CPU in about `seconds`: GEMM peaks for each dtype, then bandwidth.

    float16 is left out by default: on most CPUs torch has no fast float16 GEMM (a 1024^3
    product takes seconds), and CPU engines run float32 or bfloat16."""
    if not dtypes or seconds <= 0:
        raise ValueError(f"dtypes={dtypes!r}, seconds={seconds!r}: need dtypes and seconds > 0")
    gemm_s = 0.7 * seconds / len(dtypes)
    peaks = {str(d).removeprefix("torch."): measure_gemm_flops(d, gemm_s) for d in dtypes}
    read_bytes_s, copy_bytes_s = measure_bandwidth(0.3 * seconds, copy_bytes)
    return HardwareProfile(
        name=cpu_name(),
        peak_flops=peaks,
        mem_bandwidth_bytes_s=read_bytes_s,
        copy_bandwidth_bytes_s=copy_bytes_s,
        source="measured",
    )


# ---------------------------------------------------------------------------------------------
# Loading


def profile_path(path: str | Path | None = None) -> Path:
    """Where the profile is cached: `path`, else $PDSERVE_HARDWARE_PROFILE, else the default."""
    chosen = path or os.environ.get(ENV_VAR) or DEFAULT_PATH
    return Path(chosen).expanduser()


def cached_hardware_profile(
    path: str | Path | None = None,
    device: str | torch.device = "cpu",
    threads: int | None = None,
) -> HardwareProfile | None:
    """The profile of `device` without measuring anything; None when the CPU has none yet.

    A file named by `path` or $PDSERVE_HARDWARE_PROFILE is used as it is when it exists (so a
    planner can read any device's profile). Otherwise CUDA devices come from the datasheet table
    (ValueError for an unknown GPU), and the CPU from the default cache, which holds one
    measurement per thread count: the one for `threads` (torch's current count by default), else
    the nearest one of this CPU model with its FLOP/s scaled to `threads` (stated in `source`).
    """
    chosen = path or os.environ.get(ENV_VAR)
    if chosen and profile_path(chosen).is_file():
        return HardwareProfile.load(profile_path(chosen))
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device={str(device)!r}: CUDA is not available here")
        return datasheet_profile(torch.cuda.get_device_name(device))
    if device.type != "cpu":
        raise ValueError(f"device={str(device)!r}: expected cpu or cuda")
    if chosen:
        return None
    threads = threads or torch.get_num_threads()
    measured = {
        _threads_of(p): p
        for p in read_cache(profile_path(None))
        if p.name == cpu_name(_threads_of(p))
    }
    measured.pop(None, None)
    if not measured:
        return None
    if threads in measured:
        return measured[threads]
    nearest = min(measured, key=lambda n: (abs(n - threads), n))
    return scaled_profile(measured[nearest], nearest, threads)


def scaled_profile(profile: HardwareProfile, measured: int, threads: int) -> HardwareProfile:
    """An estimate for another thread count: FLOP/s in proportion to the threads; bandwidth as
    measured (an upper bound for fewer threads, so MBU is, if anything, understated)."""
    return dataclasses.replace(
        profile,
        name=cpu_name(threads),
        peak_flops={k: v * threads / measured for k, v in profile.peak_flops.items()},
        source=f"measured with {measured} threads, FLOP/s scaled to {threads}",
    )


def read_cache(path: Path) -> list[HardwareProfile]:
    """The profiles in a cache file (one per thread count); [] if it is missing or unreadable."""
    if not path.is_file():
        return []
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        items = data["profiles"] if isinstance(data, dict) and "profiles" in data else [data]
        return [HardwareProfile.from_json(json.dumps(item)) for item in items]
    except (ValueError, TypeError, KeyError):
        return []  # a new measurement replaces it


def write_cache(path: Path, profile: HardwareProfile) -> Path:
    """Add (or replace) `profile` in the cache file, next to those of other thread counts."""
    kept = [p for p in read_cache(path) if p.name != profile.name]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    items = [dataclasses.asdict(p) for p in [*kept, profile]]
    tmp.write_text(json.dumps({"profiles": items}, indent=2) + "\n", encoding="utf-8")
    tmp.replace(path)  # atomic: a concurrent reader never sees half a file
    return path


def load_hardware_profile(
    path: str | Path | None = None,
    device: str | torch.device = "cpu",
    *,
    force: bool = False,
    seconds: float = 10.0,
) -> HardwareProfile:
    """The profile of `device`: `cached_hardware_profile`, else a CPU measurement (about
    `seconds`) saved where `profile_path(path)` points. `force` re-measures the CPU."""
    if not (force and torch.device(device).type == "cpu"):
        profile = cached_hardware_profile(path, device)
        if profile is not None and "scaled" not in profile.source:
            return profile
    profile = measure_cpu_profile(seconds=seconds)
    if path or os.environ.get(ENV_VAR):
        profile.save(profile_path(path))  # a named file holds one profile, as given
    else:
        write_cache(profile_path(None), profile)
    return profile
