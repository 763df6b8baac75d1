"""FLOPs and bytes of one engine step, from the model's shapes alone (no torch here).

The planner, the simulator and the MFU / MBU figures all use these counts, so they follow one
convention: a multiply-add is 2 FLOPs; elementwise work (norms, activations, rotary, softmax) is
left out; attention is full (sliding windows are not modelled) and causal, counted exactly;
every weight and every KV byte touched in a step is read once from memory.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

DTYPE_BYTES = {
    "float32": 4,
    "float": 4,
    "bfloat16": 2,
    "float16": 2,
    "half": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}


@dataclass(frozen=True)
class ModelShape:
    """The shapes of a Llama-family decoder that its step cost depends on.

    `dtype_bytes` is the size of one weight element, and of one KV cache element unless
    `kv_dtype_bytes` is given; `matmul_bytes_per_param`, where set, is the size of one weight of
    the matrices (projections and output head) as stored (weight-only quantization: int8 about
    1, int4 about 0.6 with its scales), the rest (norms, the embedding table) staying at
    `dtype_bytes`.
    """

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tied: bool = False
    dtype_bytes: int = 2
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    kv_dtype_bytes: float | None = None
    matmul_bytes_per_param: float | None = None

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type == "int" and (type(value) is not int or value < 1):
                raise ValueError(f"ModelShape.{f.name}={value!r}: must be an integer >= 1")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelShape.num_kv_heads={self.num_kv_heads}: "
                f"must divide num_heads={self.num_heads}"
            )
        if self.matmul_bytes_per_param is not None and not self.matmul_bytes_per_param > 0:
            raise ValueError(
                f"ModelShape.matmul_bytes_per_param={self.matmul_bytes_per_param!r}: must be > 0"
            )
        if self.kv_dtype_bytes is not None and not self.kv_dtype_bytes > 0:
            raise ValueError(f"ModelShape.kv_dtype_bytes={self.kv_dtype_bytes!r}: must be > 0")

    @classmethod
    def from_hf_config(
        cls, config: Mapping[str, Any], dtype_bytes: int | None = None
    ) -> ModelShape:
        """The shape of a Hugging Face `config.json` dict (Llama, Qwen2, Qwen3, Mistral).

        `dtype_bytes` defaults to the config's `torch_dtype` (or `dtype`), else 2.
        """
        model_type = config.get("model_type", "llama")
        num_heads = config["num_attention_heads"]
        head_dim = config.get("head_dim") or config["hidden_size"] // num_heads
        if dtype_bytes is None:
            dtype_name = config.get("torch_dtype") or config.get("dtype") or "bfloat16"
            if dtype_name not in DTYPE_BYTES:
                raise ValueError(f"torch_dtype={dtype_name!r}: known: {', '.join(DTYPE_BYTES)}")
            dtype_bytes = DTYPE_BYTES[dtype_name]
        attention_bias = bool(config.get("attention_bias", False))
        return cls(
            hidden_size=config["hidden_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=config.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            intermediate_size=config["intermediate_size"],
            vocab_size=config["vocab_size"],
            tied=bool(config.get("tie_word_embeddings", False)),
            dtype_bytes=dtype_bytes,
            qkv_bias=model_type == "qwen2" or attention_bias,
            o_bias=model_type != "qwen2" and attention_bias,
            mlp_bias=bool(config.get("mlp_bias", False)),
            qk_norm=model_type == "qwen3",
        )

    @property
    def kv_bytes_per_token(self) -> float:
        """KV cache bytes of one token over all layers: layers * 2 (K, V) * kv_heads * head_dim
        * bytes per value (an int8 cache's per-row scales included in its bytes per value)."""
        kv_dtype_bytes = self.kv_dtype_bytes or self.dtype_bytes
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * kv_dtype_bytes

    @property
    def layer_matmul_params(self) -> int:
        """Matrix weights of one decoder layer: q, k, v, o and gate, up, down projections."""
        q_dim = self.num_heads * self.head_dim
        kv_dim = self.num_kv_heads * self.head_dim
        attention = self.hidden_size * (q_dim + 2 * kv_dim) + q_dim * self.hidden_size
        return attention + 3 * self.hidden_size * self.intermediate_size

    @property
    def layer_params(self) -> int:
        """All weights of one decoder layer: matrices, biases and norm scales."""
        q_dim = self.num_heads * self.head_dim
        kv_dim = self.num_kv_heads * self.head_dim
        extra = 2 * self.hidden_size  # input and post-attention RMSNorm
        extra += (q_dim + 2 * kv_dim) if self.qkv_bias else 0
        extra += self.hidden_size if self.o_bias else 0
        extra += (2 * self.intermediate_size + self.hidden_size) if self.mlp_bias else 0
        extra += 2 * self.head_dim if self.qk_norm else 0
        return self.layer_matmul_params + extra

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size


def num_params(shape: ModelShape) -> int:
    """Parameters of the model, a tied lm_head counted once (as `model.num_parameters()`):
    vocab*hidden (embedding) + layers * layer_params + hidden (final norm) + vocab*hidden
    (lm_head, when untied)."""
    lm_head = 0 if shape.tied else shape.embedding_params
    return (
        shape.embedding_params + shape.num_layers * shape.layer_params + shape.hidden_size + lm_head
    )


@dataclass(frozen=True)
class StepCost:
    """FLOPs and memory traffic of one step. `flops` is the total, of which `attention_flops`
    and `lm_head_flops` are parts (the rest is the layers' matrix products)."""

    flops: float
    weight_bytes: float
    kv_read_bytes: float
    kv_write_bytes: float
    attention_flops: float = 0.0
    lm_head_flops: float = 0.0

    @property
    def linear_flops(self) -> float:
        return self.flops - self.attention_flops - self.lm_head_flops

    @property
    def total_bytes(self) -> float:
        return self.weight_bytes + self.kv_read_bytes + self.kv_write_bytes

    @property
    def arithmetic_intensity(self) -> float:
        """FLOPs per byte moved: compare with the device's peak_flops / bandwidth ridge point."""
        return self.flops / self.total_bytes if self.total_bytes else 0.0

    def __add__(self, other: StepCost) -> StepCost:
        return StepCost(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(StepCost)))


