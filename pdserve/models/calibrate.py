"""int4 weights calibrated at load on text the model samples itself (`--quantization int4`).

Rounding each weight to its nearest level ignores what the layer computes: the error a layer
adds is `(W - Q) x`, so it depends on the inputs x, and on the errors of the layers before it,
which change x. Here every projection and the output head are quantized in the order the model
runs them, each against inputs measured on calibration text:

1. The float model samples `tokens` tokens of text (sequences of up to 256 from BOS,
   temperature 1, a fixed seed: the same checkpoint gives the same text and weights).
2. That text runs through two copies of the model at once, layer by layer: the float one and
   the one quantized so far, whose products are the deployed ones (`Int4Linear`: 8-bit
   activations, the native kernel).
3. Each linear layer W with inputs Xf (float model) and Xq (quantized model, 8-bit) is quantized
   to minimise `||W Xf - Q Xq||` over the calibration tokens: first the float target is moved
   to where the quantized inputs need it, `W + W (Xf - Xq)^T Xq (Xq^T Xq + l I)^-1` (the
   asymmetric calibration of GPTAQ, Li et al. 2025), then GPTQ (Frantar et al. 2022) rounds it
   one input column at a time, each column's rounding error spread over the columns not yet
   rounded through the inverse of `H = Xq^T Xq` (dampened by 1% of its mean diagonal). Each
   group's scale and minimum are chosen when the group's first column comes up, from the
   weights as updated so far, by `int4_params`' search weighted by H's diagonal.

The codes, scales and minima go into `Int4Linear`, whose format and kernel are those of plain
rounding. The whole model must be in this process: a tensor-parallel rank (a shard) rounds to
nearest instead (`pdserve.models.loader.quantize_linears`).
"""

from __future__ import annotations

import logging
import time

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.models.quant_linear import (
    Int4Linear,
    _check_group,
    _check_range,
    int4_codes,
    int4_params,
    quantize_activations,
)

logger = logging.getLogger(__name__)

SEED = 0
MAX_SEQ = 256  # tokens per calibration sequence
DAMP = 0.01  # of H's mean diagonal


