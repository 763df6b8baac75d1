"""The int4 calibration (`pdserve.models.calibrate`): its own forward of the model against the
engine's, and GPTQ's rounding against rounding to nearest on a layer's output."""

from __future__ import annotations

import math

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.models.calibrate import _attention, _gated, gptq_int4, sample_text
from pdserve.models.quant_linear import int4_codes, int4_params


def _layer_inputs(tokens=2048, k=96, seed=0, draw=0):
    """Correlated inputs with a few large channels, as a trained model's are: the distribution
    set by `seed`, the tokens drawn by `draw`."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(k, k, generator=g) / math.sqrt(k)
    large = 1 + 4 * (torch.rand(k, generator=g) < 0.1)
    noise = torch.randn(tokens, k, generator=torch.Generator().manual_seed(1000 + draw))
    return (noise @ mix) * large


def _dequant(codes, s, m, group, k):
    return (codes * s.repeat_interleave(group, 1) + m.repeat_interleave(group, 1))[:, :k]


def test_gptq_beats_rounding_to_nearest_on_the_layers_output():
    """On the calibration inputs GPTQ's ||W x - Q x|| is well below rounding to nearest's (the
    same format, the same search for each group's scale and minimum), and on fresh inputs of
    the same distribution too."""
    k, n, group = 96, 64, 32
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(1)) * 0.05
    x, fresh = _layer_inputs(k=k), _layer_inputs(k=k, draw=1)
    codes, s, m = gptq_int4(w, x, x, group)
    q = _dequant(codes, s, m, group, k)
    g = w.view(n, k // group, group)
    ns, nm = int4_params(g)
    nearest = (int4_codes(g, ns, nm) * ns + nm).view(n, k)
    for inputs in (x, fresh):
        ref = inputs @ w.T
        err_gptq = (inputs @ q.T - ref).norm() / ref.norm()
        err_nearest = (inputs @ nearest.T - ref).norm() / ref.norm()
        assert err_gptq < 0.8 * err_nearest, (err_gptq, err_nearest)
    assert codes.min() >= 0 and codes.max() <= 15


def test_gptq_aims_at_the_float_models_output():
    """When the quantized model's inputs differ from the float model's, the target moves so the
    quantized layer on its inputs lands nearer the float layer on the float inputs than a
    quantization that ignores the difference."""
    k, n, group = 64, 48, 32
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(3)) * 0.05
    xf = _layer_inputs(k=k, seed=4)
    xq = xf + 0.1 * _layer_inputs(k=k, seed=5, draw=1)  # the upstream layers' error
    ref = xf @ w.T
    errs = []
    for target_inputs in (xf, xq):  # the float inputs known, or taken as equal to xq
        codes, s, m = gptq_int4(w, target_inputs, xq, group)
        errs.append(((xq @ _dequant(codes, s, m, group, k).T - ref).norm() / ref.norm()).item())
    assert errs[0] < 0.8 * errs[1], errs


def test_a_ragged_last_group_and_a_dead_input_are_handled():
    """K = 40 (the last group 8 wide) and an input that is always zero: finite codes, scales and
    minima, the padding's codes zero."""
    w = torch.randn(16, 40, generator=torch.Generator().manual_seed(6)) * 0.05
    x = _layer_inputs(k=40, seed=7)
    x[:, 5] = 0
    codes, s, m = gptq_int4(w, x, x, 32)
    assert codes.shape == (16, 64) and s.shape == m.shape == (16, 2)
    assert (codes[:, 40:] == 0).all() and torch.isfinite(s).all() and torch.isfinite(m).all()
    q = _dequant(codes, s, m, 32, 40)
    assert ((x @ q.T - x @ w.T).norm() / (x @ w.T).norm()).item() < 0.1


@pytest.mark.slow  # seconds of its own: the default run stays short
def test_the_calibration_forward_is_the_engines(stories_path):
    """The text the calibration samples, run through its own forward (the one it quantizes
    with: causal attention over whole sequences), gives the log-probabilities the engine gives
    for the same tokens."""
    llm = LLM(stories_path, enable_prefix_caching=False)
    model = llm.engine.core.runner.model
    ids = sample_text(model, 96, 48)  # two sequences of 48
    assert ids.shape == (2, 48) and (ids[:, 0] == 1).all()
    with torch.no_grad():
        h = model.embed_tokens(ids)
        for layer in model.layers:
            a, _ = _attention(layer.self_attn, layer.input_layernorm(h), 0, model.rope)
            h = h + layer.self_attn.o_proj(a)
            h = h + layer.mlp.down_proj(_gated(layer.mlp, layer.post_attention_layernorm(h)))
        logp = model.compute_logits(model.norm(h)).log_softmax(-1)
    outs = llm.generate(
        [row.tolist() for row in ids], SamplingParams(max_tokens=0, prompt_logprobs=0)
    )
    for row, out, lp in zip(ids, outs, logp, strict=True):
        want = torch.tensor([p.logprob for p in out.prompt_logprobs[1:]])
        got = lp[:-1].gather(1, row[1:, None])[:, 0]
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    again = sample_text(model, 96, 48)
    assert torch.equal(ids, again)  # a fixed seed
