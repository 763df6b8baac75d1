"""Weight-only quantization on the real tiny model: perplexity against float32 on its reference
story, on held-out stories and on stories the float model samples, greedy agreement, and the
engine's modes (chunked prefill, the prefix cache) with quantized weights;
tests/e2e/test_disagg.py serves them 1P+1D.

Measured bounds (docs/PERFORMANCE.md has the figures): int8 stays within 1% of float32's
perplexity on every text. int4 (groups of 32, calibrated on 4,096 tokens the model samples) is
held on the steadier measure: the perplexity of 32 stories of 256 tokens that the float model
samples (seeds 10000-10031, none of them calibration text), measured +3.7% to +4.4% over four
calibration seeds on one machine and +4.4% on another, held within 5%; rounded to nearest (no
calibration) +8.5%, and the calibrated one must beat it. On the four short texts one calibration
and another differ by several points per text (the largest of them measured +4.9% to +11.3% over
the seeds; which seed a machine gets in effect depends on its float arithmetic, since the
calibration text is sampled): each is held within 12%, what rounding to nearest meets.
"""

from __future__ import annotations

import math

import pytest
import torch

from pdserve import LLM, SamplingParams

BOUNDS = {"int8": 0.01, "int4": 0.12}  # per text
SAMPLED_BOUNDS = {"int8": 0.01, "int4": 0.05}  # the sampled stories, pooled
NEAREST_BOUND = 0.12  # int4 rounded to nearest, per text
SAMPLED_SEEDS = range(10000, 10032)
SAMPLED_TOKENS = 256


def perplexity(llm: LLM, text: str) -> float:
    out = llm.generate([text], SamplingParams(max_tokens=0, prompt_logprobs=0))[0]
    logprobs = [lp.logprob for lp in out.prompt_logprobs[1:]]
    return math.exp(-sum(logprobs) / len(logprobs))


def pooled_perplexity(llm: LLM, stories: list[list[int]]) -> float:
    """exp of the mean negative log-likelihood over every token of every story."""
    outs = llm.generate(stories, [SamplingParams(max_tokens=0, prompt_logprobs=0)] * len(stories))
    logprobs = [lp.logprob for o in outs for lp in o.prompt_logprobs[1:]]
    return math.exp(-sum(logprobs) / len(logprobs))


@pytest.fixture(scope="module")
def texts(stories_reference_text, held_out_stories):
    return [stories_reference_text, *held_out_stories]


@pytest.fixture(scope="module")
def float_ppl(stories_path, texts):
    llm = LLM(stories_path)
    return [perplexity(llm, t) for t in texts]


@pytest.fixture(scope="module")
def quantized(stories_path):
    """One engine per format for the quality tests (an int4 engine calibrates at load, seconds)."""
    engines: dict[str, LLM] = {}

    def get(quant: str) -> LLM:
        if quant not in engines:
            engines[quant] = LLM(stories_path, quantization=quant)
        return engines[quant]

    return get


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_perplexity_stays_near_float32(quantized, texts, float_ppl, quant):
    llm = quantized(quant)
    for text, base in zip(texts, float_ppl, strict=True):
        ppl = perplexity(llm, text)
        assert ppl / base - 1 <= BOUNDS[quant], (quant, text[:30], ppl, base)
    llm.engine.core.scheduler.kv.pool.check_whole()


@pytest.fixture(scope="module")
def sampled_stories(stories_path) -> list[list[int]]:
    """32 stories of 256 tokens the float model samples from BOS (temperature 1)."""
    llm = LLM(stories_path)
    bos = llm.engine.core.model_config.bos_token_id
    params = [
        SamplingParams(max_tokens=SAMPLED_TOKENS - 1, temperature=1.0, seed=s, ignore_eos=True)
        for s in SAMPLED_SEEDS
    ]
    outs = llm.generate([[bos]] * len(params), params)
    return [[bos, *o.outputs[0].token_ids] for o in outs]


@pytest.fixture(scope="module")
def sampled_float_ppl(stories_path, sampled_stories) -> float:
    return pooled_perplexity(LLM(stories_path), sampled_stories)


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_sampled_stories_stay_near_float32(quantized, sampled_stories, sampled_float_ppl, quant):
    """Measured: int8 +0.13%, int4 +4.4% (+3.7% to +4.4% over calibration seeds)."""
    assert len(sampled_stories) == 32 and all(len(s) == SAMPLED_TOKENS for s in sampled_stories)
    ppl = pooled_perplexity(quantized(quant), sampled_stories)
    assert ppl / sampled_float_ppl - 1 <= SAMPLED_BOUNDS[quant], (quant, ppl, sampled_float_ppl)


@pytest.mark.slow  # seconds of its own: the default run stays short
def test_int4_calibration_beats_rounding_to_nearest(
    stories_path, texts, float_ppl, sampled_stories, sampled_float_ppl
):
    """Rounded to nearest, int4 stays within 12% on each short text; calibrated, it is better
    on the sampled stories (measured: +4.4% against +8.6%)."""
    nearest = LLM(stories_path, quantization="int4", quantization_calibration_tokens=0)
    rises = [perplexity(nearest, t) / b - 1 for t, b in zip(texts, float_ppl, strict=True)]
    assert max(rises) <= NEAREST_BOUND, rises
    calibrated = LLM(stories_path, quantization="int4")
    rise = {
        name: pooled_perplexity(llm, sampled_stories) / sampled_float_ppl - 1
        for name, llm in (("calibrated", calibrated), ("nearest", nearest))
    }
    assert rise["calibrated"] < rise["nearest"], rise


def _int4_weights(llm: LLM) -> list[torch.Tensor]:
    model = llm.engine.core.runner.model
    return [t for m in model.modules() if hasattr(m, "group_size") for t in (m.q, m.scale)]


@pytest.mark.slow  # ~4 s: two calibrations
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
    """The weights' values do not matter here, only their format and kernels: int4 is rounded
    to nearest (no calibration, which would take seconds per engine)."""
    story = held_out_stories[0]
    prompts = [story, story[:90] + " and then", "Lily and Ben"]
    params = SamplingParams(max_tokens=24, temperature=0)
    kw = {"quantization": quant, "quantization_calibration_tokens": 0}
    whole = LLM(stories_path, enable_prefix_caching=False, **kw)
    chunked = LLM(stories_path, max_num_batched_tokens=16, **kw)
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
