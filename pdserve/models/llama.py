"""The Llama family: Llama, Qwen2 (q/k/v bias), Qwen3 (per-head q/k RMSNorm) and Mistral.

One flat token layout for the whole step ([num_tokens, hidden]). Attention over the paged KV cache
is the model's `AttentionBackend` (`pdserve.models.attention`), chosen when the model is built and
handed to every layer on each forward, as the rotary tables are. Projections that read the same
input are fused (q/k/v into `qkv_proj`, gate/up into `gate_up_proj`) so a decode step launches
fewer, larger GEMVs; the loader maps the checkpoint's separate tensors into the fused ones.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.config import ModelConfig
from pdserve.kernels import layer as native_ops
from pdserve.models.attention import AttentionBackend, AttentionMetadata, PagedSDPABackend
from pdserve.models.rope import RotaryEmbedding

if TYPE_CHECKING:
    from pdserve.models.fused_decode import HeadOutput


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.native = False  # pdserve's CPU kernel (`use_native_ops`)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.native:
            return native_ops.rms_norm(x, self.weight, self.eps)
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Half precision: normalise in float32 as the reference does, then scale.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        )
        qkv_out = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, qkv_out, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.reduce = None  # tensor parallel: sums o_proj's partial rows over the ranks
        self.native = False  # rotary embedding by pdserve's CPU kernel (`use_native_ops`)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        rope: RotaryEmbedding,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        t = x.shape[0]
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x).view(t, hq + 2 * hkv, d)  # [T, Hq + 2 Hkv, D]
        q, k, v = qkv.split([hq, hkv, hkv], dim=1)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
            q, k = rope.apply(torch.cat([q, k], dim=1), *cos_sin).split([hq, hkv], dim=1)
        elif self.native:  # q and k rotated where they lie, in the projection's output
            native_ops.rope_(qkv, hq + hkv, *cos_sin)
        else:  # q and k rotated in one pass
            q, k = rope.apply(qkv[:, : hq + hkv], *cos_sin).split([hq, hkv], dim=1)
        out = self.o_proj(backend.forward(q, k, v, kv_cache, meta))
        return out if self.reduce is None else self.reduce(out)


# Bytes of gate/up activations one CPU chunk of the MLP may produce. glibc's malloc maps a
# fresh zeroed region for every block over 32 MiB and hands it back on free, so an unchunked
# 2048-token prefill of llama-125m (a 48 MiB gate/up output per layer) page-faulted ~12,000
# times per layer, every step; chunks under this size are reused from the heap and stay nearer
# the caches (docs/PERFORMANCE.md, "Prefill without page faults").
MLP_CHUNK_BYTES = 16 << 20


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.reduce = None  # tensor parallel: sums down_proj's partial rows over the ranks
        # rows per chunk on the CPU, a multiple of 64, sized for float32 activations (a rank of
        # tensor parallelism has fewer columns, half precision fewer bytes: their chunks are
        # smaller than they need be, no more)
        row_bytes = 2 * cfg.intermediate_size * 4
        self.chunk_rows = max(64, MLP_CHUNK_BYTES // row_bytes // 64 * 64)
        self.native = False  # the activation by pdserve's CPU kernel (`use_native_ops`)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cpu" and x.shape[0] > self.chunk_rows:
            out = torch.cat([self._gated(c) for c in x.split(self.chunk_rows)])
        else:
            out = self._gated(x)
        return out if self.reduce is None else self.reduce(out)

    def _gated(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [T, 2I]: gate, then up
        if self.native:
            return self.down_proj(native_ops.silu_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate).mul_(up))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos_sin, kv_cache, meta, rope, backend):
        x = x + self.self_attn(self.input_layernorm(x), cos_sin, kv_cache, meta, rope, backend)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    """Also serves Qwen2, Qwen3 and Mistral: their differences are flags in `ModelConfig`.

    `attn_backend` (default `PagedSDPABackend`) is a plain attribute, not a submodule: it holds
    no weights, and replacing it between steps changes how every layer attends."""

    def __init__(self, cfg: ModelConfig, attn_backend: AttentionBackend | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.attn_backend = PagedSDPABackend() if attn_backend is None else attn_backend
        # An explicit `_weight` skips the random init, which on the meta device the loader
        # builds under goes through torch's reference ops and imports torch._dynamo: ~2 s
        # of every engine start for numbers the checkpoint overwrites.
        self.embed_tokens = nn.Embedding(
            cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(cfg.vocab_size, cfg.hidden_size)
        )
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = (
            None
            if cfg.tie_word_embeddings
            else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        )
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope)
        # Set by the runner where it can run (`pdserve.models.fused_decode`): decode-only steps
        # then take one native call per layer instead of the modules.
        self.fused_decode = None
        # Set by layer hooks that only some steps need (`ModelRunner.add_layer_hook`): a step
        # for which it returns True runs layer by layer, so that the hooks fire.
        self.layer_hooks_wanted = None
        # Rank 0 of a tensor-parallel group: hands each forward's inputs to the other ranks.
        self.tp_leader = None

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        with_logits: bool = False,
        greedy: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, HeadOutput | None]:
        """The hidden states [T, hidden], final-normed. `with_logits`: (hidden, the head's
        output for every row: the logits and, with `greedy`, each row's argmax) where a fused
        decode step computes it in the same native call, else (hidden, None), and the caller
        computes what logits it needs (`compute_logits`)."""
        if self.tp_leader is not None:
            self.tp_leader(input_ids, positions, meta, len(kv_caches))  # fewer: a draft
        x = self.embed_tokens(input_ids)
        hooked = self.layer_hooks_wanted is not None and self.layer_hooks_wanted()
        if self.fused_decode is not None and not meta.prefills and not hooked:
            return self.fused_decode(x, positions, kv_caches, meta, with_logits, greedy)
        cos_sin = self.rope.cos_sin(positions)
        for layer, kv_cache in zip(self.layers, kv_caches):
            x = layer(x, cos_sin, kv_cache, meta, self.rope, self.attn_backend)
        return (self.norm(x), None) if with_logits else self.norm(x)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [S, hidden] -> [S, vocab]
        if self.lm_head is None:  # tied
            return F.linear(hidden, self.embed_tokens.weight).float()
        return self.lm_head(hidden).float()


def use_native_ops(model: nn.Module) -> int:
    """Run the layers' per-token operations (RMSNorm, the rotary embedding, the MLP's
    activation) on pdserve's CPU kernels (`pdserve/kernels/cpu_layer.c`): one pass over the rows
    each, where torch makes several, and the rotary embedding in place. For a float32 model on
    the CPU whose kernels build; returns how many modules it switched."""
    switched = 0
    for module in model.modules():
        if isinstance(module, (RMSNorm, Attention, MLP)):
            module.native = True
            switched += 1
    return switched
