"""Attention over the paged KV cache: the step's metadata, the backend seam, the default backend.

The model owns the question "how does a layer attend" so that the runner only describes the step
(`AttentionMetadata`) and a faster implementation (a native kernel, a compiled one) is a new
`AttentionBackend` handed to the model, not an edit to the layers.

A step's tokens are laid out decodes first (one query token each), then one contiguous run of
query tokens per prefill chunk. Every layer first writes the step's new keys and values into the
cache (`slot_mapping`), then attends: decodes in one batched call over their gathered context,
each prefill chunk in one call over its context (its own new tokens when it has no earlier ones).
Because all writes come before any read, a request may attend to blocks that another request of
the same step is filling (prefix sharing between the `n` completions of a prompt).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F

from pdserve.kernels import attention as native_kernel
from pdserve.models import kv_quant

ATTENTION_BACKENDS = ("auto", "native", "sdpa")


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
    decode_lens: torch.Tensor | None = None  # [num_decodes] long: each decode's context length
    prefills: list[PrefillChunk] = field(default_factory=list)
    # what a backend derives from this metadata once per step, for all layers to share
    derived: dict = field(default_factory=dict)


class AttentionBackend(Protocol):
    """What a decoder layer calls once per step: store the step's new K/V in this layer's cache
    and return the attention output of every query token. Rotary embedding is already applied."""

    name: str  # for logs and benchmark labels

    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        kv_cache: torch.Tensor,  # [2, num_slots, Hkv, D] (int8: D + 4), this layer's
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, Hq * D]
        ...


class PagedSDPABackend:
    """Pure torch (runs anywhere): gathers each request's context from the cache and lets SDPA do
    the math, so CUDA gets whatever fused kernel torch picks. `decode` and `prefill` are separate
    methods so a variant can replace one half (benchmarks/engine_whatif.py does)."""

    name = "paged_sdpa"

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens, num_heads, head_dim = q.shape
        kv_quant.store(kv_cache[0], meta.slot_mapping, k)
        kv_quant.store(kv_cache[1], meta.slot_mapping, v)
        out = torch.empty(num_tokens, num_heads, head_dim, dtype=q.dtype, device=q.device)
        nd = meta.num_decodes
        if nd:
            out[:nd] = self.decode(q[:nd], kv_cache, meta)
        out = out.view(num_tokens, num_heads * head_dim)
        if meta.prefills:
            self.prefill_all(q, k, v, kv_cache, meta, out)
        return out

    def prefill_all(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        out: torch.Tensor,  # [T, Hq * D]: the chunks' rows are written
    ) -> None:
        hd = q.shape[1] * q.shape[2]
        for chunk in meta.prefills:
            o = self.prefill(q, k, v, kv_cache, chunk)
            out[chunk.q_start : chunk.q_end] = o.reshape(-1, hd)

    def decode(
        self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:  # [nd, Hq, D] queries -> [nd, Hq, D]
        nd, num_heads, head_dim = q.shape
        num_kv_heads = kv_cache.shape[2]
        # Group the query heads that share a KV head: [nd, Hkv, G, D] against [nd, Hkv, L, D].
        qd = q.view(nd, num_kv_heads, num_heads // num_kv_heads, head_dim)
        # [nd, L, Hkv, D] -> [nd, Hkv, L, D]
        kd = kv_quant.load(kv_cache[0], meta.decode_slots, q.dtype).transpose(1, 2)
        vd = kv_quant.load(kv_cache[1], meta.decode_slots, q.dtype).transpose(1, 2)
        od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.decode_mask)
        return od.reshape(nd, num_heads, head_dim)

    def prefill(
        self,
        q: torch.Tensor,  # the whole step's, as in `forward`
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        chunk: PrefillChunk,
    ) -> torch.Tensor:  # [Lq, Hq, D] for the chunk's queries
        qp = q[chunk.q_start : chunk.q_end].transpose(0, 1).unsqueeze(0)  # [1, Hq, Lq, D]
        if chunk.ctx_slots is None:  # its own tokens, as the cache holds them
            kp = kv_quant.round_trip(k[chunk.q_start : chunk.q_end], kv_cache)
            vp = kv_quant.round_trip(v[chunk.q_start : chunk.q_end], kv_cache)
        else:  # [Lk, Hkv, D]
            kp = kv_quant.load(kv_cache[0], chunk.ctx_slots, q.dtype)
            vp = kv_quant.load(kv_cache[1], chunk.ctx_slots, q.dtype)
        kp = kp.transpose(0, 1).unsqueeze(0)  # [1, Hkv, Lk, D]
        vp = vp.transpose(0, 1).unsqueeze(0)
        op = F.scaled_dot_product_attention(
            qp,
            kp,
            vp,
            attn_mask=chunk.mask,
            is_causal=chunk.mask is None,
            enable_gqa=q.shape[1] != k.shape[1],
        )  # [1, Hq, Lq, D]
        return op[0].transpose(0, 1)


class NativeBackend(PagedSDPABackend):
    """pdserve's CPU kernels (`pdserve/kernels/cpu_attention.c`), which read each context's rows
    in the paged cache where they lie, float32 or int8, with no gathered copy and no padding:
    decodes in one call per layer, and every prefill chunk of the step in one call per layer
    (on the matrix products' register tile; SDPA ran the 2,048-token steps of
    `benchmarks/prefill_bench.py` at a third of it)."""

    name = "native"

    def decode(
        self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        return native_kernel.decode_attention(
            q, kv_cache[0], kv_cache[1], meta.decode_slots, meta.decode_lens
        )

    def prefill_all(self, q, k, v, kv_cache, meta, out) -> None:
        chunks, slots = meta.derived.get("native_prefill") or _chunk_table(meta)
        meta.derived["native_prefill"] = (chunks, slots)
        native_kernel.prefill_attention(q, kv_cache[0], kv_cache[1], chunks, slots, out)


def _chunk_table(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's prefill chunks as `prefill_attention` takes them: rows of (first query row,
    query rows, context length, offset of its slots), and every chunk's context slots in one
    tensor (a chunk with no earlier context: its own new tokens' slots)."""
    rows, parts, offset = [], [], 0
    for c in meta.prefills:
        ctx = meta.slot_mapping[c.q_start : c.q_end] if c.ctx_slots is None else c.ctx_slots
        rows.append((c.q_start, c.q_end - c.q_start, len(ctx), offset))
        parts.append(ctx)
        offset += len(ctx)
    return torch.tensor(rows, dtype=torch.int64), torch.cat(parts).contiguous()


def make_backend(name: str, device: torch.device, dtype: torch.dtype) -> AttentionBackend:
    """The backend `name` ("sdpa", "native", or "auto": native where it runs) for a model on
    `device` computing in `dtype`; ValueError where "native" cannot run."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"invalid attention_backend={name!r}: choose one of {ATTENTION_BACKENDS}")
    if name == "sdpa":
        return PagedSDPABackend()
    why = ""
    if device.type != "cpu" or dtype != torch.float32:
        why = f"it needs a CPU and float32 (device={device}, dtype={dtype})"
    else:
        ok, why = native_kernel.available()
    if not why:
        return NativeBackend()
    if name == "native":
        raise ValueError(f"invalid attention_backend='native': {why}")
    return PagedSDPABackend()
