"""The decode step's layers in one native call (`pdserve/kernels/cpu_decode.c`).

Run op by op, a batch-1 decode step of a small model spends a quarter of its time outside the
matrix products: ~40 torch ops per layer and the Python around them. When every step token is
a decode, `FusedDecode` runs all the layers and the final norm as one C call over the same
weights and the same paged cache, so a step costs what its weights take to stream (one call per
layer, as before, paid ~35 us per return to Python: the interpreter's state is cold in the
caches once a layer's weights have streamed through them). Steps with a prefill chunk, and
models it cannot take, run through the modules as before (`LlamaForCausalLM.forward`).

It takes a model whose projections are all native (`NativeLinear`, or native `Int8Linear` /
`Int4Linear`), whose attention backend is `NativeBackend`, on the CPU in float32, with no
forward hooks on its layers (they need the layer-by-layer path); `--enforce-eager` turns it off.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
from torch import nn

from pdserve.kernels import decode as native
from pdserve.models.attention import AttentionMetadata, NativeBackend
from pdserve.models.packed_linear import NativeLinear
from pdserve.models.quant_linear import Int4Linear, Int8Linear


def _linear(module: nn.Module) -> native.LinearDesc | None:
    ptr = native.ptr
    if isinstance(module, NativeLinear):
        return native.LinearDesc(native.KINDS["f32"], 0, module.out_features,
                                 module.in_features, ptr(module.w), None, ptr(module.bias))  # fmt: skip
    if isinstance(module, Int8Linear | Int4Linear) and module.native:
        kind, group = ("int8", 0) if isinstance(module, Int8Linear) else ("int4", module.group_size)
        return native.LinearDesc(native.KINDS[kind], group, module.out_features,
                                 module.in_features, ptr(module.q), ptr(module.scale),
                                 ptr(module.bias))  # fmt: skip
    return None


class HeadOutput(NamedTuple):
    """What a fused decode step's head computed: the logits of every row and, where asked, each
    row's argmax (its greedy token)."""

    logits: torch.Tensor  # [nd, vocab] float32
    greedy: list[int] | None


