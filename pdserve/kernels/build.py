"""Build the native kernels for this machine once, cache them, and load them.

Every C source of this folder is compiled with the system's C compiler for the CPU it runs on
(`-march=native`) into one library, in a cache folder private to the user
(`$XDG_CACHE_HOME/pdserve/kernels`, mode 0700), under a name that hashes the sources and headers,
the flags, the compiler and the CPU's feature flags: a different machine or a changed source
builds afresh, the same one loads in milliseconds. The library is
written under a temporary name and renamed into place, so workers building at once never load a
half-written file. OpenMP comes from the runtime torch already loaded (the same soname), so the
kernels share torch's threads and `torch.set_num_threads`.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch  # noqa: F401  (loads torch's OpenMP runtime before any kernel library)

FLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-shared", "-fPIC")
FOLDER = Path(__file__).parent
SOURCES = tuple(sorted(FOLDER.glob("*.c")))
HEADERS = tuple(sorted(FOLDER.glob("*.h")))


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


def compiler_present() -> bool:
    """Whether this machine has the C compiler the kernels build with (`$CC`, else `cc`): where
    it has one, a failed build is a bug, not a missing feature (the tests rely on this)."""
    return shutil.which(_compiler()) is not None


def build(sources: tuple[Path, ...] = SOURCES, extra_flags: tuple[str, ...] = ()) -> Path:
    """The shared library built from `sources` for this machine (built now if not cached);
    `extra_flags` go after the usual ones (the tests build the portable paths with
    `-mno-avx512vnni`)."""
    try:
        return _build(sources, (*FLAGS, *extra_flags))
    except OSError as e:  # an unwritable cache folder, a full disk
        raise KernelUnavailable(f"building the native kernels failed: {e}") from e


def _build(sources: tuple[Path, ...], flags: tuple[str, ...]) -> Path:
    cc = _compiler()
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise KernelUnavailable(f"no C compiler ({cc}): {e}") from e
    key = hashlib.sha256()
    for path in (*sources, *HEADERS):
        key.update(path.name.encode() + b"\0" + path.read_bytes())
    for part in (" ".join(flags), version.stdout, _cpu_flags()):
        key.update(part.encode())
    out = cache_dir() / f"pdserve_cpu-{key.hexdigest()[:16]}.so"
    if out.exists():
        return out
    fd, tmp = tempfile.mkstemp(dir=out.parent, suffix=".so.tmp")
    os.close(fd)
    try:
        done = subprocess.run([cc, *flags, "-o", tmp, *map(str, sources), "-lm"],
                              capture_output=True, text=True, timeout=300)  # fmt: skip
        if done.returncode != 0:
            raise KernelUnavailable(f"building the native kernels failed:\n{done.stderr.strip()}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


@functools.cache
def library() -> ctypes.CDLL:
    """The native kernels' library, built (if needed) and loaded once per process."""
    path = build()
    try:
        return ctypes.CDLL(str(path))
    except OSError as e:
        raise KernelUnavailable(f"loading {path} failed: {e}") from e


def available() -> tuple[bool, str]:
    """(whether the native kernels load here, the reason when they do not)."""
    try:
        library()
    except KernelUnavailable as e:
        return False, str(e)
    return True, ""
