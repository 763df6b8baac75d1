"""Decode attention over the paged KV cache, in place: the Python side of `cpu_attention.c`.

`decode_attention(q, k_cache, v_cache, slots, lens)` is what `F.scaled_dot_product_attention`
computes over each sequence's gathered context (the default scale 1 / sqrt(head_dim), no other
mask than the context length), without the gather. The native kernel is built on first use
(`build.py`); `available()` says whether it could be, and why not.
"""

from __future__ import annotations

import ctypes
import functools
import math

import torch

from pdserve.kernels.build import available as available  # re-exported
from pdserve.kernels.build import library

_P, _I = ctypes.c_void_p, ctypes.c_int64


@functools.cache
def _lib() -> ctypes.CDLL:
    lib = library()
    fn = lib.pd_decode_attention
    fn.argtypes = [_P, _I, _I, _I, _I, _I, _P, _P, ctypes.c_int, _P, _I, _P, ctypes.c_float, _P]
    fn.restype = ctypes.c_int
    return lib


def decode_attention(
    q: torch.Tensor,  # [nd, Hq, D] float32
    k_cache: torch.Tensor,  # [slots, Hkv, W]: float32 (W = D) or int8 rows (W = D + 4)
    v_cache: torch.Tensor,
    slots: torch.Tensor,  # [nd, >= max(lens)] int64: each sequence's context slots in order
    lens: torch.Tensor,  # [nd] int64: each sequence's context length (>= 1)
) -> torch.Tensor:  # [nd, Hq, D]
    nd, hq, d = q.shape
    hkv = k_cache.shape[1]
    int8 = k_cache.dtype == torch.int8
    ok = (
        q.dtype == torch.float32
        and q.device.type == "cpu"
        and k_cache.dtype == v_cache.dtype
        and k_cache.dtype in (torch.float32, torch.int8)
        and k_cache.shape == v_cache.shape
        and k_cache.shape[2] == d + (4 if int8 else 0)
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
        and slots.dtype == lens.dtype == torch.int64
        and slots.dim() == 2
        and slots.shape[0] == lens.shape[0] == nd
        and slots.stride(1) == 1
        and lens.is_contiguous()
        and hq % hkv == 0
    )
    if not ok:
        raise ValueError(
            f"decode_attention: unsupported inputs q {q.dtype} {tuple(q.shape)}, cache "
            f"{k_cache.dtype} {tuple(k_cache.shape)}, slots {tuple(slots.shape)}"
        )
    q = q.contiguous()
    out = torch.empty_like(q)
    rc = _lib().pd_decode_attention(
        q.data_ptr(), hq * d, nd, hq, hkv, d, k_cache.data_ptr(), v_cache.data_ptr(), int(int8),
        slots.data_ptr(), slots.stride(0), lens.data_ptr(), 1.0 / math.sqrt(d), out.data_ptr(),
    )  # fmt: skip
    if rc == -1:
        raise MemoryError("decode_attention: no memory for its score buffers")
    if rc != 0:
        raise ValueError(f"decode_attention: bad shape (rc {rc})")
    return out
