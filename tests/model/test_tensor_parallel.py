"""Tensor parallelism (`tensor_parallel_size=2`): the same greedy tokens and logprobs as one rank
(which tests/model/test_vs_transformers.py holds to transformers), with chunked prefill and
prefix caching; quantized weights, each rank quantizing its shard; a draft model on rank 0, a
draft of the first layers on every rank; KV offload tiers holding every rank's rows; what the
split cannot take yet is refused before anything starts; a follower that dies fails the next
step at once with the reason. Tensor-parallel prefill and decode workers are in
tests/e2e/test_disagg.py."""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest

from pdserve import LLM, SamplingParams

ARCHS = ["llama", "qwen2", "qwen3", "mistral"]
# chunked prefill (8-token chunks) and prefix caching (4-token blocks shared by the prompts
# that start alike) in one engine
MODES = {"max_num_batched_tokens": 8, "block_size": 4, "enable_prefix_caching": True}


def prompts(vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(3)
    shared = rng.integers(3, vocab, 12).tolist()
    return [
        shared + rng.integers(3, vocab, 9).tolist(),
        shared + rng.integers(3, vocab, 3).tolist(),
        rng.integers(3, vocab, 5).tolist(),
        rng.integers(3, vocab, 30).tolist(),
    ]


def run(path: str, **kw):
    llm = LLM(path, num_threads=1, **MODES, **kw)
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=1, ignore_eos=True)
    vocab = llm.engine.core.model_config.vocab_size
    outs = llm.generate(prompts(vocab), params)
    core = llm.engine.core
    assert core.kv.num_free_blocks() == core.kv.num_blocks  # every block back (cached ones too)
    tokens = [o.outputs[0].token_ids for o in outs]
    logprobs = [[lp.logprob for lp in o.outputs[0].logprobs] for o in outs]
    hits = core.scheduler.stats().prefix_hits
    llm.close()
    return tokens, logprobs, hits


def check_same_as_one_rank(path: str) -> None:
    want_tokens, want_lps, want_hits = run(path)
    tokens, lps, hits = run(path, tensor_parallel_size=2)
    assert tokens == want_tokens
    for got, want in zip(lps, want_lps):
        assert got == pytest.approx(want, abs=1e-4)
    assert hits == want_hits > 0  # the shared prefix was served from the cache


@pytest.mark.slow  # seconds of its own: the default run stays short
def test_two_ranks_decode_as_one_on_the_trained_model(stories_path):
    check_same_as_one_rank(stories_path)


@pytest.mark.slow
def test_prompt_lookup_speculation_across_ranks(stories_path):
    """Verification runs on rank 0's logits; the followers run the verifying forward too."""
    spec = {"speculative_method": "ngram", "num_speculative_tokens": 3,
            "speculative_ngram_min": 1, "speculative_adaptive": False}  # fmt: skip
    story = "Once upon a time, there was a little girl named Lily. Lily liked to play. Lily"
    params = SamplingParams(temperature=0, max_tokens=24)
    plain = LLM(stories_path, num_threads=1)
    want = plain.generate([story], params)[0].outputs[0].token_ids
    llm = LLM(stories_path, tensor_parallel_size=2, **spec)
    try:
        out = llm.generate([story], params)[0]
        assert out.outputs[0].token_ids == want
        assert out.metrics.num_spec_accepted > 0  # proposals were verified across the ranks
    finally:
        llm.close()


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_two_ranks_decode_as_one_for_every_architecture(tiny_models, arch):
    check_same_as_one_rank(tiny_models[arch])


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"tensor_parallel_size": 3}, "num_heads=8 does not divide by it"),
    ],
)
def test_what_the_split_cannot_take_is_refused(stories_path, kw, match):
    with pytest.raises(ValueError, match=match):
        LLM(stories_path, **kw)


# Perplexity of the sharded model over one rank's with the same quantization, per text, measured
# in the same run. One rank's own bounds against float32 (int8 1%, int4 rounded to nearest 12%)
# are test_quantization.py's; sharding adds to them and how much depends on the machine's float
# arithmetic, so the sharded model is held against one rank's, not against float32 again.
# Measured (AMD Zen 1, AVX2): int8 +0.0% to +0.8%, int4 -1.4% to +2.2%.
SHARD_BOUNDS = {"int8": 0.02, "int4": 0.04}


def _perplexity(llm, text: str) -> float:
    out = llm.generate([text], SamplingParams(max_tokens=0, prompt_logprobs=0))[0]
    lps = [lp.logprob for lp in out.prompt_logprobs[1:]]
    return float(np.exp(-np.mean(lps)))


@pytest.mark.slow  # 13 s for int8 (the default run keeps under 5 minutes)
@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_quantized_shards(stories_path, held_out_stories, quant):
    """Each rank quantizes its own shard at load (int4: rounded to nearest, as one rank does
    with `quantization_calibration_tokens=0`). The row-split projections (o_proj, down_proj)
    then round their activations over half a row, and int4's groups of 32 no longer line up
    where half a row is not a multiple of 32 (the tiny model's down_proj: 172 = 2 x 86), so the
    numbers are not one rank's. The bounds: the same first 16 greedy tokens as one rank, and
    perplexity within SHARD_BOUNDS of one rank's on each held-out story."""
    prompt = "Once upon a time, there was a little"
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    one = LLM(stories_path, quantization=quant, quantization_calibration_tokens=0)
    want = one.generate([prompt], params)[0].outputs[0].token_ids
    one_ppl = [_perplexity(one, t) for t in held_out_stories]
    one.close()
    llm = LLM(stories_path, quantization=quant, tensor_parallel_size=2)
    try:
        assert llm.generate([prompt], params)[0].outputs[0].token_ids == want
        for text, ref in zip(held_out_stories, one_ppl, strict=True):
            assert abs(_perplexity(llm, text) / ref - 1) <= SHARD_BOUNDS[quant], text[:30]
        core = llm.engine.core
        assert core.kv.num_free_blocks() == core.kv.num_blocks
    finally:
        llm.close()


