"""A decoder layer's per-token operations over many rows: the Python side of `cpu_layer.c`.

`rms_norm(x, weight, eps)`, `rope_(x, heads, cos, sin)` (in place) and `silu_mul(gate_up)` compute
what `F.rms_norm`, the rotate-half rotary embedding and `F.silu(gate) * up` compute, for float32
rows on the CPU, each in one pass over the rows on torch's threads. The model's layers use them
where the native kernels run (`pdserve.models.llama.use_native_ops`).
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
    lib.pd_rms_norm.argtypes = [_P, _I, _I, _P, ctypes.c_float, _P]
    lib.pd_rope.argtypes = [_P, _I, _I, _I, _I, _P, _P]
    lib.pd_silu_mul.argtypes = [_P, _I, _I, _P]
    for fn in (lib.pd_rms_norm, lib.pd_rope, lib.pd_silu_mul):
        fn.restype = ctypes.c_int
    return lib


def _check(ok: bool, what: str, *tensors: torch.Tensor) -> None:
    if not ok:
        shapes = ", ".join(f"{t.dtype} {tuple(t.shape)}" for t in tensors)
        raise ValueError(f"{what}: unsupported inputs {shapes}")


def _float_cpu(*tensors: torch.Tensor) -> bool:
    return all(t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x[..., n] / sqrt(mean(x^2) + eps) * weight[n]."""
    n = weight.shape[0]
    _check(_float_cpu(x, weight) and x.shape[-1] == n and weight.is_contiguous(), "rms_norm",
           x, weight)  # fmt: skip
    rows = x.reshape(-1, n).contiguous()
    out = torch.empty_like(rows)
    _lib().pd_rms_norm(rows.data_ptr(), rows.shape[0], n, weight.data_ptr(), eps, out.data_ptr())
    return out.view(x.shape)


def rope_(x: torch.Tensor, heads: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate the first `heads` heads of each row of x[T, >= heads, D] in place (rotate-half
    pairs (i, i + D/2)) by row t's angles cos[t], sin[t] ([T, D/2], or [T, 1, D/2])."""
    t, _, d = x.shape
    cos, sin = cos.reshape(t, -1), sin.reshape(t, -1)
    _check(
        _float_cpu(x, cos, sin)
        and heads <= x.shape[1]
        and d % 2 == 0
        and x.stride(2) == 1
        and x.stride(1) == d
        and cos.shape == sin.shape == (t, d // 2)
        and cos.is_contiguous()
        and sin.is_contiguous(),
        "rope_", x, cos,
    )  # fmt: skip
    _lib().pd_rope(x.data_ptr(), t, x.stride(0), heads, d, cos.data_ptr(), sin.data_ptr())


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up[..., 2n] = [gate | up] -> [..., n]."""
    _check(_float_cpu(gate_up) and gate_up.shape[-1] % 2 == 0, "silu_mul", gate_up)
    n = gate_up.shape[-1] // 2
    rows = gate_up.reshape(-1, 2 * n).contiguous()
    out = torch.empty(rows.shape[0], n, dtype=torch.float32)
    _lib().pd_silu_mul(rows.data_ptr(), rows.shape[0], n, out.data_ptr())
    return out.view(*gate_up.shape[:-1], n)
