"""The native int8/int4 kernels against a plain torch reference of the same arithmetic (the
activations rounded to 8 bits per block of 32, the weights dequantized), and the quantizers'
own round trip."""

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
    int4_codes,
    int4_params,
    quantize_activations,
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
    err = (dequantize_int8(q, scale, 100, 70) - w).abs()
    assert (err <= scale[:100, None] / 2 + 1e-7).all()
    assert q.shape == (128 // 64, 96 // 4, 4, 16, 4) and q.dtype == torch.uint8


def _int4_scales(scale, n, groups):
    """(scale, minimum) [n, groups] as floats from the packed float16 [Np / 64, groups, 2, 4, 16]."""
    return tuple(scale[:, :, i].float().permute(0, 2, 3, 1).reshape(-1, groups)[:n] for i in (0, 1))


@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_round_trip_is_within_half_a_step_of_its_group_range(group):
    """Every weight is within half a step (the group's float16 scale) of its value, and every
    group's values lie within its 16 levels from the minimum (clipped by at most a step)."""
    w = weight(70, 200)
    q, scale = quantize_int4(w, group)
    back = dequantize_int4(q, scale, 70, 200, group)
    groups = -(-200 // group)
    assert scale.dtype == torch.float16 and scale.shape == (2, groups, 2, 4, 16)
    s, m = (t.repeat_interleave(group, 1)[:, :200] for t in _int4_scales(scale, 70, groups))
    assert (s > 0).all()
    err = (back - w).abs()
    inside = (w >= m - s / 2) & (w <= m + 15.5 * s)
    assert (err[inside] <= s[inside] / 2 * (1 + 1e-5)).all() and (err <= s * 1.5).all()
    assert inside.float().mean() > 0.99


def test_int4_search_beats_the_plain_range_and_symmetric_rounding():
    """The searched scale and minimum give less squared error than the group's plain range
    (min, (max - min) / 15) and than the symmetric Q4_0 rounding (amax / -8), group by group
    at least as small and in all clearly smaller, on Gaussian and on heavy-tailed weights."""
    for w in (weight(64, 256), weight(64, 256) * torch.randn(64, 256).exp()):
        g = w.view(64, 8, 32)
        s, m = int4_params(g)
        err = (int4_codes(g, s, m) * s + m - g).square().sum(-1)
        lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
        ps, pm = ((hi - lo) / 15).half().float(), lo.half().float()
        plain = (int4_codes(g, ps, pm) * ps + pm - g).square().sum(-1)
        ext = g.gather(-1, g.abs().argmax(-1, keepdim=True))
        ss = (ext / -8).half().float()
        sym = (torch.round(g / ss).clamp(-8, 7) * ss - g).square().sum(-1)
        assert (err <= plain * (1 + 1e-6)).all()
        assert err.sum() < 0.85 * plain.sum() and err.sum() < 0.85 * sym.sum()


def test_int4_padding_takes_no_part_in_a_group():
    """K = 40 in groups of 32: the second group has 8 real values far from zero; its range is
    theirs, not widened to the zeros the padding adds."""
    w = torch.cat([weight(16, 32), 5 + torch.rand(16, 8)], dim=1)
    q, scale = quantize_int4(w, 32)
    s, m = _int4_scales(scale, 16, 2)
    assert (m[:, 1] > 4.5).all()
    back = dequantize_int4(q, scale, 16, 40, 32)
    assert ((back - w).abs()[:, 32:] <= s[:, 1:] / 2 * (1 + 1e-5)).all()


def test_int4_layer_takes_codes_chosen_elsewhere():
    """The calibration hands in codes, scales and minima: the layer stores exactly those."""
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (70, 64), generator=g)
    s, m = torch.rand(70, 2, generator=g) * 0.01 + 1e-3, torch.randn(70, 2, generator=g) * 0.05
    layer = Int4Linear(torch.zeros(70, 64), None, native=False, group_size=32,
                       quantized=(codes, s, m))  # fmt: skip
    s, m = (t.half().float().repeat_interleave(32, 1) for t in (s, m))
    want = codes * s + m
    torch.testing.assert_close(layer.dequantize(), want, rtol=0, atol=0)


def test_activations_round_to_8_bits_per_block_of_32():
    """Each block's largest magnitude is kept exactly, every value is within half a step
    (amax / 127 / 2) of its own, and an all-zero block stays zero."""
    x = torch.randn(3, 70) * torch.tensor([1.0, 100.0, 1e-3])[:, None]
    x[1, 32:64] = 0
    got = quantize_activations(x)
    assert got.shape == x.shape
    blocks = F.pad(x, (0, 26)).view(3, 3, 32)
    step = (blocks.abs().amax(-1) / 127).repeat_interleave(32, -1)[:, :70]
    assert ((got - x).abs() <= step / 2 * (1 + 1e-5)).all()
    assert (got[1, 32:64] == 0).all()
    idx = x.abs().argmax(-1)
    torch.testing.assert_close(got.gather(1, idx[:, None]), x.gather(1, idx[:, None]))


def test_quantizers_reject_a_group_size_the_kernel_cannot_read():
    with pytest.raises(ValueError, match="group size"):
        quantize_int4(weight(4, 64), 48)


def test_int4_refuses_weights_its_float16_scales_cannot_hold():
    with pytest.raises(ValueError, match="too large for int4's float16 scales and minima"):
        quantize_int4(torch.full((16, 32), 1e6), 32)


@needs_native
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("rows", ROWS)
def test_int8_kernel_matches_the_dequantized_product(n, k, rows):
    w, x = weight(n, k), torch.randn(rows, k)
    layer = Int8Linear(w, None, native=True)
    ref = quantize_activations(x) @ layer.dequantize().T
    torch.testing.assert_close(layer(x), ref, rtol=1e-4, atol=1e-4)


@needs_native
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("group", [32, 128])
def test_int4_kernel_matches_the_dequantized_product(n, k, rows, group):
    """Weights shifted off zero, so the groups' minima carry a share of every product."""
    w, x = weight(n, k) + 0.03, torch.randn(rows, k)
    layer = Int4Linear(w, None, native=True, group_size=group)
    ref = quantize_activations(x) @ layer.dequantize().T
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
    """The error budget of the formats themselves (random Gaussian weights and activations, both
    quantized): int8 per channel under 1.5% relative, int4 in groups of 32 under 12%."""
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
        kernels.int8_linear(torch.randn(2, 32).double(), layer.q, layer.scale, 64, 32)
    with pytest.raises(ValueError, match=r"\[\.\.\., 32\]"):
        kernels.int8_linear(torch.randn(2, 31), layer.q, layer.scale, 64, 32)
    with pytest.raises(ValueError, match="group size 48"):
        kernels.int4_linear(torch.randn(1, 64), torch.zeros(1, 8, 4, 16, 4, dtype=torch.uint8),
                            torch.ones(1, 2, 2, 4, 16, dtype=torch.float16), 64, 64, 48)  # fmt: skip


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


@pytest.mark.slow  # seconds of its own: the default run stays short
def test_the_kernel_cache_is_private_and_reused(tmp_path, monkeypatch):
    if not build.compiler_present():
        pytest.skip("no C compiler here")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    first = build.build()
    assert first.parent.stat().st_mode & 0o077 == 0
    mtime = first.stat().st_mtime_ns
    assert build.build() == first and first.stat().st_mtime_ns == mtime


def _portable_library(flag):
    """The kernels built with `flag` turning an instruction set off, or a skip where this
    compiler (not an x86 one) does not know the flag."""
    import ctypes

    try:
        path = build.build(extra_flags=(flag,))
    except build.KernelUnavailable as e:
        if flag in str(e) or "unrecognized" in str(e):
            pytest.skip(f"this compiler cannot build with {flag}: {e}")
        raise
    lib = ctypes.CDLL(str(path))
    lib.pd_vnni.restype = ctypes.c_int
    return lib


def _product(lib, layer, x):
    """`layer`'s product of x through `lib`'s int8 or int4 kernel, called directly."""
    import ctypes

    P, I = ctypes.c_void_p, ctypes.c_int64  # noqa: E741, N806
    rows, k = x.shape
    n = layer.out_features
    y = torch.empty(rows, n)
    if isinstance(layer, Int8Linear):
        fn, extra = lib.pd_int8_linear, ()
        fn.argtypes = [P, I, I, P, P, I, P]
    else:
        fn, extra = lib.pd_int4_linear, (I(layer.group_size),)
        fn.argtypes = [P, I, I, P, P, I, I, P]
    rc = fn(x.data_ptr(), rows, k, layer.q.data_ptr(), layer.scale.data_ptr(), n, *extra,
            y.data_ptr())  # fmt: skip
    assert rc == 0
    return y


@needs_native
@pytest.mark.parametrize("flag", ["-mno-avx512vnni", "-mno-avx512f", "-mno-avx2", "-mno-avx"])
@pytest.mark.parametrize("n,k", [(100, 64), (64, 172), (512, 96)])
@pytest.mark.parametrize("rows", [1, 3, 7])
def test_the_portable_paths_compute_what_the_vnni_path_does(flag, n, k, rows):
    """Without VNNI, without AVX-512 at all (AVX2's pairwise byte products, its activation
    rounding) and without AVX2 (portable integer dot products, scalar rounding) the kernels
    compute the same integers: each library gives this CPU's own library's outputs, whichever
    of the paths that is, and matches the torch reference."""
    lib = _portable_library(flag)
    assert lib.pd_vnni() == 0
    w, x = weight(n, k), torch.randn(rows, k)
    for layer in (Int8Linear(w), Int4Linear(w, group_size=32)):
        y = _product(lib, layer, x)
        ref = quantize_activations(x) @ layer.dequantize().T
        torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(y, layer(x), rtol=1e-6, atol=1e-6)


@needs_native
@pytest.mark.parametrize("flag", [None, "-mno-avx512vnni", "-mno-avx512f", "-mno-avx2", "-mno-avx"])
def test_products_at_the_extremes_do_not_saturate(flag):
    """int8 weights all at +-127 steps against activations all at +-127 with the same signs:
    each pair of byte products is 2 x 127 x 127, the most AVX2's 16-bit pair sums must hold
    (its unsigned codes, up to 255, would overflow them); int4 codes at 15 against 127. Every
    path gives the reference's sums."""
    lib = build.library() if flag is None else _portable_library(flag)
    g = torch.Generator().manual_seed(1)
    signs = torch.randint(0, 2, (64, 128), generator=g).float() * 2 - 1
    x = torch.cat([signs[:3] * 3.0, signs[:2].abs() * 3.0])
    codes = torch.randint(0, 16, (64, 128), generator=g)
    codes[:, ::32], codes[:, 1::32] = 0, 15  # every group spans 0..15
    for layer in (Int8Linear(signs * 0.5), Int4Linear(codes * 0.1, group_size=32)):
        y = _product(lib, layer, x)
        ref = quantize_activations(x) @ layer.dequantize().T
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-4)
