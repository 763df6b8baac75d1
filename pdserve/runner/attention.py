"""Attention over the paged KV cache, in pure torch (runs anywhere; SDPA does the math).

A step's tokens are laid out decodes first (one query token each), then one contiguous run of
query tokens per prefill chunk. Every layer first writes the step's new keys and values into the
cache (`slot_mapping`), then attends: decodes in one batched call over their gathered context,
each prefill chunk in one call over its context (its own new tokens when it has no earlier ones).
Because all writes come before any read, a request may attend to blocks that another request of
the same step is filling (prefix sharing between the `n` completions of a prompt).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class PrefillChunk:
    q_start: int  # index of the chunk's first token in the step's token layout
    q_end: int
    ctx_slots: torch.Tensor | None  # [ctx_len] slots of all keys it attends to; None: only its own
    mask: torch.Tensor | None  # [q_len, ctx_len] bool, True = attend (causal with an offset)


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] long: flat cache slot of each new token
    num_decodes: int = 0  # the first num_decodes tokens are single-token queries
    decode_slots: torch.Tensor | None = None  # [num_decodes, max_ctx] long (padded)
    decode_mask: torch.Tensor | None = None  # [num_decodes, 1, 1, max_ctx] bool
    prefills: list[PrefillChunk] = field(default_factory=list)


def paged_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    kv_cache: torch.Tensor,  # [2, num_slots, Hkv, D]
    meta: AttentionMetadata,
) -> torch.Tensor:  # [T, Hq * D]
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    k_cache.index_copy_(0, meta.slot_mapping, k)
    v_cache.index_copy_(0, meta.slot_mapping, v)

    out = torch.empty(num_tokens, num_heads, head_dim, dtype=q.dtype, device=q.device)
    nd = meta.num_decodes
    if nd:
        # Group the query heads that share a KV head: [nd, Hkv, G, D] against [nd, Hkv, L, D].
        qd = q[:nd].view(nd, num_kv_heads, num_heads // num_kv_heads, head_dim)
        kd = k_cache[meta.decode_slots].transpose(1, 2)  # [nd, L, Hkv, D] -> [nd, Hkv, L, D]
        vd = v_cache[meta.decode_slots].transpose(1, 2)
        od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.decode_mask)
        out[:nd] = od.reshape(nd, num_heads, head_dim)
    for chunk in meta.prefills:
        qp = q[chunk.q_start : chunk.q_end].transpose(0, 1).unsqueeze(0)  # [1, Hq, Lq, D]
        if chunk.ctx_slots is None:
            kp, vp = k[chunk.q_start : chunk.q_end], v[chunk.q_start : chunk.q_end]
        else:
            kp, vp = k_cache[chunk.ctx_slots], v_cache[chunk.ctx_slots]  # [Lk, Hkv, D]
        kp = kp.transpose(0, 1).unsqueeze(0)  # [1, Hkv, Lk, D]
        vp = vp.transpose(0, 1).unsqueeze(0)
        op = F.scaled_dot_product_attention(
            qp,
            kp,
            vp,
            attn_mask=chunk.mask,
            is_causal=chunk.mask is None,
            enable_gqa=num_heads != num_kv_heads,
        )  # [1, Hq, Lq, D]
        out[chunk.q_start : chunk.q_end] = op[0].transpose(0, 1)
    return out.view(num_tokens, num_heads * head_dim)
