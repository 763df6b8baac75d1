"""The native float32 matmul and the paged decode attention against torch's own (`F.linear`,
SDPA over a gathered context): same numbers within float32 rounding, for the shapes that stress
their edges (padded channels, head dims that are not a multiple of the vector width, grouped
query heads, int8 cache rows, contexts scattered over the cache)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.kernels import attention as attn_kernel
from pdserve.kernels import build
from pdserve.models import kv_quant
from pdserve.models.packed_linear import NativeLinear, from_blocks

# Where a compiler is present the kernels must build: a failed build fails these tests.
needs_linear = needs_attention = pytest.mark.skipif(
    not build.compiler_present(), reason="no C compiler here"
)


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@needs_linear
@pytest.mark.parametrize("n,k", [(128, 256), (100, 64), (64, 172), (172, 8), (2304, 768)])
@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 13, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_float32_kernel_matches_f_linear(n, k, rows, bias):
    w, x = randn(n, k) * 0.05, randn(rows, k, seed=1)
    b = randn(n, seed=2) if bias else None
    layer = NativeLinear(w, b)
    torch.testing.assert_close(layer(x), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    assert torch.equal(from_blocks(layer.w, n), w)  # the panels hold the weight unchanged


@needs_linear
def test_float32_layer_keeps_leading_dims_and_refuses_wrong_inputs():
    w = randn(96, 64)
    layer = NativeLinear(w, None)
    x = randn(2, 3, 64)
    y = layer(x)
    assert y.shape == (2, 3, 96)
    torch.testing.assert_close(y, x @ w.T, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="float32"):
        layer(x.double())
    with pytest.raises(ValueError, match=r"\[\.\.\., 64\]"):
        layer(randn(2, 63))


def gathered_reference(q, k_cache, v_cache, slots, lens):
    """What the default backend computes: SDPA over the padded gathered context, masked."""
    nd, hq, d = q.shape
    hkv = k_cache.shape[1]
    kd = kv_quant.load(k_cache, slots, torch.float32).transpose(1, 2)
    vd = kv_quant.load(v_cache, slots, torch.float32).transpose(1, 2)
    mask = (torch.arange(slots.shape[1])[None] < lens[:, None])[:, None, None, :]
    out = F.scaled_dot_product_attention(q.view(nd, hkv, hq // hkv, d), kd, vd, attn_mask=mask)
    return out.reshape(nd, hq, d)


@needs_attention
@pytest.mark.parametrize(
    "d,hq,hkv", [(64, 12, 12), (8, 8, 4), (128, 8, 2), (20, 6, 3), (16, 4, 1), (72, 2, 2)]
)
@pytest.mark.parametrize("int8", [False, True])
def test_decode_attention_matches_sdpa_over_the_gathered_context(d, hq, hkv, int8):
    num_slots, lens = 700, torch.tensor([1, 37, 150, 16, 200])
    k, v = randn(num_slots, hkv, d, seed=1), randn(num_slots, hkv, d, seed=2)
    k_cache, v_cache = (kv_quant.quantize_rows(k), kv_quant.quantize_rows(v)) if int8 else (k, v)
    # each sequence's context scattered over the cache, padded to the longest with slot 0
    perm = torch.randperm(num_slots, generator=torch.Generator().manual_seed(3))
    slots = torch.zeros(len(lens), int(lens.max()), dtype=torch.long)
    start = 0
    for s, n in enumerate(lens.tolist()):
        slots[s, :n] = perm[start : start + n]
        start += n
    q = randn(len(lens), hq, d, seed=4)
    out = attn_kernel.decode_attention(q, k_cache, v_cache, slots, lens)
    ref = gathered_reference(q, k_cache, v_cache, slots, lens)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@needs_attention
def test_decode_attention_reads_only_the_context():
    """Slots past a sequence's length (padding) may hold anything: NaNs there change nothing."""
    k, v = randn(64, 2, 16, seed=1), randn(64, 2, 16, seed=2)
    slots, lens = torch.arange(64).view(2, 32), torch.tensor([10, 32])
    q = randn(2, 4, 16, seed=3)
    before = attn_kernel.decode_attention(q, k, v, slots, lens)
    k[10:32], v[10:32] = float("nan"), float("nan")  # the first sequence's padding
    after = attn_kernel.decode_attention(q, k, v, slots, lens)
    assert not before.isnan().any() and torch.equal(before, after)


