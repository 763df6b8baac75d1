"""Memory read speed as a kernel sees it: the Python side of `cpu_memory.c`."""

from __future__ import annotations

import ctypes
import functools

import torch

from pdserve.kernels.build import available as available  # re-exported
from pdserve.kernels.build import library


@functools.cache
def _lib() -> ctypes.CDLL:
    lib = library()
    lib.pd_read_sum.argtypes = [ctypes.c_void_p, ctypes.c_int64]
    lib.pd_read_sum.restype = ctypes.c_float
    return lib


def read_sum(x: torch.Tensor) -> float:
    """The sum of a contiguous float32 CPU tensor, streamed by torch's threads."""
    if x.dtype != torch.float32 or x.device.type != "cpu" or not x.is_contiguous():
        raise ValueError(f"read_sum: expected a contiguous float32 CPU tensor, got {x.dtype}")
    return _lib().pd_read_sum(x.data_ptr(), x.numel())


@functools.cache
def _warm_lib() -> ctypes.CDLL:
    lib = library()
    lib.pd_warm_start.argtypes = [ctypes.POINTER(ctypes.c_void_p),
                                  ctypes.POINTER(ctypes.c_int64), ctypes.c_int64]  # fmt: skip
    lib.pd_warm_start.restype = ctypes.c_int
    lib.pd_warm_join.argtypes = []
    lib.pd_warm_join.restype = None
    return lib


class ReadAhead:
    """Reads the first `budget` bytes of `buffers` ((address, bytes) each, in the order the next
    step uses them) into the caches on a native thread of its own, started by `start()` (which
    returns at once). Whoever made it keeps the buffers alive."""

    MAX_BUFFERS = 64  # as cpu_memory.c

    def __init__(self, buffers: list[tuple[int, int]], budget: int) -> None:
        parts = []
        for address, size in buffers:
            if budget <= 0 or len(parts) == self.MAX_BUFFERS:
                break
            parts.append((address, min(size, budget)))
            budget -= size
        self.num_bytes = sum(n for _, n in parts)
        self._ptrs = (ctypes.c_void_p * len(parts))(*(a for a, _ in parts))
        self._sizes = (ctypes.c_int64 * len(parts))(*(n for _, n in parts))
        self._count = len(parts)

    def start(self) -> None:
        if self._count and _warm_lib().pd_warm_start(self._ptrs, self._sizes, self._count) != 0:
            raise MemoryError("read-ahead: no thread could be started")

    @staticmethod
    def join() -> None:
        _warm_lib().pd_warm_join()

    def __del__(self) -> None:  # before the buffers it reads can go (their owner's finalizer)
        if self._count:
            self.join()