@pytest.mark.slow  # 15 s each
@pytest.mark.parametrize("kind", ["cpu", "disk"])
def test_kv_offload_moves_every_ranks_rows(stories_path, tmp_path, kind):
    """Returning turns whose history was evicted from a small pool load it back from the tier,
    followers' rows included: the same tokens as the split engine without a tier (a follower
    reading stale rows would change them), every history from the tier, every block back."""
    from test_kv_offload_engine import ALWAYS, SMALL_POOL, run_one_by_one, sessions, tiers

    plain = LLM(stories_path, **SMALL_POOL, tensor_parallel_size=2)
    prompts = sessions(plain.engine.core.model_config.vocab_size)
    try:
        want = run_one_by_one(plain, prompts)
        assert plain.engine.core.kv.stats.hits == 0  # without a tier: recomputed
    finally:
        plain.close()
    llm = LLM(stories_path, **SMALL_POOL, tensor_parallel_size=2, **ALWAYS,
              kv_offload=tiers(kind, tmp_path))  # fmt: skip
    try:
        assert run_one_by_one(llm, prompts) == want
        core = llm.engine.core
        core.kv.pool.check_whole()
        assert core.kv.tier.flush()
        assert core.kv.stats.tier_hits == 6 * 80 and core.kv.tier.state().loaded_blocks == 60
        # a tier's payload is both ranks' rows of a block
        assert core.kv.tier.payload_bytes == 2 * core.runner.kv_bytes_per_block
    finally:
        llm.close()


@pytest.mark.slow
def test_a_draft_model_runs_whole_on_rank_0(stories_path, tmp_path):
    """The draft (here the first 3 layers as a folder of its own) is not split: rank 0 runs it
    alone and its proposals are verified by the split model, token for token plain decoding."""
    from test_speculative import DRAFT, first_layers

    prompt = "Once upon a time, there was a little girl named Lily."
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want = LLM(stories_path).generate([prompt], params)[0].outputs[0].token_ids
    draft = first_layers(stories_path, tmp_path / "draft", 3)
    llm = LLM(stories_path, tensor_parallel_size=2, draft_model=draft, **DRAFT)
    try:
        out = llm.generate([prompt], params)[0]
        assert out.outputs[0].token_ids == want
        assert out.metrics.num_spec_accepted > 0
        assert llm.engine.core.runner.draft_config.num_kv_heads == 4  # whole: not a shard
        llm.engine.core.kv.pool.check_whole()
    finally:
        llm.close()


@pytest.mark.slow
def test_a_draft_of_the_first_layers_runs_on_every_rank(stories_path):
    """Self-speculation with split layers: each draft forward runs the first layers on every
    rank (the step broadcast says how many) and writes their split caches, so the split engine
    proposes what one rank proposes, and decodes plain decoding's tokens."""
    from test_speculative import DRAFT

    prompt = "Once upon a time, there was a little girl named Lily."
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want = LLM(stories_path).generate([prompt], params)[0].outputs[0].token_ids
    one = LLM(stories_path, draft_layers=3, num_threads=1, **DRAFT)
    ref = one.generate([prompt], params)[0].metrics
    llm = LLM(stories_path, tensor_parallel_size=2, draft_layers=3, **DRAFT)
    try:
        out = llm.generate([prompt], params)[0]
        assert out.outputs[0].token_ids == want
        assert out.metrics.num_spec_accepted == ref.num_spec_accepted > 0
        assert out.metrics.num_spec_proposed == ref.num_spec_proposed
        llm.engine.core.kv.pool.check_whole()
    finally:
        llm.close()


@pytest.mark.slow
def test_a_dead_follower_fails_the_next_step(stories_path):
    llm = LLM(stories_path, tensor_parallel_size=2)
    try:
        params = SamplingParams(temperature=0, max_tokens=4)
        assert llm.generate(["Once upon a time"], params)[0].outputs[0].token_ids
        runner = llm.engine.core.runner
        # this rank holds half the heads, in its weights and in its KV cache
        assert runner.shard_config.num_kv_heads * 2 == runner.config.num_kv_heads
        assert runner.kv_caches[0].shape[2] == runner.shard_config.num_kv_heads
        (follower,) = runner.tp.procs
        os.kill(follower.pid, signal.SIGKILL)
        follower.wait()
        with pytest.raises(RuntimeError, match="closed by peer|Connection reset"):
            llm.generate(["Once upon a time"], params)
    finally:
        llm.close()


@pytest.mark.slow  # 9 s
def test_num_threads_runs_that_many_unpinned_threads_per_rank(stories_path):
    """`--num-threads N` with tensor parallelism (what a Ray worker gets from the CPUs it
    reserves per rank): the followers start with N threads and no CPU set of their own, and the
    ranks still compute one rank's tokens."""
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want = LLM(stories_path).generate(["Once upon a time"], params)[0].outputs[0].token_ids
    llm = LLM(stories_path, tensor_parallel_size=2, num_threads=1)
    try:
        (follower,) = llm.engine.core.runner.tp.procs
        assert "--cpus" not in follower.args
        assert follower.args[follower.args.index("--threads") + 1] == "1"
        assert llm.generate(["Once upon a time"], params)[0].outputs[0].token_ids == want
    finally:
        llm.close()