@torch.no_grad()
def sample_text(model: nn.Module, tokens: int, max_len: int) -> torch.Tensor:
    """[B, T] token ids the float model samples (temperature 1, seed `SEED`) from BOS; B * T
    is about `tokens`, T at most `MAX_SEQ` and the model's context."""
    cfg = model.config
    length = max(2, min(MAX_SEQ, max_len, tokens))
    n = -(-tokens // length)
    gen = torch.Generator().manual_seed(SEED)
    first = cfg.bos_token_id
    if first is None:
        first = int(torch.randint(cfg.vocab_size, (1,), generator=gen))
    ids = torch.full((n, length), first, dtype=torch.long)
    caches: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(model.layers)
    for t in range(length - 1):
        x = model.embed_tokens(ids[:, t : t + 1])
        for i, layer in enumerate(model.layers):
            a, caches[i] = _attention(layer.self_attn, layer.input_layernorm(x), t, model.rope,
                                      caches[i])  # fmt: skip
            x = x + layer.self_attn.o_proj(a)
            x = x + layer.mlp.down_proj(_gated(layer.mlp, layer.post_attention_layernorm(x)))
        logits = model.compute_logits(model.norm(x[:, 0])).double()
        ids[:, t + 1] = torch.multinomial(logits.softmax(-1), 1, generator=gen)[:, 0]
    return ids


def _attention(attn, x, start, rope, cache=None):
    """Attention of x [B, T, hidden] (normed) at positions start.., causal, after `cache`'s
    keys and values: (the output before o_proj [B, T, Hq * D], the keys and values so far)."""
    b, t, _ = x.shape
    hq, hkv, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
    q, k, v = attn.qkv_proj(x).view(b, t, hq + 2 * hkv, d).split([hq, hkv, hkv], dim=2)
    if attn.q_norm is not None:
        q, k = attn.q_norm(q), attn.k_norm(k)
    cos, sin = rope.cos_sin(torch.arange(start, start + t))
    q, k = rope.apply(q, cos, sin), rope.apply(k, cos, sin)
    if cache is not None:
        k, v = torch.cat([cache[0], k], dim=1), torch.cat([cache[1], v], dim=1)
    kh, vh = k.transpose(1, 2), v.transpose(1, 2)
    if hq != hkv:
        kh, vh = kh.repeat_interleave(hq // hkv, 1), vh.repeat_interleave(hq // hkv, 1)
    o = F.scaled_dot_product_attention(q.transpose(1, 2), kh, vh, is_causal=cache is None)
    return o.transpose(1, 2).reshape(b, t, hq * d), (k, v)


def _gated(mlp, x):
    gate, up = mlp.gate_up_proj(x).chunk(2, dim=-1)
    return F.silu(gate) * up


def gptq_int4(
    w: torch.Tensor, xf: torch.Tensor, xq: torch.Tensor, group_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """W [N, K] quantized for inputs xf (the float model's) and xq (the quantized model's, as
    its product sees them) [tokens, K]: (codes [N, Kp], scale, minimum [N, groups]), as the
    module docstring says."""
    _check_group(group_size)
    w = w.detach().float()
    _check_range(w)
    n, k = w.shape
    xq64 = xq.double()  # float64 sums: the same roundings whatever the thread count
    h = xq64.T @ xq64
    cross = (xf.double() - xq64).T @ xq64
    diag = torch.diagonal(h)
    diag[diag == 0] = 1.0  # an input never seen: its columns are rounded as they are
    hd = h + DAMP * diag.mean() * torch.eye(k, dtype=h.dtype)
    chol = torch.linalg.cholesky(hd)
    # the float target for the quantized inputs (H symmetric: W C H^-1 = (H^-1 C^T W^T)^T)
    target = w.double() + torch.cholesky_solve(cross.T @ w.double().T, chol).T
    # the upper Cholesky factor of H^-1: row i is how column i's error spreads to the later ones
    u = torch.linalg.cholesky(torch.cholesky_inverse(chol), upper=True).float()
    weight_of = torch.diagonal(hd).float()
    groups = -(-k // group_size)
    codes = torch.zeros(n, groups * group_size)
    scales, lows = torch.empty(n, groups), torch.empty(n, groups)
    rest = target.float()
    for j in range(groups):
        a, b = j * group_size, min((j + 1) * group_size, k)
        block = rest[:, a:b].clone()
        scale, low = int4_params(block, weight_of[a:b])
        scales[:, j], lows[:, j] = scale[:, 0], low[:, 0]
        err = torch.empty_like(block)
        for i in range(b - a):
            c = int4_codes(block[:, i : i + 1], scale, low)
            codes[:, a + i] = c[:, 0]
            e = (block[:, i] - (c[:, 0] * scale[:, 0] + low[:, 0])) / u[a + i, a + i]
            block[:, i + 1 :] -= e[:, None] * u[a + i, a + i + 1 : b]
            err[:, i] = e
        if b < k:
            rest[:, b:] -= err @ u[a:b, b:]
    return codes, scales, lows


def _quantize(linear: nn.Linear, xf, xq, group_size, native) -> Int4Linear:
    k = linear.in_features
    xf, xq = xf.reshape(-1, k), quantize_activations(xq.reshape(-1, k))
    quantized = gptq_int4(linear.weight, xf, xq, group_size)
    return Int4Linear(linear.weight, linear.bias, native, group_size, quantized=quantized)


@torch.no_grad()
def calibrate_int4(
    model: nn.Module, group_size: int, native: bool, tokens: int, max_len: int
) -> int:
    """Replace every projection of `model` (float, whole) and its output head by an
    `Int4Linear` quantized as the module docstring says; returns how many."""
    t0 = time.perf_counter()
    ids = sample_text(model, tokens, max_len)
    t_sample = time.perf_counter() - t0
    hf = hq = model.embed_tokens(ids)
    count = 0
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        xf, xq = layer.input_layernorm(hf), layer.input_layernorm(hq)
        qkv = attn.qkv_proj
        af, _ = _attention(attn, xf, 0, model.rope)
        attn.qkv_proj = _quantize(qkv, xf, xq, group_size, native)
        aq, _ = _attention(attn, xq, 0, model.rope)
        o = attn.o_proj
        attn.o_proj = _quantize(o, af, aq, group_size, native)
        hf, hq = hf + o(af), hq + attn.o_proj(aq)
        xf, xq = layer.post_attention_layernorm(hf), layer.post_attention_layernorm(hq)
        df = _gated(mlp, xf)
        mlp.gate_up_proj = _quantize(mlp.gate_up_proj, xf, xq, group_size, native)
        dq = _gated(mlp, xq)
        down = mlp.down_proj
        mlp.down_proj = _quantize(down, df, dq, group_size, native)
        hf, hq = hf + down(df), hq + mlp.down_proj(dq)
        count += 4
    head = nn.Linear(model.config.hidden_size, model.config.vocab_size, bias=False)
    head.weight = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    model.lm_head = _quantize(head, model.norm(hf), model.norm(hq), group_size, native)
    logger.info(
        "int4 calibrated on %d sampled tokens in %.1f s (sampling %.1f s)",
        ids.numel(), time.perf_counter() - t0, t_sample,
    )  # fmt: skip
    return count + 1
