"""The width of a KV cache row (one token's values for one KV head), shared by the model's cache
and the KV transfer's layout: an int8 row ends in its float32 scale (models/kv_quant.py)."""

from __future__ import annotations

SCALE_BYTES = 4


def row_width(head_dim: int, quantized: bool) -> int:
    """Elements of one cache row."""
    return head_dim + SCALE_BYTES if quantized else head_dim
