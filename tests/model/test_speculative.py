"""Speculative decoding end to end: greedy outputs identical to decoding one token at a time, in
every engine mode, with proposals really made and (on the trained model) really accepted; every
KV block returned. Sampled speculation's distribution is tested in tests/unit/test_spec.py."""

from __future__ import annotations

import numpy as np
import pytest

from pdserve import LLM, SamplingParams

ARCHS = ["llama", "qwen2", "qwen3", "mistral"]
MODES = {
    "batched": {},
    "chunked_prefill": {"max_num_batched_tokens": 16},
    "tiny_kv_preemption": {"num_kv_blocks": 14, "block_size": 8, "max_num_batched_tokens": 64},
    "prefix_cache": {"block_size": 4},
}
# Not adaptive: on these tiny models a plain step is so cheap that the adaptive rule would turn
# speculation off, and these tests are about its correctness.
SPEC = {"speculative_method": "ngram", "num_speculative_tokens": 3, "speculative_ngram_min": 1,
        "speculative_adaptive": False}  # fmt: skip


def repetitive_prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    """Prompts whose tokens recur (a random model continues them with ids it has seen, now and
    then), of mixed lengths."""
    rng = np.random.default_rng(seed)
    out = []
    for n, period in ((12, 3), (40, 5), (7, 2), (25, 4)):
        motif = rng.integers(3, vocab, period).tolist()
        out.append((motif * (n // period + 1))[:n])
    return out


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("mode", list(MODES))
def test_greedy_speculation_is_token_for_token_plain_decoding(arch, mode, tiny_models):
    kw = MODES[mode]
    plain = LLM(tiny_models[arch], **kw)
    spec = LLM(tiny_models[arch], **kw, **SPEC)
    prompts = repetitive_prompts(plain.engine.core.model_config.vocab_size)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    if mode == "prefix_cache":  # the second pass hits the cache with speculated blocks
        spec.generate(prompts, params)
    want = [o.token_ids for o in plain.generate(prompts, params)]
    outs = spec.generate(prompts, params)
    assert [o.token_ids for o in outs] == want
    assert all(len(o.token_ids) == 24 for o in outs)  # never past max_tokens
    assert sum(o.metrics.num_spec_proposed for o in outs) > 0
    if mode == "tiny_kv_preemption":
        assert spec.engine.core.scheduler.num_preemptions > 0
    spec.engine.core.kv.pool.check_whole()


def test_the_trained_model_accepts_proposals_and_stays_exact(stories_path, stories_reference_text):
    """stories260K retelling its own reference story: proposals are accepted (several tokens per
    step), outputs equal plain greedy decoding, stop strings and n > 1 included."""
    plain = LLM(stories_path)
    spec = LLM(stories_path, speculative_method="ngram", speculative_adaptive=False)
    text = stories_reference_text[:400]
    params = SamplingParams(temperature=0, max_tokens=150, ignore_eos=True)
    a, b = plain.generate([text], params)[0], spec.generate([text], params)[0]
    assert b.token_ids == a.token_ids
    m = b.metrics
    assert m.num_spec_accepted > 0 and m.num_spec_accepted <= m.num_spec_proposed
    stop = SamplingParams(temperature=0, max_tokens=150, stop=["park"], n=2)
    a, b = plain.generate([text], stop)[0], spec.generate([text], stop)[0]
    assert [c.text for c in b.outputs] == [c.text for c in a.outputs]
    assert [c.finish_reason for c in b.outputs] == [c.finish_reason for c in a.outputs]
    spec.engine.core.kv.pool.check_whole()


def test_sampled_speculation_runs_and_seeded_requests_stay_reproducible(stories_path):
    spec = LLM(stories_path, speculative_method="ngram", speculative_adaptive=False)
    prompt = "Once upon a time, there was a little girl. Once upon a time, there was a"
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=60, ignore_eos=True)
    outs = spec.generate([prompt] * 4, params)
    assert all(len(o.token_ids) == 60 for o in outs)
    assert sum(o.metrics.num_spec_proposed for o in outs) > 0
    # a seed pins the tokens, so a seeded sampled request does not speculate
    seeded = SamplingParams(temperature=0.8, max_tokens=60, seed=3, ignore_eos=True)
    a, b = (spec.generate([prompt], seeded)[0] for _ in range(2))
    assert a.token_ids == b.token_ids and a.metrics.num_spec_proposed == 0
    spec.engine.core.kv.pool.check_whole()