@needs_attention
def test_decode_attention_refuses_inputs_it_cannot_read():
    k = v = randn(16, 2, 8)
    slots, lens, q = torch.arange(16).view(2, 8), torch.tensor([8, 8]), randn(2, 4, 8)
    bad = [
        (q.double(), k, v, slots, lens),  # float64 queries
        (randn(2, 3, 8), k, v, slots, lens),  # 3 query heads over 2 KV heads
        (q, k, v.to(torch.int8), slots, lens),  # K and V of different dtypes
        (q, k, v, slots.int(), lens),  # int32 slots
        (q, k.half(), v.half(), slots, lens),  # a cache dtype it does not read
        (q, k[:, :, :6], v[:, :, :6], slots, lens),  # a row width that is not the head dim
    ]
    for args in bad:
        with pytest.raises(ValueError, match="decode_attention"):
            attn_kernel.decode_attention(*args)


@needs_linear
@pytest.mark.parametrize("n", [1, 127, 128, 1000, 1 << 20])
def test_the_bandwidth_kernel_sums_every_value(n):
    from pdserve.kernels.memory import read_sum

    x = randn(n).abs()  # positive: no cancellation, float32 sums agree to rounding
    torch.testing.assert_close(torch.tensor(read_sum(x)), x.sum(), rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="float32"):
        read_sum(x.double())


@pytest.fixture(params=["-mno-avx512f", "-mno-avx"])
def narrower_vectors(request, monkeypatch):
    """The kernels built for narrower vector registers than this CPU may have (8 floats with AVX,
    4 without: a panel's 16 lanes in 2 or 4 vectors), loaded in place of the native library for
    one test; a skip where this compiler (not an x86 one) does not know the flag."""
    import ctypes

    from pdserve.kernels import linear, memory

    try:
        path = build.build(extra_flags=(request.param,))
    except build.KernelUnavailable as e:
        if request.param in str(e) or "unrecognized" in str(e):
            pytest.skip(f"this compiler cannot build with {request.param}: {e}")
        raise
    lib = ctypes.CDLL(str(path))
    modules = (linear, attn_kernel, memory)
    for module in modules:
        monkeypatch.setattr(module, "library", lambda: lib)
        module._lib.cache_clear()
    yield request.param
    for module in modules:
        module._lib.cache_clear()  # the next test loads the native library again


@needs_linear
def test_narrower_vectors_compute_the_same(narrower_vectors):
    """The float32 product (tiles of other shapes: 2 or 1 panels per tile), the decode attention
    (head sizes in more vectors, 128 included) and the bandwidth sum, built for narrower vectors,
    match torch's own as the native build does."""
    for n, k in [(100, 64), (172, 8), (2304, 768)]:
        w, b = randn(n, k) * 0.05, randn(n, seed=2)
        layer = NativeLinear(w, b)
        for rows in (1, 2, 3, 7, 13):
            x = randn(rows, k, seed=1)
            torch.testing.assert_close(layer(x), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    lens = torch.tensor([1, 37, 150])
    for d, hq, hkv in [(64, 12, 4), (128, 8, 2), (8, 4, 4), (20, 6, 3)]:
        for int8 in (False, True):
            k, v = randn(400, hkv, d, seed=1), randn(400, hkv, d, seed=2)
            if int8:
                k, v = kv_quant.quantize_rows(k), kv_quant.quantize_rows(v)
            slots = torch.randperm(400, generator=torch.Generator().manual_seed(3))[: 450 // 3]
            slots = slots.view(1, -1).repeat(3, 1)
            q = randn(3, hq, d, seed=4)
            out = attn_kernel.decode_attention(q, k, v, slots, lens)
            ref = gathered_reference(q, k, v, slots, lens)
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    from pdserve.kernels.memory import read_sum

    x = randn(100_003).abs()
    torch.testing.assert_close(torch.tensor(read_sum(x)), x.sum(), rtol=1e-4, atol=1e-4)
