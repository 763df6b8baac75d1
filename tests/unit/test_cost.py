"""Specification of `pdserve.perf.cost`: parameter counts, step FLOPs and step bytes."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pdserve.models.presets import PRESETS
from pdserve.perf.cost import ModelShape, StepCost, attention_pairs, num_params, step_cost


def make_shape(**overrides) -> ModelShape:
    fields = dict(
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        intermediate_size=128,
        vocab_size=512,
        tied=False,
        dtype_bytes=2,
    )
    return ModelShape(**(fields | overrides))


def preset_shape(name: str) -> ModelShape:
    return ModelShape.from_hf_config(PRESETS[name])


@pytest.mark.parametrize(
    ("preset", "params"),
    [
        # The published parameter counts of the real checkpoints these presets copy.
        ("qwen2.5-0.5b", 494_032_768),
        ("qwen3-0.6b", 596_049_920),
        ("llama-3.2-1b", 1_235_814_400),
    ],
)
def test_num_params_matches_real_checkpoints(preset, params):
    assert num_params(preset_shape(preset)) == params


def test_llama_125m_has_about_125m_params():
    assert num_params(preset_shape("llama-125m")) == pytest.approx(125e6, rel=0.05)


def test_num_params_counts_every_weight_once():
    shape = make_shape()
    layer = 64 * (64 + 2 * 32) + 64 * 64 + 3 * 64 * 128 + 2 * 64
    assert num_params(shape) == 512 * 64 + 2 * layer + 64 + 512 * 64
    assert num_params(make_shape(tied=True)) == num_params(shape) - 512 * 64


def test_biases_and_qk_norm_add_their_params():
    base = num_params(make_shape())
    assert num_params(make_shape(qkv_bias=True)) == base + 2 * (64 + 2 * 32)
    assert num_params(make_shape(qk_norm=True)) == base + 2 * 2 * 16


def test_from_hf_config_reads_arch_details():
    qwen2 = preset_shape("qwen2.5-0.5b")
    assert (qwen2.qkv_bias, qwen2.qk_norm, qwen2.tied, qwen2.dtype_bytes) == (True, False, True, 2)
    assert qwen2.head_dim == 64
    qwen3 = preset_shape("qwen3-0.6b")
    assert (qwen3.qkv_bias, qwen3.qk_norm, qwen3.head_dim) == (False, True, 128)
    llama = preset_shape("llama-tiny")
    assert (llama.qkv_bias, llama.tied, llama.dtype_bytes, llama.head_dim) == (False, False, 4, 16)
    assert ModelShape.from_hf_config(PRESETS["llama-tiny"], dtype_bytes=2).dtype_bytes == 2


def test_decode_step_flops():
    shape = make_shape()
    cost = step_cost(shape, q_lens=[1], ctx_lens=[100], num_sampled=1)
    linear = 2 * shape.layer_matmul_params * 2
    attention = 4 * 2 * 4 * 16 * 100  # QK^T and PV against 100 keys, 4 heads, 2 layers
    lm_head = 2 * 64 * 512
    assert cost.flops == linear + attention + lm_head
    assert cost.attention_flops == attention
    assert cost.lm_head_flops == lm_head
    assert cost.linear_flops == linear


def test_prefill_attention_is_causal():
    assert attention_pairs(q_len=4, ctx_len=4) == 1 + 2 + 3 + 4
    assert attention_pairs(q_len=1, ctx_len=10) == 10
    assert attention_pairs(q_len=2, ctx_len=10) == 9 + 10


def test_chunked_prefill_adds_up_to_the_whole_prefill():
    shape = make_shape()
    whole = step_cost(shape, [96], [96], num_sampled=1)
    chunks = [
        step_cost(shape, [32], [32], 0),
        step_cost(shape, [32], [64], 0),
        step_cost(shape, [32], [96], 1),
    ]
    total = chunks[0] + chunks[1] + chunks[2]
    assert total.flops == whole.flops
    assert total.attention_flops == whole.attention_flops
    assert total.kv_write_bytes == whole.kv_write_bytes


def test_lm_head_only_for_sampled_rows():
    shape = make_shape()
    none = step_cost(shape, [8], [8], num_sampled=0)
    one = step_cost(shape, [8], [8], num_sampled=1)
    assert none.lm_head_flops == 0
    assert one.flops - none.flops == 2 * 64 * 512
    assert one.weight_bytes - none.weight_bytes == 512 * 64 * 2


def test_weight_bytes_gather_embedding_rows_and_read_everything_else():
    shape = make_shape()
    cost = step_cost(shape, [1, 1, 1], [10, 20, 30], num_sampled=3)
    elems = 2 * shape.layer_params + 64 + 3 * 64 + 512 * 64  # layers, norm, rows, lm_head
    assert cost.weight_bytes == elems * 2
    # Tied or not, the lm_head matrix is read once per sampling step.
    assert step_cost(make_shape(tied=True), [1, 1, 1], [10, 20, 30], 3) == cost


def test_kv_bytes():
    shape = make_shape()
    per_token = 2 * 2 * 2 * 16 * 2  # layers * (K, V) * kv_heads * head_dim * bytes
    assert shape.kv_bytes_per_token == per_token
    cost = step_cost(shape, [1, 5], [10, 5], num_sampled=2)
    assert cost.kv_read_bytes == (10 + 5) * per_token
    assert cost.kv_write_bytes == 6 * per_token
    assert cost.total_bytes == cost.weight_bytes + cost.kv_read_bytes + cost.kv_write_bytes
    fp8_kv = step_cost(make_shape(kv_dtype_bytes=1), [1, 5], [10, 5], num_sampled=2)
    assert fp8_kv.kv_read_bytes == cost.kv_read_bytes / 2


def test_decode_is_memory_bound_and_long_prefill_compute_bound():
    shape = preset_shape("llama-3.2-1b")
    decode = step_cost(shape, [1] * 8, [1024] * 8, num_sampled=8)
    prefill = step_cost(shape, [2048], [2048], num_sampled=1)
    assert decode.arithmetic_intensity < 20 < 500 < prefill.arithmetic_intensity


@pytest.mark.parametrize(
    ("q_lens", "ctx_lens", "num_sampled"),
    [([1, 1], [5], 1), ([6], [5], 1), ([0], [5], 0), ([2], [5], 3), ([2], [5], -1)],
)
def test_bad_step_raises_value_error(q_lens, ctx_lens, num_sampled):
    with pytest.raises(ValueError):
        step_cost(make_shape(), q_lens, ctx_lens, num_sampled)


def test_bad_shape_raises_value_error_naming_the_field():
    with pytest.raises(ValueError, match="num_kv_heads"):
        make_shape(num_kv_heads=3)
    with pytest.raises(ValueError, match="hidden_size"):
        make_shape(hidden_size=0)


def test_step_costs_add():
    a = StepCost(1.0, 2.0, 3.0, 4.0, 0.5, 0.25)
    assert a + a == StepCost(2.0, 4.0, 6.0, 8.0, 1.0, 0.5)


def test_cost_module_does_not_import_torch():
    code = "import sys, pdserve.perf.cost; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
