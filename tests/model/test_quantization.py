"""Weight-only quantization on the real tiny model: perplexity against float32 on its reference
story and on held-out stories, greedy agreement, and the engine's modes (chunked prefill, the
prefix cache) with quantized weights; tests/e2e/test_disagg.py serves them 1P+1D.

Measured bounds (docs/PERFORMANCE.md has the figures): int8 stays within 1% of float32's
perplexity on every text. int4 (groups of 32, calibrated on 4,096 tokens the model samples)
measured +1.7%, +5.5%, -0.9%, -1.1%: held within 6% on each text and 3% on their mean; rounded
to nearest (no calibration) it measured +4.9%, +3.3%, +9.9%, +9.1% (the symmetric rounding
before it: up to +17%): held within 12%, and the calibrated mean must beat it.
"""

from __future__ import annotations

import math

import pytest
import torch

from pdserve import LLM, SamplingParams

BOUNDS = {"int8": 0.01, "int4": 0.06}
INT4_MEAN_BOUND = 0.03
NEAREST_BOUND = 0.12  # int4 rounded to nearest


def perplexity(llm: LLM, text: str) -> float:
    out = llm.generate([text], SamplingParams(max_tokens=0, prompt_logprobs=0))[0]
    logprobs = [lp.logprob for lp in out.prompt_logprobs[1:]]
    return math.exp(-sum(logprobs) / len(logprobs))


@pytest.fixture(scope="module")
def texts(stories_reference_text, held_out_stories):
    return [stories_reference_text, *held_out_stories]


@pytest.fixture(scope="module")
def float_ppl(stories_path, texts):
    llm = LLM(stories_path)
    return [perplexity(llm, t) for t in texts]


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_perplexity_stays_near_float32(stories_path, texts, float_ppl, quant):
    llm = LLM(stories_path, quantization=quant)
    for text, base in zip(texts, float_ppl, strict=True):
        ppl = perplexity(llm, text)
        assert ppl / base - 1 <= BOUNDS[quant], (quant, text[:30], ppl, base)
    llm.engine.core.scheduler.kv.pool.check_whole()


def test_int4_calibration_beats_rounding_to_nearest(stories_path, texts, float_ppl):
    """Calibrated int4 stays within 3% of float32 on the texts' mean; rounded to nearest it is
    within 12% on each but worse on the mean (measured: 1.3% against 6.8%)."""
    calibrated = LLM(stories_path, quantization="int4")
    nearest = LLM(stories_path, quantization="int4", quantization_calibration_tokens=0)
    rises = {}
    for name, llm in (("calibrated", calibrated), ("nearest", nearest)):
        rises[name] = [perplexity(llm, t) / b - 1 for t, b in zip(texts, float_ppl, strict=True)]
    assert max(rises["nearest"]) <= NEAREST_BOUND, rises
    mean = {name: sum(r) / len(r) for name, r in rises.items()}
    assert mean["calibrated"] <= INT4_MEAN_BOUND and mean["calibrated"] < mean["nearest"], rises


def _int4_weights(llm: LLM) -> list[torch.Tensor]:
    model = llm.engine.core.runner.model
    return [t for m in model.modules() if hasattr(m, "group_size") for t in (m.q, m.scale)]


def test_int4_calibration_is_deterministic_on_one_thread_and_two(stories_path):
    """The same checkpoint gives the same codes, scales and minima whatever the thread count
    (prefill and decode workers quantize the model each on its own)."""
    before = torch.get_num_threads()
    try:
        weights = []
        for n in (1, 2):
            torch.set_num_threads(n)
            weights.append(_int4_weights(LLM(stories_path, quantization="int4", num_threads=n)))
    finally:
        torch.set_num_threads(before)
    assert len(weights[0]) == 2 * (5 * 4 + 1)  # every projection and the output head
    assert all(torch.equal(a, b) for a, b in zip(*weights, strict=True))


def test_int8_greedy_tokens_follow_float32(stories_path):
    """Measured: the first divergence at token 50 of 128 (a near-tie the rounding flips)."""
    params = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)
    prompt = "Once upon a time, there was a little"
    ref = LLM(stories_path).generate([prompt], params)[0].outputs[0].token_ids
    got = LLM(stories_path, quantization="int8").generate([prompt], params)[0].outputs[0].token_ids
    first_diff = next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), len(ref))
    assert first_diff >= 32, first_diff


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_chunked_prefill_and_the_prefix_cache_give_the_same_tokens(
    stories_path, held_out_stories, quant
):
    story = held_out_stories[0]
    prompts = [story, story[:90] + " and then", "Lily and Ben"]
    params = SamplingParams(max_tokens=24, temperature=0)
    whole = LLM(stories_path, quantization=quant, enable_prefix_caching=False)
    chunked = LLM(stories_path, quantization=quant, max_num_batched_tokens=16)
    expect = [o.outputs[0].token_ids for o in whole.generate(prompts, params)]
    first = chunked.generate(prompts, params)
    again = chunked.generate(prompts, params)  # the prompts' blocks now come from the cache
    assert [o.outputs[0].token_ids for o in first] == expect
    assert [o.outputs[0].token_ids for o in again] == expect
    assert sum(o.outputs[0].metrics.num_cached_tokens for o in again) > 0
    chunked.engine.core.scheduler.kv.pool.check_whole()


def test_quantization_needs_float32_on_the_cpu(stories_path):
    with pytest.raises(ValueError, match="float32"):
        LLM(stories_path, quantization="int8", dtype="bfloat16")
