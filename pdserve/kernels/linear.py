"""Matrix products on the CPU with weights in panels: the Python side of `cpu_linear.c` and
`cpu_quant.c`.

`f32_linear(x, w, bias, n)` computes `x @ W.T + bias` for float32 weights, `int8_linear(x, q,
scale, n, k)` and `int4_linear(x, q, scale, n, k, group_size)` compute
`quantize_activations(x) @ dequantize(weights).T`, all for float32 `x` of any leading shape, with
the weights in the panel layouts of those files (`pdserve.models.packed_linear.to_blocks` and
`pdserve.models.quant_linear` make them). The native kernel is built on first use (`build.py`); `available()` says whether it could
be, and why not.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from pdserve.kernels.build import available as available  # re-exported
from pdserve.kernels.build import library

_P, _I = ctypes.c_void_p, ctypes.c_int64


@functools.cache
def _lib() -> ctypes.CDLL:
    lib = library()
    lib.pd_f32_linear.argtypes = [_P, _I, _I, _P, _P, _I, _P]
    lib.pd_int8_linear.argtypes = [_P, _I, _I, _P, _P, _I, _P]
    lib.pd_int4_linear.argtypes = [_P, _I, _I, _P, _P, _I, _I, _P]
    lib.pd_vnni.argtypes = []
    for fn in (lib.pd_f32_linear, lib.pd_int8_linear, lib.pd_int4_linear, lib.pd_vnni):
        fn.restype = ctypes.c_int
    return lib


def vnni() -> bool:
    """Whether the quantized products run on AVX-512 VNNI dot products here (else the same
    integer arithmetic in portable vector code)."""
    return bool(_lib().pd_vnni())


def _rows(x: torch.Tensor, k: int) -> torch.Tensor:
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.shape[-1] != k:
        raise ValueError(
            f"expected float32 CPU activations [..., {k}], got {x.dtype} {tuple(x.shape)}"
        )
    return x.reshape(-1, k).contiguous()


def f32_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, n: int) -> torch.Tensor:
    """x[..., K] @ W.T + bias for the float32 blocks w[Np / 64, K, 4, 16] of W[n, K]
    (`pdserve.models.packed_linear.to_blocks`; and a bias padded to Np, or None)."""
    k = w.shape[1]
    rows = _rows(x, k)
    y = torch.empty(rows.shape[0], n, dtype=torch.float32)
    b = 0 if bias is None else bias.data_ptr()
    rc = _lib().pd_f32_linear(rows.data_ptr(), rows.shape[0], k, w.data_ptr(), b, n, y.data_ptr())
    if rc != 0:
        raise MemoryError("f32_linear: no memory for its buffers")
    return y.view(*x.shape[:-1], n)


def int8_linear(
    x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, n: int, k: int
) -> torch.Tensor:
    """x[..., k] @ W.T for the int8 panels q[Np / 16, Kp / 4, 16, 4] and scales[Np] of W[n, k]."""
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
    """x[..., k] @ W.T for the int4 panels q[Np / 64, Kp / 8, 4, 16, 4] and the scales and
    minima [Np / 64, groups, 2, 4, 16] (float16) of W[n, k]."""
    rows = _rows(x, k)
    y = torch.empty(rows.shape[0], n, dtype=torch.float32)
    rc = _lib().pd_int4_linear(rows.data_ptr(), rows.shape[0], k, q.data_ptr(), scale.data_ptr(),
                               n, group_size, y.data_ptr())  # fmt: skip
    if rc == -2:
        raise ValueError(f"int4_linear: group size {group_size} is not a multiple of 32 up to 512")
    if rc != 0:
        raise MemoryError("int4_linear: no memory for its buffers")
    return y.view(*x.shape[:-1], n)
