"""Where torch's OpenMP threads run: the Python side of `cpu_threads.c`."""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence

from pdserve.kernels.build import available as available  # re-exported
from pdserve.kernels.build import library


@functools.cache
def _lib() -> ctypes.CDLL:
    lib = library()
    lib.pd_bind_threads.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int]
    lib.pd_bind_threads.restype = ctypes.c_int
    lib.pd_thread_cpus.argtypes = [ctypes.POINTER(ctypes.c_int)] * 2 + [ctypes.c_int]
    lib.pd_thread_cpus.restype = ctypes.c_int
    return lib


def bind_threads(cpus: Sequence[int]) -> int:
    """Put thread i (i >= 1) of the next `len(cpus)`-wide parallel region, and of every later
    one as wide, on `cpus[i]` alone; the calling thread (thread 0) keeps its CPUs. Returns how
    many threads could not be bound, or -1 when torch's thread count is not `len(cpus)`."""
    ids = (ctypes.c_int * len(cpus))(*cpus)
    return _lib().pd_bind_threads(ids, len(cpus))


def thread_cpus(n: int) -> list[tuple[int, int]]:
    """For each thread of a parallel region as wide as torch's thread count (at most `n`): the
    CPU it ran on and how many CPUs it may run on."""
    cpu, allowed = (ctypes.c_int * n)(), (ctypes.c_int * n)()
    width = _lib().pd_thread_cpus(cpu, allowed, n)
    return [(cpu[i], allowed[i]) for i in range(min(width, n))]
