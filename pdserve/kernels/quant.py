"""Weight-only quantized matrix products on the CPU: the Python side of `cpu_quant.c`.

`int8_linear(x, q, scale, n)` and `int4_linear(x, q, scale, n, k, group_size)` compute
`x @ dequantize(weights).T` for float32 `x` of any leading shape, with the weights in the panel
layout of `cpu_quant.c` (`pdserve.models.quant_linear` makes it). The native kernel is built on
first use (`build.py`); `available()` says whether it could be, and why not.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from pdserve.kernels.build import KernelUnavailable, load

SOURCE = Path(__file__).with_name("cpu_quant.c")
_P, _I = ctypes.c_void_p, ctypes.c_int64


@functools.cache
def _lib() -> ctypes.CDLL:
    lib = load(SOURCE)
    lib.pd_int8_linear.argtypes = [_P, _I, _I, _P, _P, _I, _P]
    lib.pd_int4_linear.argtypes = [_P, _I, _I, _P, _P, _I, _I, _P]
    lib.pd_int8_linear.restype = lib.pd_int4_linear.restype = ctypes.c_int
    return lib


def available() -> tuple[bool, str]:
    """(whether the native kernels load here, the reason when they do not)."""
    try:
        _lib()
    except KernelUnavailable as e:
        return False, str(e)
    return True, ""


def _rows(x: torch.Tensor, k: int) -> torch.Tensor:
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.shape[-1] != k:
        raise ValueError(
            f"expected float32 CPU activations [..., {k}], got {x.dtype} {tuple(x.shape)}"
        )
    return x.reshape(-1, k).contiguous()


def int8_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, n: int) -> torch.Tensor:
    """x[..., K] @ W.T for the int8 panels q[Np / 16, K, 16] and scales[Np] of W[n, K]."""
    k = q.shape[1]
    rows = _rows(x, k)
    y = torch.empty(rows.shape[0], n, dtype=torch.float32)
    rc = _lib().pd_int8_linear(rows.data_ptr(), rows.shape[0], k, q.data_ptr(), scale.data_ptr(),
                               n, y.data_ptr())  # fmt: skip
    if rc != 0:
        raise MemoryError("int8_linear: no memory for its buffers")
    return y.view(*x.shape[:-1], n)


def int4_linear(
    x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, n: int, k: int, group_size: int
) -> torch.Tensor:
    """x[..., k] @ W.T for the int4 panels q[Np / 16, Kp / 2, 16] and scales[Np / 16, groups,
    16] of W[n, k]."""
    rows = _rows(x, k)
    y = torch.empty(rows.shape[0], n, dtype=torch.float32)
    rc = _lib().pd_int4_linear(rows.data_ptr(), rows.shape[0], k, q.data_ptr(), scale.data_ptr(),
                               n, group_size, y.data_ptr())  # fmt: skip
    if rc == -2:
        raise ValueError(f"int4_linear: group size {group_size} is not a multiple of 32 up to 512")
    if rc != 0:
        raise MemoryError("int4_linear: no memory for its buffers")
    return y.view(*x.shape[:-1], n)
