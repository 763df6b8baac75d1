"""Build a C kernel for this machine once, cache it, and load it.

The source is compiled with the system's C compiler for the CPU it runs on (`-march=native`)
into a cache folder private to the user (`$XDG_CACHE_HOME/pdserve/kernels`, mode 0700), under a
name that hashes the source, the flags, the compiler and the CPU's feature flags: a different
machine or a changed source builds afresh, the same one loads in milliseconds. The library is
written under a temporary name and renamed into place, so workers building at once never load a
half-written file. OpenMP comes from the runtime torch already loaded (the same soname), so the
kernels share torch's threads and `torch.set_num_threads`.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import subprocess
import tempfile
from pathlib import Path

import torch  # noqa: F401  (loads torch's OpenMP runtime before any kernel library)

FLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-shared", "-fPIC")


class KernelUnavailable(RuntimeError):
    """The kernel could not be built or loaded here (no compiler, a failed build)."""


def cache_dir() -> Path:
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    path = root / "pdserve" / "kernels"
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    return path


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.machine()


def _compiler() -> str:
    return os.environ.get("CC", "cc")


def build(source: Path) -> Path:
    """The shared library built from `source` for this machine (built now if not cached)."""
    try:
        return _build(source)
    except OSError as e:  # an unwritable cache folder, a full disk
        raise KernelUnavailable(f"building {source.name} failed: {e}") from e


def _build(source: Path) -> Path:
    cc = _compiler()
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise KernelUnavailable(f"no C compiler ({cc}): {e}") from e
    key = hashlib.sha256()
    for part in (source.read_bytes(), " ".join(FLAGS).encode(), version.stdout.encode(),
                 _cpu_flags().encode()):  # fmt: skip
        key.update(part)
    out = cache_dir() / f"{source.stem}-{key.hexdigest()[:16]}.so"
    if out.exists():
        return out
    fd, tmp = tempfile.mkstemp(dir=out.parent, suffix=".so.tmp")
    os.close(fd)
    try:
        done = subprocess.run([cc, *FLAGS, "-o", tmp, str(source)], capture_output=True,
                              text=True, timeout=300)  # fmt: skip
        if done.returncode != 0:
            raise KernelUnavailable(f"building {source.name} failed:\n{done.stderr.strip()}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def load(source: Path) -> ctypes.CDLL:
    """Build (if needed) and load the kernel library of `source`."""
    path = build(source)
    try:
        return ctypes.CDLL(str(path))
    except OSError as e:
        raise KernelUnavailable(f"loading {path} failed: {e}") from e
