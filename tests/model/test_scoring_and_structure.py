"""Prompt logprobs against transformers, `max_tokens=0`, and grammar-constrained generation in
the offline engine: batched with free requests, chunked, sampled with n > 1."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.structured import spec

STORY = (
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the "
    "park. One day, she saw a big, red ball."
)


@pytest.fixture(scope="module")
def llm(stories_path):
    return LLM(stories_path, max_num_batched_tokens=32)  # long prompts are chunked


@pytest.fixture(scope="module")
def hf(stories_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(stories_path, dtype=torch.float32).eval()


def hf_prompt_logprobs(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logprobs = model(torch.tensor([ids])).logits[0].float().log_softmax(-1)  # [n, vocab]
    return logprobs


@pytest.mark.parametrize("modes", [{}, {"num_kv_blocks": 10, "block_size": 8}])
def test_prompt_logprobs_match_transformers_chunked_and_preempted(stories_path, hf, modes):
    """The prompt is chunked (budget 32); with a tiny KV cache the batch also preempts."""
    llm = LLM(stories_path, max_num_batched_tokens=32, **modes)
    prompts = [STORY, STORY[:60], "Tim and Sam"]
    outs = llm.generate(prompts, SamplingParams(max_tokens=20, temperature=0, prompt_logprobs=3))
    preempted = sum(o.outputs[0].metrics.num_preemptions for o in outs)
    assert preempted > 0 if modes else preempted == 0
    for out in outs:
        ids = out.prompt_token_ids
        ref = hf_prompt_logprobs(hf, ids)
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
        for i, lp in enumerate(out.prompt_logprobs[1:], start=1):
            assert lp.token_id == ids[i]
            assert lp.logprob == pytest.approx(ref[i - 1, ids[i]].item(), abs=1e-4)
            assert lp.rank == int((ref[i - 1] > ref[i - 1, ids[i]]).sum()) + 1
            top_ids = ref[i - 1].topk(3).indices.tolist()
            assert [t for t, _ in lp.top] == top_ids


def test_max_tokens_zero_scores_the_prompt_and_generates_nothing(llm, hf):
    outs = llm.generate([STORY, STORY], SamplingParams(max_tokens=0, prompt_logprobs=0))
    for out in outs:
        assert out.outputs[0].token_ids == [] and out.finish_reason == "length"
        ids = out.prompt_token_ids
        total = sum(lp.logprob for lp in out.prompt_logprobs[1:])
        ref = hf_prompt_logprobs(hf, ids)
        assert total == pytest.approx(
            sum(ref[i - 1, ids[i]].item() for i in range(1, len(ids))), abs=1e-3
        )
    llm.engine.core.scheduler.kv.pool.check_whole()


def test_a_prompt_logprob_request_is_never_served_from_the_prefix_cache(llm):
    llm.generate([STORY], SamplingParams(max_tokens=1, temperature=0))  # now cached
    out = llm.generate([STORY], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))[0]
    assert out.outputs[0].metrics.num_cached_tokens == 0
    assert all(lp is not None for lp in out.prompt_logprobs[1:])


NAME_AGE = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


def test_constrained_and_free_requests_share_a_batch(llm):
    free = SamplingParams(max_tokens=24, temperature=0)
    alone = llm.generate([STORY[:40]], free)[0].text
    grammars = [
        spec.json_schema_grammar(NAME_AGE, "guided_json"),
        spec.regex_grammar(r"(yes|no), [a-z ]{1,20}\."),
        spec.choice_grammar([" happy", " sad", " angry"]),
    ]
    params = [SamplingParams(max_tokens=60, temperature=0, grammar=g) for g in grammars]
    outs = llm.generate([STORY[:40], "Lily", "Lily", "Lily was"], [free, *params])
    assert outs[0].text == alone  # masks stay on their own rows
    data = json.loads(outs[1].text)
    assert set(data) == {"name", "age"} and 0 <= data["age"] <= 99 and len(data["name"]) <= 12
    assert re.fullmatch(r"(yes|no), [a-z ]{1,20}\.", outs[2].text)
    assert outs[3].text in (" happy", " sad", " angry")
    assert all(o.finish_reason == "stop" for o in outs[1:])
    llm.engine.core.scheduler.kv.pool.check_whole()


def test_sampled_completions_all_follow_the_grammar(llm):
    regex = r"[A-Z][a-z]{2,8} (ran|sat|sang)\."
    params = SamplingParams(
        n=6, max_tokens=30, temperature=1.0, seed=7, grammar=spec.regex_grammar(regex)
    )
    out = llm.generate([STORY], params)[0]
    texts = [c.text for c in out.outputs]
    assert all(re.fullmatch(regex, t) for t in texts), texts
    assert len(set(texts)) > 1  # sampled, not six copies
    again = llm.generate([STORY], params)[0]
    assert [c.text for c in again.outputs] == texts  # seeded: reproducible


def test_a_grammar_that_cannot_compile_fails_only_its_request(llm):
    bad = SamplingParams(max_tokens=5, grammar='{"grammars": [{"lark_grammar": "start: x"}]}')
    good = SamplingParams(max_tokens=5, temperature=0)
    outs = llm.generate(["Lily", "Lily"], [bad, good])
    assert outs[0].finish_reason == "abort" and "grammar" in outs[0].error
    assert outs[1].finish_reason == "length" and outs[1].text


def test_a_grammar_decides_where_the_output_ends(llm):
    """min_tokens and ignore_eos do not keep a finished grammar going."""
    grammar = spec.choice_grammar([" yes"])
    for extra in ({"min_tokens": 10}, {"ignore_eos": True}):
        params = SamplingParams(max_tokens=20, temperature=0, grammar=grammar, **extra)
        out = llm.generate(["Lily said"], params)[0]
        assert out.text == " yes" and out.finish_reason == "stop"


def test_random_prompts_with_chunked_prefill_score_every_position(tiny_models):
    """A random Qwen3 with a 16-token budget: every chunk boundary is scored exactly once."""
    from transformers import AutoModelForCausalLM

    path = tiny_models["qwen3"]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompt = np.random.default_rng(3).integers(3, model.config.vocab_size, 70).tolist()
    out = LLM(path, max_num_batched_tokens=16).generate(
        [prompt], SamplingParams(max_tokens=0, prompt_logprobs=1)
    )[0]
    ref = hf_prompt_logprobs(model, prompt)
    got = torch.tensor([lp.logprob for lp in out.prompt_logprobs[1:]])
    want = torch.tensor([ref[i - 1, prompt[i]].item() for i in range(1, len(prompt))])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
