"""The fused decode step (`pdserve/models/fused_decode.py`) against the layer-by-layer modules.

Same model, same cache: a decode step of several sequences with different context lengths runs
once through the fused native layers and once through the torch modules, on copies of the
cache; the hidden states and the K/V rows written must agree to float32 rounding, for every
architecture, with quantized weights and with the int8 KV cache. End to end, engines with and
without `enforce_eager` produce the same greedy tokens (and transformers' tokens are checked
with the fused step on by tests/model/test_vs_transformers.py, whose engines use the defaults).
"""

from __future__ import annotations

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.kernels import build
from pdserve.models.attention import AttentionMetadata
from pdserve.models.kv_quant import dequantize_rows, quantize_rows

pytestmark = pytest.mark.skipif(not build.compiler_present(), reason="no C compiler here")

CONTEXTS = [1, 9, 30, 17]  # each decode's context, its own new token included
BLOCK = 4


def decode_step(llm: LLM, seed: int = 0):
    """Fill the cache's first slots with random K/V for each context, then lay out a decode
    step (ids, positions, metadata) in which sequence s attends to its own blocks."""
    runner = llm.engine.core.runner
    g = torch.Generator().manual_seed(seed)
    for cache in runner.kv_caches:
        if cache.dtype == torch.int8:
            shape = (*cache.shape[:-1], cache.shape[-1] - 4)
            cache.copy_(quantize_rows(torch.randn(shape, generator=g)))
        else:
            cache.copy_(torch.randn(cache.shape, generator=g))
    max_ctx = max(CONTEXTS)
    blocks_per_seq = -(-max_ctx // BLOCK)
    slots = torch.zeros(len(CONTEXTS), max_ctx, dtype=torch.long)
    for s, n in enumerate(CONTEXTS):  # sequence s owns blocks s*bps .. in reverse order
        blocks = torch.arange(blocks_per_seq).flip(0) + s * blocks_per_seq
        all_slots = (blocks[:, None] * BLOCK + torch.arange(BLOCK)).flatten()
        slots[s, :n] = all_slots[:n]
    lens = torch.tensor(CONTEXTS)
    meta = AttentionMetadata(
        slot_mapping=slots[torch.arange(len(CONTEXTS)), lens - 1].clone(),
        num_decodes=len(CONTEXTS),
        decode_slots=slots,
        decode_mask=(torch.arange(max_ctx)[None] < lens[:, None])[:, None, None, :],
        decode_lens=lens,
    )
    ids = torch.randint(3, llm.engine.core.model_config.vocab_size, (len(CONTEXTS),), generator=g)
    return runner, ids, lens - 1, meta


def both_paths(llm: LLM):
    runner, ids, positions, meta = decode_step(llm)
    model = runner.model
    assert model.fused_decode is not None
    caches = [c.clone() for c in runner.kv_caches]
    fused = model(ids, positions, runner.kv_caches, meta)
    fused_caches = [c.clone() for c in runner.kv_caches]
    kept, model.fused_decode = model.fused_decode, None
    try:
        eager = model(ids, positions, caches, meta)
    finally:
        model.fused_decode = kept
    return fused, eager, fused_caches, caches, meta.slot_mapping


ENGINES = {
    "float32": {},
    "int8 weights": {"quantization": "int8"},
    "int4 weights": {"quantization": "int4"},
    "int8 KV": {"kv_cache_dtype": "int8"},
}


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
@pytest.mark.parametrize("engine", list(ENGINES))
def test_fused_step_matches_the_modules(arch, engine, tiny_models):
    llm = LLM(tiny_models[arch], block_size=BLOCK, num_kv_blocks=64, **ENGINES[engine])
    fused, eager, fused_caches, eager_caches, new_slots = both_paths(llm)
    torch.testing.assert_close(fused, eager, rtol=1e-5, atol=1e-5)
    others = torch.ones(fused_caches[0].shape[1], dtype=torch.bool)
    others[new_slots] = False
    for a, b in zip(fused_caches, eager_caches):
        assert torch.equal(a[:, others], b[:, others])  # only the new tokens' rows written
        if a.dtype == torch.int8:  # a value may round to the next step where inputs differ in ulps
            step = b[..., -4:].contiguous().view(torch.float32)
            diff = (dequantize_rows(a, torch.float32) - dequantize_rows(b, torch.float32)).abs()
            assert (diff <= step * 1.001 + 1e-6).all()
        else:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("engine", list(ENGINES))
def test_the_fused_step_computes_the_heads_logits_and_argmax_in_the_same_call(engine, tiny_models):
    """A decode step asked for its logits gets them from the fused call (the head on its native
    kernel), equal to the head run apart on the same hidden states, and asked for its greedy
    tokens, torch's argmax of them; without a native head the caller is told to compute them
    (None)."""
    llm = LLM(tiny_models["llama"], block_size=BLOCK, num_kv_blocks=64, **ENGINES[engine])
    runner, ids, positions, meta = decode_step(llm)
    model = runner.model
    assert model.fused_decode.head is not None
    hidden, head = model(ids, positions, runner.kv_caches, meta, with_logits=True, greedy=True)
    assert head.logits.shape == (len(CONTEXTS), model.config.vocab_size)
    torch.testing.assert_close(head.logits, model.compute_logits(hidden), rtol=0, atol=0)
    assert head.greedy == head.logits.argmax(dim=-1).tolist()
    _, plain = model(ids, positions, runner.kv_caches, meta, with_logits=True)
    assert plain.greedy is None and torch.equal(plain.logits, head.logits)
    model.fused_decode.head = None
    hidden2, none = model(ids, positions, runner.kv_caches, meta, with_logits=True, greedy=True)
    assert none is None
    torch.testing.assert_close(hidden2, hidden)


def test_the_native_argmax_is_torchs_on_ties_infinities_and_nans():
    """The fused step's argmax picks what torch.argmax picks: the first of equal maxima, and a
    NaN over any number (the first NaN), wherever they sit: vector lanes and the tail."""
    from pdserve.kernels.decode import argmax_rows

    vocab = 32003  # not a multiple of any vector width: a scalar tail
    g = torch.Generator().manual_seed(1)
    rows = []
    for where in (0, 1, 15, 16, 17, vocab // 2, vocab - 2, vocab - 1):
        row = torch.randn(vocab, generator=g)
        row[where] = 50.0
        rows.append(row.clone())
        row[vocab - 1 - where // 2] = 50.0  # a tie, after it or before it
        rows.append(row.clone())
        row[where // 3 + 1] = float("nan")
        row[vocab - 1] = float("nan")
        rows.append(row.clone())
    rows.append(torch.full((vocab,), float("-inf")))
    rows.append(torch.full((vocab,), 3.0))
    x = torch.stack(rows)
    assert argmax_rows(x).tolist() == x.argmax(dim=-1).tolist()


@pytest.mark.slow  # seconds of its own: the default run stays short
def test_enforce_eager_and_layer_hooks_turn_it_off_and_tokens_do_not_change(tiny_models):
    prompts = [[5, 6, 7, 8, 9] * 6, [10, 11, 12], list(range(20, 60))]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    fused = LLM(tiny_models["llama"])
    eager = LLM(tiny_models["llama"], enforce_eager=True)
    assert fused.engine.core.runner.model.fused_decode is not None
    assert eager.engine.core.runner.model.fused_decode is None
    a, b = fused.generate(prompts, params), eager.generate(prompts, params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    fused.engine.core.runner.add_layer_hook(lambda i: None)
    assert fused.engine.core.runner.model.fused_decode is None


@pytest.mark.slow  # seconds of its own: the default run stays short
def test_hooks_that_only_some_steps_want_keep_the_fused_step_for_the_rest(tiny_models):
    """A KV sender's hooks are wanted only by steps with rows to ship: other decode-only steps
    stay fused (the hooks do not fire there), and the tokens are those of the modules."""
    prompts = [[5, 6, 7, 8, 9] * 6, [10, 11, 12], list(range(20, 60))]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want = [False]
    fired: list[int] = []
    llm = LLM(tiny_models["llama"])
    fused_calls = []
    model = llm.engine.core.runner.model
    fused = model.fused_decode
    model.fused_decode = lambda *a: fused_calls.append(1) or fused(*a)
    llm.engine.core.runner.add_layer_hook(fired.append, wanted=lambda: want[0])
    assert model.fused_decode is not None
    out = llm.generate(prompts, params)
    eager = LLM(tiny_models["llama"], enforce_eager=True).generate(prompts, params)
    assert [o.token_ids for o in out] == [o.token_ids for o in eager]
    num_layers = len(model.layers)
    # hooks fired in the prefill steps only, every layer; decode steps were fused
    assert fused_calls and fired and len(fired) % num_layers == 0
    fired.clear()
    fused_calls.clear()
    want[0] = True  # now every step wants them: none is fused, every layer fires
    llm.generate(prompts, params)
    assert not fused_calls and len(fired) >= 24 * num_layers


def test_a_custom_attention_backend_keeps_the_modules(tiny_models):
    llm = LLM(tiny_models["llama"], attention_backend="sdpa")
    assert llm.engine.core.runner.model.fused_decode is None
    llm = LLM(tiny_models["llama"], linear_backend="torch")
    assert llm.engine.core.runner.model.fused_decode is None
