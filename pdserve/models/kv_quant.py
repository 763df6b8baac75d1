"""The int8 KV cache (`--kv-cache-dtype int8`): one scale per token and KV head.

A cache row (one token, one KV head) holds the head's `head_dim` values as int8 followed by
their float32 scale in 4 more bytes, so the cache stays one int8 tensor per layer,
`[2, slots, kv_heads, head_dim + 4]`: the block manager, the prefix cache and the KV transfer of
disaggregation (which copies whole rows) handle it unchanged, and a transferred block carries
its scales. Per token 2 * kv_heads * (head_dim + 4) bytes per layer: for head_dim 64, 0.27 of
float32's and 0.53 of bfloat16's.
"""

from __future__ import annotations

import torch

from pdserve.kv.rows import SCALE_BYTES

KV_CACHE_DTYPES = ("auto", "int8")


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """[..., D] float -> [..., D + 4] int8 rows: values / scale rounded, then the scale's bytes."""
    scale = (x.abs().amax(dim=-1, keepdim=True).float() / 127.0).clamp(
        min=torch.finfo(torch.float32).tiny
    )
    q = torch.round(x.float() / scale).clamp(-127, 127).to(torch.int8)
    return torch.cat([q, scale.view(torch.int8)], dim=-1)


def dequantize_rows(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., D + 4] int8 rows -> [..., D] values in `dtype`."""
    d = rows.shape[-1] - SCALE_BYTES
    scale = rows[..., d:].contiguous().view(torch.float32)
    return (rows[..., :d].to(torch.float32) * scale).to(dtype)


def store(cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> None:
    """Write x [T, H, D] at `slots` of one half (K or V) of a layer's cache [slots, H, W]."""
    cache.index_copy_(0, slots, quantize_rows(x) if cache.dtype == torch.int8 else x)


def load(cache: torch.Tensor, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The cache rows at `index` (any shape of slots) as values in `dtype`: [*index, H, D]."""
    rows = cache[index]
    return dequantize_rows(rows, dtype) if cache.dtype == torch.int8 else rows


def round_trip(x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """x as the cache would give it back (quantized and dequantized for an int8 cache), for the
    tokens a step attends to before reading them from the cache."""
    return dequantize_rows(quantize_rows(x), x.dtype) if cache.dtype == torch.int8 else x
