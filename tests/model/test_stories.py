"""The real trained tiny Llama: greedy text equals its documented continuation in every mode."""

from __future__ import annotations

import pytest

from pdserve import LLM, SamplingParams

GREEDY_200 = SamplingParams(temperature=0, max_tokens=200)


@pytest.fixture(scope="module")
def llm(stories_path):
    return LLM(stories_path)


def assert_pool_whole(llm: LLM) -> None:
    llm.engine.core.kv.pool.check_whole()


def test_greedy_from_bos_matches_reference(llm, stories_reference_text):
    out = llm.generate([[1]], GREEDY_200)[0]
    assert out.text == stories_reference_text
    assert len(out.token_ids) == 200
    assert out.finish_reason == "length"
    assert_pool_whole(llm)


def test_chunked_prefill_chunk_16_matches_reference(stories_path, stories_reference_text, llm):
    # Prefix caching off: the prompt below is the reference text, which would be all cached.
    chunked = LLM(stories_path, max_num_batched_tokens=16, enable_prefix_caching=False)
    out = chunked.generate([[1]], GREEDY_200)[0]
    assert out.text == stories_reference_text
    # A long prompt (the reference itself) must be prefilled over several chunks of 16.
    ids = llm.tokenizer.encode(stories_reference_text)[:120]
    params = SamplingParams(temperature=0, max_tokens=40)
    want = llm.generate([ids], params)[0].token_ids
    got = chunked.generate([ids], params)[0].token_ids
    assert got == want
    assert chunked.engine.core.stats.totals["prefill"].steps >= 120 // 16
    assert_pool_whole(chunked)


def test_prefix_cache_hit_on_repeated_prompt(stories_path, stories_reference_text):
    llm = LLM(stories_path)
    prompt = stories_reference_text[:300]
    params = SamplingParams(temperature=0, max_tokens=64)
    first = llm.generate([prompt], params)[0]
    hits_before = llm.engine.core.kv.stats.hits
    second = llm.generate([prompt], params)[0]
    assert second.metrics.num_cached_tokens > 0
    assert llm.engine.core.kv.stats.hits - hits_before == second.metrics.num_cached_tokens
    assert second.token_ids == first.token_ids
    # From BOS with the cache warm: still the reference text.
    llm.generate([[1]], GREEDY_200)
    assert llm.generate([[1]], GREEDY_200)[0].text == stories_reference_text
    assert_pool_whole(llm)


def test_batch_of_8_mixed_lengths_matches_single_runs(llm, stories_reference_text):
    ids = llm.tokenizer.encode(stories_reference_text)
    prompts = [[1]] + [ids[:n] for n in (2, 5, 9, 17, 33, 64, 100)]
    params = [GREEDY_200] + [SamplingParams(temperature=0, max_tokens=60)] * 7
    singles = [llm.generate([p], sp)[0] for p, sp in zip(prompts, params)]
    batch = llm.generate(prompts, params)
    assert batch[0].text == stories_reference_text
    for s, b in zip(singles, batch):
        assert b.token_ids == s.token_ids
    assert_pool_whole(llm)
