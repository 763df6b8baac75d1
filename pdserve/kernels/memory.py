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