def attention_pairs(q_len: int, ctx_len: int) -> int:
    """(query, key) pairs of a causal chunk: q_len new tokens at the end of ctx_len tokens.

    New token i (0-based) sees the prefix (ctx_len - q_len) plus itself and the i before it:
    sum_i (ctx_len - q_len + i + 1) = q_len * (ctx_len - q_len) + q_len * (q_len + 1) / 2.
    """
    prefix = ctx_len - q_len
    return q_len * prefix + q_len * (q_len + 1) // 2


def step_cost(
    shape: ModelShape, q_lens: Sequence[int], ctx_lens: Sequence[int], num_sampled: int
) -> StepCost:
    """Cost of one forward over a batch of sequences.

    Sequence j computes q_lens[j] new tokens and holds ctx_lens[j] tokens after the step
    (decode: q_len 1; a prefill chunk: q_len = chunk, ctx_len = computed + chunk). With
    T = sum(q_lens), P = layer_matmul_params, h = hidden_size, V = vocab_size, L = layers:

    - linear FLOPs    = 2 * P * L * T                            (q, k, v, o, gate, up, down)
    - attention FLOPs = 4 * L * num_heads * head_dim * sum_j pairs(q_j, ctx_j)
                        (QK^T and PV, 2 FLOPs per multiply-add each; pairs: `attention_pairs`)
    - lm_head FLOPs   = 2 * h * V * num_sampled                  (only the rows sampled)
    - weight bytes    = (L * layer_params + h) * dtype_bytes     (layers and final norm)
                        + T * h * dtype_bytes                    (embedding rows gathered)
                        + V * h * dtype_bytes if num_sampled     (lm_head, tied or not)
                        with the matrices (L * P and the lm_head) at matmul_bytes_per_param
                        instead where that is set
    - KV read bytes   = sum(ctx_lens) * kv_bytes_per_token       (the new tokens' KV included:
                        it is written to the cache and read back by the attention kernel)
    - KV write bytes  = T * kv_bytes_per_token
    """
    if len(q_lens) != len(ctx_lens):
        raise ValueError(f"q_lens has {len(q_lens)} entries but ctx_lens has {len(ctx_lens)}")
    for q_len, ctx_len in zip(q_lens, ctx_lens):
        if q_len < 1 or ctx_len < q_len:
            raise ValueError(f"q_len={q_len}, ctx_len={ctx_len}: need 1 <= q_len <= ctx_len")
    num_tokens = sum(q_lens)
    if not 0 <= num_sampled <= num_tokens:
        raise ValueError(f"num_sampled={num_sampled}: must be in [0, {num_tokens}] (the tokens)")

    h, layers = shape.hidden_size, shape.num_layers
    linear_flops = 2 * shape.layer_matmul_params * layers * num_tokens
    pairs = sum(attention_pairs(q, c) for q, c in zip(q_lens, ctx_lens))
    attention_flops = 4 * layers * shape.num_heads * shape.head_dim * pairs
    lm_head_flops = 2 * h * shape.vocab_size * num_sampled

    matrix_elems = layers * shape.layer_matmul_params
    if num_sampled:
        matrix_elems += shape.embedding_params
    other_elems = layers * (shape.layer_params - shape.layer_matmul_params) + h + num_tokens * h
    matrix_bytes = shape.matmul_bytes_per_param or shape.dtype_bytes
    return StepCost(
        flops=float(linear_flops + attention_flops + lm_head_flops),
        weight_bytes=float(matrix_elems * matrix_bytes + other_elems * shape.dtype_bytes),
        kv_read_bytes=float(sum(ctx_lens) * shape.kv_bytes_per_token),
        kv_write_bytes=float(num_tokens * shape.kv_bytes_per_token),
        attention_flops=float(attention_flops),
        lm_head_flops=float(lm_head_flops),
    )