class FusedDecode:
    """Decode-only steps of one model through the fused native layers. Build with `build`."""

    def __init__(
        self, model: nn.Module, layers: list[native.LayerDesc], head: native.LinearDesc | None
    ) -> None:
        self.model = model  # keeps every tensor the descriptors point at alive
        self.layers = (native.LayerDesc * len(layers))(*layers)
        self.head = head  # the output head where it runs on a native kernel, else None
        # the token embeddings a burst feeds each step's greedy tokens back through, where they
        # are float32 rows in memory and the head runs natively (else no bursts)
        embed = model.embed_tokens.weight
        plain = embed.dtype == torch.float32 and embed.device.type == "cpu"
        self.embed = embed if plain and embed.is_contiguous() and head is not None else None
        self._scratch: torch.Tensor | None = None
        self._cache_key: tuple[int, ...] = ()  # where the caches the descriptors point at lie

    @classmethod
    def build(cls, model: nn.Module) -> tuple[FusedDecode | None, str]:
        """(the fused step of `model`, "") or (None, why it cannot take the model)."""
        ok, why = native.available()
        if not ok:
            return None, why
        if not isinstance(model.attn_backend, NativeBackend):
            return None, f"attention backend {model.attn_backend.name} is not the native one"
        cfg = model.config
        norm = model.norm.weight
        if norm.dtype != torch.float32 or norm.device.type != "cpu" or not norm.is_contiguous():
            return None, "the model is not float32 on the CPU"
        layers = []
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            linears = [_linear(m) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj,
                                            mlp.down_proj)]  # fmt: skip
            if any(d is None for d in linears):
                return None, "not every projection runs on a native kernel"
            norms = [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
            if any(w.dtype != torch.float32 or w.device.type != "cpu" for w in norms):
                return None, "the model is not float32 on the CPU"
            desc = native.LayerDesc(
                hidden=cfg.hidden_size, hq=cfg.num_heads, hkv=cfg.num_kv_heads, d=cfg.head_dim,
                inter=cfg.intermediate_size, kv_int8=0, eps=layer.input_layernorm.eps,
                in_norm=norms[0].data_ptr(), post_norm=norms[1].data_ptr(),
                q_norm=native.ptr(attn.q_norm.weight) if attn.q_norm is not None else None,
                k_norm=native.ptr(attn.k_norm.weight) if attn.k_norm is not None else None,
                qkv=linears[0], o=linears[1], gate_up=linears[2], down=linears[3],
            )  # fmt: skip
            layers.append(desc)
        head = _linear(model.lm_head) if model.lm_head is not None else None
        return cls(model, layers, head), ""

    def __call__(
        self,
        x: torch.Tensor,  # [nd, hidden], the embedded tokens; updated in place
        positions: torch.Tensor,  # [nd] long
        kv_caches: list[torch.Tensor],  # per layer [2, slots, Hkv, W]; fewer: a draft's first
        meta: AttentionMetadata,
        with_logits: bool = False,
        greedy: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, HeadOutput | None]:
        """The hidden states [nd, hidden] after the model's final norm; `with_logits`: and the
        head's output for every row (`greedy`: with each row's argmax), computed in the same
        native call where the head runs on a native kernel (else None: the caller computes
        what it needs)."""
        nd = x.shape[0]
        rope = self.model.rope
        # the C side reads int64 indices, the context slots row by row (no copies when they are)
        positions, new_slots, lens = (t.to(torch.int64).contiguous()
                                      for t in (positions, meta.slot_mapping, meta.decode_lens))  # fmt: skip
        ctx = meta.decode_slots.to(torch.int64)
        ctx = ctx if ctx.stride(1) == 1 else ctx.contiguous()
        step = native.StepDesc(
            nd=nd, positions=positions.data_ptr(), new_slots=new_slots.data_ptr(),
            ctx_slots=ctx.data_ptr(), slots_stride=ctx.stride(0), lens=lens.data_ptr(),
            cos=rope.cos.data_ptr(), sin=rope.sin.data_ptr(),
            scratch=self._scratch_for(nd).data_ptr(),
        )  # fmt: skip
        key = tuple(c.data_ptr() for c in kv_caches)
        if key != self._cache_key:
            self._point_at(kv_caches, key)
        out = torch.empty_like(x)
        norm = self.model.norm
        head = self.head if with_logits else None
        logits = None if head is None else torch.empty(nd, head.n)
        tokens = torch.empty(nd, dtype=torch.int64) if head is not None and greedy else None
        native.decode_step(self.layers, min(len(self.layers), len(kv_caches)), step, x,
                           norm.weight, norm.eps, out, head, logits, tokens)  # fmt: skip
        if not with_logits:
            return out
        if head is None:
            return out, None
        return out, HeadOutput(logits, None if tokens is None else tokens.tolist())

    @torch.inference_mode()
    def burst(
        self,
        tokens: list[int],  # each row's last token (its KV not yet computed)
        positions: np.ndarray,  # [nd] int64, those tokens' positions
        ctx_slots: np.ndarray,  # [nd, >= max(positions) + steps] int64, each row's cache slots
        steps: int,
        kv_caches: list[torch.Tensor],
    ) -> list[list[int]]:
        """`steps` greedy decode steps of every row in one native call: each row's tokens
        (`steps` of them), the output of step s the input of step s + 1. The slots of the
        positions the burst computes must be allocated (`ctx_slots` holds them)."""
        if self.embed is None:
            raise ValueError("a burst needs a native head and float32 token embeddings")
        nd = len(tokens)
        pos = positions[None, :] + np.arange(steps, dtype=np.int64)[:, None]  # [steps, nd]
        pos_t = torch.from_numpy(np.ascontiguousarray(pos))
        new_t = torch.from_numpy(np.ascontiguousarray(ctx_slots[np.arange(nd)[None, :], pos]))
        lens_t = pos_t + 1
        ctx = torch.from_numpy(np.ascontiguousarray(ctx_slots, dtype=np.int64))
        rope, scratch = self.model.rope, self._scratch_for(nd).data_ptr()
        descs = (native.StepDesc * steps)(*(native.StepDesc(
            nd=nd, positions=pos_t[s].data_ptr(), new_slots=new_t[s].data_ptr(),
            ctx_slots=ctx.data_ptr(), slots_stride=ctx.shape[1], lens=lens_t[s].data_ptr(),
            cos=rope.cos.data_ptr(), sin=rope.sin.data_ptr(), scratch=scratch,
        ) for s in range(steps)))  # fmt: skip
        key = tuple(c.data_ptr() for c in kv_caches)
        if key != self._cache_key:
            self._point_at(kv_caches, key)
        x = self.embed[torch.tensor(tokens, dtype=torch.int64)]  # a copy: updated in place
        out = torch.empty_like(x)
        logits = torch.empty(nd, self.head.n)
        sampled = torch.empty(steps, nd, dtype=torch.int64)
        norm = self.model.norm
        native.decode_burst(self.layers, min(len(self.layers), len(kv_caches)), descs, x,
                            norm.weight, norm.eps, out, self.head, logits, sampled,
                            self.embed)  # fmt: skip
        return sampled.t().tolist()

    def _point_at(self, kv_caches: list[torch.Tensor], key: tuple[int, ...]) -> None:
        """Each layer's descriptor at its cache's K and V halves ([2, slots, Hkv, W])."""
        for layer, cache in zip(self.layers, kv_caches):
            layer.k_cache, layer.v_cache = cache[0].data_ptr(), cache[1].data_ptr()
            layer.kv_int8 = int(cache.dtype == torch.int8)
        self._cache_key = key

    def _scratch_for(self, nd: int) -> torch.Tensor:
        n = native.scratch_floats(self.layers[0], nd)
        if self._scratch is None or self._scratch.numel() < n:
            self._scratch = torch.empty(n, dtype=torch.float32)
        return self._scratch
