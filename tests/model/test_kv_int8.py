"""The int8 KV cache (`kv_cache_dtype="int8"`): rows that carry their scales, the capacity it
buys, and quality and determinism on the real tiny model (measured: perplexity -0.3% to +0.9%
against float32's on the texts of benchmarks/quant_bench.py --quality)."""

from __future__ import annotations

import math

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.disagg.protocol import KVLayout
from pdserve.models import kv_quant


def test_rows_round_trip_within_half_a_step_and_carry_their_scale():
    x = torch.randn(5, 3, 64) * torch.logspace(-3, 2, 5)[:, None, None]  # scales far apart
    rows = kv_quant.quantize_rows(x)
    assert rows.dtype == torch.int8 and rows.shape == (5, 3, 64 + kv_quant.SCALE_BYTES)
    back = kv_quant.dequantize_rows(rows, torch.float32)
    step = x.abs().amax(-1, keepdim=True) / 127
    assert ((back - x).abs() <= step / 2 + 1e-6 * step).all()
    zeros = kv_quant.dequantize_rows(kv_quant.quantize_rows(torch.zeros(2, 1, 8)), torch.float32)
    assert torch.equal(zeros, torch.zeros(2, 1, 8))


def test_store_and_load_through_a_cache():
    cache = torch.zeros(10, 2, 8 + kv_quant.SCALE_BYTES, dtype=torch.int8)
    x = torch.randn(3, 2, 8)
    kv_quant.store(cache, torch.tensor([7, 1, 4]), x)
    got = kv_quant.load(cache, torch.tensor([[1, 4], [7, 7]]), torch.float32)
    assert got.shape == (2, 2, 2, 8)
    torch.testing.assert_close(got[0, 0], x[1], atol=x[1].abs().max().item() / 127, rtol=0)


def test_the_layout_names_the_kv_dtype_and_its_row():
    f32 = KVLayout("m", "float32", 2, 4, 64, 16)
    i8 = KVLayout("m", "int8", 2, 4, 64, 16)
    assert (f32.row_width, i8.row_width) == (64, 68)
    assert "dtype 'float32' != 'int8'" in f32.mismatch(i8)


def perplexity(llm, text):
    out = llm.generate([text], SamplingParams(max_tokens=0, prompt_logprobs=0))[0]
    logprobs = [lp.logprob for lp in out.prompt_logprobs[1:]]
    return math.exp(-sum(logprobs) / len(logprobs))


def test_capacity_and_perplexity_against_float32(
    stories_path, stories_reference_text, held_out_stories
):
    base = LLM(stories_path, kv_cache_memory="4MiB")
    int8 = LLM(stories_path, kv_cache_memory="4MiB", kv_cache_dtype="int8")
    head_dim = base.engine.core.model_config.head_dim  # 8 here: the scale is a third of a row
    ratio = int8.engine.core.runner.num_blocks / base.engine.core.runner.num_blocks
    assert ratio == pytest.approx(4 * head_dim / (head_dim + 4), rel=0.01)
    for text in [stories_reference_text, *held_out_stories]:
        # prompt logprobs read the prompt's KV back from the cache in every chunk after the first
        assert perplexity(int8, text) / perplexity(base, text) - 1 <= 0.01


@pytest.mark.parametrize("quant", ["none", "int8"])
def test_chunked_prefill_and_the_prefix_cache_give_the_same_tokens(
    stories_path, held_out_stories, quant
):
    story = held_out_stories[0]
    prompts = [story, story[:90] + " and then", "Lily and Ben"]
    params = SamplingParams(max_tokens=24, temperature=0)
    kw = {"kv_cache_dtype": "int8", "quantization": quant}
    whole = LLM(stories_path, enable_prefix_caching=False, **kw)
    chunked = LLM(stories_path, max_num_batched_tokens=16, **kw)
    expect = [o.outputs[0].token_ids for o in whole.generate(prompts, params)]
    assert [o.outputs[0].token_ids for o in chunked.generate(prompts, params)] == expect
    again = chunked.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in again] == expect
    assert sum(o.outputs[0].metrics.num_cached_tokens for o in again) > 0
    chunked.engine.core.scheduler.kv.pool.check_whole()
