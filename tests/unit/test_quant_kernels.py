"""The native int8/int4 kernels against a plain float reference of the same quantized weights,
and the quantizers' own round trip."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from pdserve.kernels import build
from pdserve.kernels import linear as kernels
from pdserve.models.quant_linear import (
    Int4Linear,
    Int8Linear,
    dequantize_int4,
    dequantize_int8,
    quantize_int4,
    quantize_int8,
)

# Where a compiler is present the kernels must build: a failed build fails these tests.
needs_native = pytest.mark.skipif(not build.compiler_present(), reason="no C compiler here")

# (N, K): whole blocks; N not a multiple of 64 (padded channels); K not a multiple of 16 or of
# the int4 group (padded input features); the shapes of the real tiny model (172 = 4 * 43)
SHAPES = [(128, 256), (100, 64), (64, 172), (172, 64), (512, 96)]
ROWS = [1, 2, 5, 6, 7, 13, 64]


def weight(n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g) * 0.05


def test_int8_round_trip_is_within_half_a_step():
    w = weight(100, 70)
    q, scale = quantize_int8(w)
    err = (dequantize_int8(q, scale, 100) - w).abs()
    assert (err <= scale[:100, None] / 2 + 1e-7).all()
    assert q.shape == (128 // 16, 70, 16) and q.dtype == torch.int8


@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_round_trip_is_within_half_a_step_and_uses_the_extreme(group):
    """Half a step, but a full one for a value opposite in sign to the group's extreme and as
    large (+8 steps clips to +7)."""
    w = weight(70, 200)
    q, scale = quantize_int4(w, group)
    back = dequantize_int4(q, scale, 70, 200, group)
    groups = -(-200 // group)
    s = scale.transpose(1, 2).reshape(-1, groups)[:70].repeat_interleave(group, 1)[:, :200]
    err, step = (back - w).abs(), s.abs()
    inside = (w / s).abs() <= 7.5
    assert (err[inside] <= step[inside] / 2 + 1e-7).all() and (err <= step + 1e-7).all()
    # the value of largest magnitude in each group is represented exactly (it maps to -8)
    padded = F.pad(w, (0, groups * group - 200)).view(70, groups, group)
    idx = padded.abs().argmax(-1)
    exact = (
        F.pad(back, (0, groups * group - 200)).view(70, groups, group).gather(-1, idx[..., None])
    )
    torch.testing.assert_close(exact.squeeze(-1), padded.gather(-1, idx[..., None]).squeeze(-1))


def test_quantizers_reject_a_group_size_the_kernel_cannot_read():
    with pytest.raises(ValueError, match="group size"):
        quantize_int4(weight(4, 64), 48)


@needs_native
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("rows", ROWS)
def test_int8_kernel_matches_the_dequantized_product(n, k, rows):
    w, x = weight(n, k), torch.randn(rows, k)
    layer = Int8Linear(w, None, native=True)
    ref = x @ layer.dequantize().T
    torch.testing.assert_close(layer(x), ref, rtol=1e-4, atol=1e-4)


@needs_native
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("group", [32, 128])
def test_int4_kernel_matches_the_dequantized_product(n, k, rows, group):
    w, x = weight(n, k), torch.randn(rows, k)
    layer = Int4Linear(w, None, native=True, group_size=group)
    ref = x @ layer.dequantize().T
    torch.testing.assert_close(layer(x), ref, rtol=1e-4, atol=1e-4)


@needs_native
def test_layers_keep_leading_dims_add_the_bias_and_agree_with_the_fallback():
    w, b, x = weight(96, 64), torch.randn(96), torch.randn(2, 3, 64)
    for make in (lambda nat: Int8Linear(w, b, nat), lambda nat: Int4Linear(w, b, nat, 32)):
        fast, slow = make(True)(x), make(False)(x)
        assert fast.shape == (2, 3, 96)
        torch.testing.assert_close(fast, slow, rtol=1e-4, atol=1e-4)


@needs_native
def test_quantized_products_are_close_to_float():
    """The error budget of the formats themselves (random Gaussian weights): int8 per channel
    under 1.5% relative, int4 in groups of 32 under 12%."""
    w, x = weight(256, 512), torch.randn(8, 512)
    ref = x @ w.T
    for layer, bound in ((Int8Linear(w), 0.015), (Int4Linear(w, group_size=32), 0.12)):
        assert ((layer(x) - ref).norm() / ref.norm()).item() < bound


@needs_native
def test_kernels_give_the_same_result_on_one_thread_and_two():
    w, x = weight(256, 128), torch.randn(3, 128)
    layer = Int8Linear(w)
    before = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2):
            torch.set_num_threads(n)
            outs.append(layer(x))
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(outs[0], outs[1])


@needs_native
def test_activations_of_the_wrong_shape_or_dtype_are_refused():
    layer = Int8Linear(weight(64, 32), None)
    with pytest.raises(ValueError, match="float32"):
        kernels.int8_linear(torch.randn(2, 32).double(), layer.q, layer.scale, 64)
    with pytest.raises(ValueError, match=r"\[\.\.\., 32\]"):
        kernels.int8_linear(torch.randn(2, 31), layer.q, layer.scale, 64)
    with pytest.raises(ValueError, match="group size 48"):
        kernels.int4_linear(torch.randn(1, 64), torch.zeros(4, 32, 16, dtype=torch.uint8),
                            torch.ones(4, 2, 16), 64, 64, 48)  # fmt: skip


def test_a_machine_without_a_compiler_gets_a_reason_not_a_crash(tmp_path, monkeypatch):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert not build.compiler_present()  # what the kernel tests skip on
    with pytest.raises(build.KernelUnavailable, match="no C compiler"):
        build.build()
    monkeypatch.setenv("CC", "cc")
    (tmp_path / "ro").mkdir(mode=0o500)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "ro" / "sub"))
    if os.geteuid() != 0:  # root writes anywhere
        with pytest.raises(build.KernelUnavailable):
            build.build()


def test_the_kernel_cache_is_private_and_reused(tmp_path, monkeypatch):
    if not build.compiler_present():
        pytest.skip("no C compiler here")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    first = build.build()
    assert first.parent.stat().st_mode & 0o077 == 0
    mtime = first.stat().st_mtime_ns
    assert build.build() == first and first.stat().st_mtime_ns == mtime
