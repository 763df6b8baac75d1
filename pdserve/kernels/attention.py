"""Attention over the paged KV cache, in place: the Python side of `cpu_attention.c`.

`decode_attention(q, k_cache, v_cache, slots, lens)` is what `F.scaled_dot_product_attention`
computes over each sequence's gathered context (the default scale 1 / sqrt(head_dim), no other
mask than the context length), without the gather. `prefill_attention(q, k_cache, v_cache,
chunks, slots, out)` is causal SDPA for every prefill chunk of a step in one call, its keys and
values read from the cache. The native kernel is built on first use (`build.py`); `available()`
says whether it could be, and why not.
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
    fn = lib.pd_prefill_attention
    fn.argtypes = [_P, _I, _I, _P, _I, _P, _I, _I, _I, _I, _P, _P, _I, ctypes.c_int,
                   ctypes.c_float, _P, _I]  # fmt: skip
    fn.restype = ctypes.c_int
    return lib


def _cache_ok(k_cache: torch.Tensor, v_cache: torch.Tensor, d: int) -> bool:
    int8 = k_cache.dtype == torch.int8
    return (
        k_cache.dtype == v_cache.dtype
        and k_cache.dtype in (torch.float32, torch.int8)
        and k_cache.shape == v_cache.shape
        and k_cache.shape[2] == d + (4 if int8 else 0)
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
    )


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
        and _cache_ok(k_cache, v_cache, d)
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


def prefill_attention(
    q: torch.Tensor,  # [T, Hq, D] float32, each head's D values contiguous
    k_cache: torch.Tensor,  # [slots, Hkv, W], as in decode_attention
    v_cache: torch.Tensor,
    chunks: torch.Tensor,  # [n, 4] int64: (first query row, query rows, context length, offset)
    slots: torch.Tensor,  # [sum of context lengths] int64: each chunk's context slots in order
    out: torch.Tensor,  # [T, Hq * D] float32: the chunks' rows are written
) -> None:
    """Causal attention of each chunk's query rows (the last of its context's positions) over
    its whole context, read from the cache where the step's own keys and values are already
    written; what `F.scaled_dot_product_attention` gives with the default scale and the causal
    mask offset to the chunk's position."""
    t, hq, d = q.shape
    hkv = k_cache.shape[1]
    ok = (
        q.dtype == out.dtype == torch.float32
        and q.device.type == "cpu"
        and q.stride(2) == 1
        and q.stride(1) == d
        and _cache_ok(k_cache, v_cache, d)
        and chunks.dtype == slots.dtype == torch.int64
        and chunks.is_contiguous()
        and slots.is_contiguous()
        and chunks.dim() == 2
        and chunks.shape[1] == 4
        and out.is_contiguous()
        and out.shape == (t, hq * d)
        and hq % hkv == 0
    )
    if not ok:
        raise ValueError(
            f"prefill_attention: unsupported inputs q {q.dtype} {tuple(q.shape)}, cache "
            f"{k_cache.dtype} {tuple(k_cache.shape)}, chunks {tuple(chunks.shape)}"
        )
    rc = _lib().pd_prefill_attention(
        q.data_ptr(), q.stride(0), t, chunks.data_ptr(), len(chunks), slots.data_ptr(),
        len(slots), hq, hkv, d, k_cache.data_ptr(), v_cache.data_ptr(), k_cache.shape[0],
        int(k_cache.dtype == torch.int8), 1.0 / math.sqrt(d), out.data_ptr(), hq * d,
    )  # fmt: skip
    if rc == -1:
        raise MemoryError("prefill_attention: no memory for its buffers")
    if rc != 0:
        raise ValueError(f"prefill_attention: a chunk or slot out of range (rc {rc})")
