"""Random-weight models of every architecture against Hugging Face `transformers` (the reference).

Greedy token ids must be identical to `generate` and logits within 1e-4 relative error, in every
engine mode: one batch of mixed-length prompts, chunked prefill, prefix-cache hits, and
preemption forced by a tiny KV cache.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.models.attention import AttentionMetadata, PrefillChunk

ARCHS = ["llama", "qwen2", "qwen3", "mistral"]
NEW_TOKENS = 32
PROMPT_LENS = [3, 17, 40, 9, 64]


@pytest.fixture(scope="module")
def hf_models(tiny_models):
    from transformers import AutoModelForCausalLM

    models = {}
    for arch, path in tiny_models.items():
        m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        m.generation_config.eos_token_id = None  # compare full-length greedy runs
        models[arch] = m
    return models


def make_prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, n).tolist() for n in PROMPT_LENS]


def hf_greedy(model, prompt: list[int]) -> tuple[list[int], list[float]]:
    """Reference tokens and the log-probability of each chosen token."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    tokens = out.sequences[0, len(prompt) :].tolist()
    lps = [torch.log_softmax(lg[0].float(), -1)[t].item() for lg, t in zip(out.logits, tokens)]
    return tokens, lps


@pytest.fixture(scope="module")
def references(hf_models):
    refs = {}
    for arch, model in hf_models.items():
        prompts = make_prompts(model.config.vocab_size)
        refs[arch] = (prompts, [hf_greedy(model, p) for p in prompts])
    return refs


GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)

MODES = {
    "batched": {},
    "chunked_prefill": {"max_num_batched_tokens": 16},
    "tiny_kv_preemption": {"num_kv_blocks": 12, "block_size": 8, "max_num_batched_tokens": 64},
}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("mode", list(MODES))
def test_greedy_matches_transformers(arch, mode, tiny_models, references):
    prompts, refs = references[arch]
    llm = LLM(tiny_models[arch], **MODES[mode])
    outs = llm.generate(prompts, GREEDY)
    for out, (ref_tokens, ref_lps) in zip(outs, refs):
        assert out.token_ids == ref_tokens
        lps = [lp.logprob for lp in out.outputs[0].logprobs]
        np.testing.assert_allclose(lps, ref_lps, rtol=1e-4, atol=1e-4)
    if mode == "tiny_kv_preemption":
        assert llm.engine.core.scheduler.num_preemptions > 0
    llm.engine.core.kv.pool.check_whole()


# (linear, attention) kernels: the defaults above are whatever "auto" picks here (native on a CPU
# with a compiler); these pin each one, chunked so that steps mix decodes and prefill chunks.
KERNELS = [("torch", "sdpa"), ("onednn", "sdpa"), ("native", "sdpa"), ("native", "native")]
# every pair on llama, the native pairs on every architecture; the rest in the slow suite
KERNEL_CASES = [
    pytest.param(a, k, marks=pytest.mark.slow) if a != "llama" and "native" not in k else (a, k)
    for a in ARCHS
    for k in KERNELS
]


@pytest.mark.parametrize(
    ("arch", "kernels"), KERNEL_CASES, ids=lambda v: "+".join(v) if isinstance(v, tuple) else v
)
def test_every_kernel_backend_matches_transformers(arch, kernels, tiny_models, references):
    from pdserve.kernels import build

    if "native" in kernels and not build.compiler_present():
        pytest.skip("no C compiler here for the native kernels")
    linear_backend, attention_backend = kernels
    prompts, refs = references[arch]
    llm = LLM(
        tiny_models[arch],
        max_num_batched_tokens=16,
        linear_backend=linear_backend,
        attention_backend=attention_backend,
    )
    model = llm.engine.core.runner.model
    layer = {"torch": "Linear", "onednn": "PackedLinear", "native": "NativeLinear"}
    assert type(model.layers[0].mlp.down_proj).__name__ == layer[linear_backend]
    assert model.attn_backend.name == {"sdpa": "paged_sdpa"}.get(attention_backend, "native")
    # norms, rotary embedding and MLP activation: native kernels with any but torch's matmuls
    assert model.layers[0].mlp.native == model.norm.native == (linear_backend != "torch")
    outs = llm.generate(prompts, GREEDY)
    for out, (ref_tokens, ref_lps) in zip(outs, refs):
        assert out.token_ids == ref_tokens
        lps = [lp.logprob for lp in out.outputs[0].logprobs]
        np.testing.assert_allclose(lps, ref_lps, rtol=1e-4, atol=1e-4)
    llm.engine.core.kv.pool.check_whole()


@pytest.mark.parametrize("arch", ARCHS)
def test_prefix_cache_hits_match_transformers(arch, tiny_models, references):
    prompts, refs = references[arch]
    llm = LLM(tiny_models[arch], block_size=4)
    llm.generate(prompts, GREEDY)  # warm the cache with the prompts and their continuations
    outs = llm.generate(prompts, GREEDY)
    assert all(o.metrics.num_cached_tokens > 0 for o in outs if len(o.prompt_token_ids) > 4)
    for out, (ref_tokens, _) in zip(outs, refs):
        assert out.token_ids == ref_tokens
    llm.engine.core.kv.pool.check_whole()


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("mlp_chunk_rows", [None, 16], ids=["mlp_whole", "mlp_chunked"])
def test_prefill_logits_match_transformers_forward(arch, mlp_chunk_rows, tiny_models, hf_models):
    prompt = make_prompts(hf_models[arch].config.vocab_size, seed=1)[2]
    with torch.no_grad():
        ref = hf_models[arch](torch.tensor([prompt])).logits[0]  # [L, V]
    llm = LLM(tiny_models[arch])
    runner = llm.engine.core.runner
    if mlp_chunk_rows:  # the MLP in row chunks, as a long CPU prefill runs it
        assert len(prompt) > 2 * mlp_chunk_rows
        for layer in runner.model.layers:
            layer.mlp.chunk_rows = mlp_chunk_rows
    else:
        assert all(len(prompt) <= layer.mlp.chunk_rows for layer in runner.model.layers)
    n = len(prompt)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n), prefills=[PrefillChunk(0, n, None, None)]
    )
    hidden = runner.model(torch.tensor(prompt), torch.arange(n), runner.kv_caches, meta)
    got = runner.model.compute_logits(hidden)
    rel = (got - ref).abs().max() / ref.abs().max()
    assert rel < 1e-4


LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}


def test_llama3_rope_scaling_and_sharded_checkpoint_match_transformers(tmp_path):
    """rope_scaling of type llama3 (a short original context so every band is exercised), loaded
    from a checkpoint sharded with model.safetensors.index.json."""
    from transformers import AutoModelForCausalLM

    from pdserve.models.make import write_random_model

    path = write_random_model(
        tmp_path / "m", "llama-tiny", seed=5, rope_scaling=LLAMA3_ROPE, max_shard_size="200KB"
    )
    assert (path / "model.safetensors.index.json").is_file()
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    prompts = make_prompts(hf.config.vocab_size, seed=3)
    outs = LLM(str(path)).generate(prompts, GREEDY)
    for out, prompt in zip(outs, prompts):
        ref_tokens, ref_lps = hf_greedy(hf, prompt)
        assert out.token_ids == ref_tokens
        lps = [lp.logprob for lp in out.outputs[0].logprobs]
        np.testing.assert_allclose(lps, ref_lps, rtol=1e-4, atol=1e-4)
