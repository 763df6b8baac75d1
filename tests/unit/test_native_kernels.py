"""The native float32 matmul and the paged decode and prefill attention against torch's own
(`F.linear`, SDPA over a gathered context): same numbers within float32 rounding, for the shapes
that stress their edges (padded channels, head dims that are not a multiple of the vector width,
grouped query heads, int8 cache rows, contexts scattered over the cache, chunks after a cached
prefix)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.kernels import attention as attn_kernel
from pdserve.kernels import build
from pdserve.kernels import layer as layer_ops
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
@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 13, 64, 65])
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


def prefill_case(d, hq, hkv, int8, chunks, seed=0):
    """A step of prefill chunks (new query rows, earlier context) over a cache whose slots are
    scattered: (q [T, Hq, D] as a view of a wider row, as the model's is, the caches, the chunk
    table and slots `prefill_attention` takes, each chunk's (rows, slots))."""
    num_slots = 64 + sum(new + past for new, past in chunks)
    k, v = randn(num_slots, hkv, d, seed=seed + 1), randn(num_slots, hkv, d, seed=seed + 2)
    k_cache, v_cache = (kv_quant.quantize_rows(k), kv_quant.quantize_rows(v)) if int8 else (k, v)
    perm = torch.randperm(num_slots, generator=torch.Generator().manual_seed(seed + 3))
    t = sum(new for new, _ in chunks)
    wide = randn(t, hq + 2 * hkv, d, seed=seed + 4)  # q, then k and v, as qkv_proj's output
    q = wide[:, :hq]
    rows, parts, cases, first, used = [], [], [], 0, 0
    for new, past in chunks:
        ctx = perm[used : used + past + new]
        rows.append((first, new, past + new, used))
        parts.append(ctx)
        cases.append((slice(first, first + new), ctx))
        first, used = first + new, used + past + new
    table = torch.tensor(rows, dtype=torch.int64)
    return q, k_cache, v_cache, table, torch.cat(parts), cases


def prefill_reference(q, k_cache, v_cache, cases):
    """SDPA per chunk over its gathered context, causal with the chunk's offset."""
    out = torch.zeros(q.shape[0], q.shape[1] * q.shape[2])
    for rows, ctx in cases:
        qc = q[rows].transpose(0, 1)[None]  # [1, Hq, Lq, D]
        kc = kv_quant.load(k_cache, ctx, torch.float32).transpose(0, 1)[None]
        vc = kv_quant.load(v_cache, ctx, torch.float32).transpose(0, 1)[None]
        lq, lk = qc.shape[2], kc.shape[2]
        mask = torch.arange(lk)[None] <= torch.arange(lk - lq, lk)[:, None]
        o = F.scaled_dot_product_attention(qc, kc, vc, attn_mask=mask, enable_gqa=True)
        out[rows] = o[0].transpose(0, 1).reshape(lq, -1)
    return out


# (new query rows, earlier context tokens) per chunk: one-row chunks, rows past the 64 of a
# task, a context past a block of 64 keys, a long cached prefix, a row count that is not a
# multiple of the tile's 6
PREFILL_CHUNKS = [(2, 0), (70, 0), (13, 200), (130, 5), (1, 63), (64, 64)]


@needs_attention
@pytest.mark.parametrize(
    "d,hq,hkv", [(64, 12, 4), (8, 8, 4), (128, 8, 2), (20, 6, 3), (16, 4, 1), (72, 2, 2)]
)
@pytest.mark.parametrize("int8", [False, True])
def test_prefill_attention_matches_causal_sdpa_over_each_chunk(d, hq, hkv, int8):
    q, k_cache, v_cache, table, slots, cases = prefill_case(d, hq, hkv, int8, PREFILL_CHUNKS)
    out = torch.full((q.shape[0], hq * d), float("nan"))
    attn_kernel.prefill_attention(q, k_cache, v_cache, table, slots, out)
    torch.testing.assert_close(out, prefill_reference(q, k_cache, v_cache, cases),
                               rtol=1e-5, atol=1e-5)  # fmt: skip


@needs_attention
def test_prefill_attention_sees_no_key_past_a_query_and_no_row_outside_the_contexts():
    """Later positions' keys and values (written in the same step) may change: a query's output
    does not, to the bit; cache rows outside every chunk's context may hold anything (NaNs)."""
    q, k, v, table, slots, cases = prefill_case(16, 4, 2, False, [(40, 0), (9, 30)])
    outside = torch.ones(k.shape[0], dtype=torch.bool)
    outside[slots] = False
    k[outside], v[outside] = float("nan"), float("nan")
    out = torch.zeros(q.shape[0], 4 * 16)
    attn_kernel.prefill_attention(q, k, v, table, slots, out)
    assert not out.isnan().any()
    first = out.clone()
    later = slots[20:40]  # the first chunk's positions 20-39
    k[later], v[later] = k[later] * 3 + 1, v[later] - 2
    attn_kernel.prefill_attention(q, k, v, table, slots, out)
    assert torch.equal(out[:20], first[:20])  # rows 0-19 see none of them
    assert not torch.equal(out[20:40], first[20:40])  # the others do
    assert torch.equal(out[40:], first[40:])  # the second chunk's context is its own


@needs_attention
def test_prefill_attention_refuses_chunks_and_slots_out_of_range():
    q, k, v, table, slots, _ = prefill_case(16, 4, 2, False, [(5, 3), (4, 0)])
    out = torch.zeros(q.shape[0], 4 * 16)
    bad_tables = [
        torch.tensor([[0, 5, 8, 0], [5, 5, 5, 8]]),  # rows past the step's 9
        torch.tensor([[0, 5, 4, 0], [5, 4, 4, 8]]),  # a context shorter than its rows
        torch.tensor([[0, 5, 8, 0], [5, 4, 4, 9]]),  # slots past the slot list
        torch.tensor([[0, 0, 8, 0], [5, 4, 4, 8]]),  # a chunk with no rows
    ]
    for bad in bad_tables:
        with pytest.raises(ValueError, match="out of range"):
            attn_kernel.prefill_attention(q, k, v, bad, slots, out)
    far = slots.clone()
    far[3] = k.shape[0]  # a slot past the cache
    with pytest.raises(ValueError, match="out of range"):
        attn_kernel.prefill_attention(q, k, v, table, far, out)
    with pytest.raises(ValueError, match="prefill_attention"):
        attn_kernel.prefill_attention(q.double(), k, v, table, slots, out)
    with pytest.raises(ValueError, match="prefill_attention"):
        attn_kernel.prefill_attention(q, k, v, table, slots, out[:, :-1])


def layer_ops_cases():
    """The per-token kernels and torch's forms of them (`pdserve.models.llama`, rope.py), on
    rows whose width is not a multiple of the vector (the scalar tails) and is (the vectors);
    values of both signs and past the exponential's range (the activation's sigmoid)."""
    from pdserve.models.rope import RotaryEmbedding

    for n, heads, d in [(768, 16, 64), (100, 3, 20), (24, 2, 6)]:
        x = randn(37, n) * 3
        x[0, :4] = torch.tensor([-200.0, 200.0, -0.0, 1e-30])
        w = randn(n, seed=1)
        yield "rms_norm", layer_ops.rms_norm(x, w, 1e-5), F.rms_norm(x, (n,), w, 1e-5)
        gu = torch.cat([x, randn(37, n, seed=2)], dim=1)
        ref = F.silu(gu[:, :n]) * gu[:, n:]
        yield "silu_mul", layer_ops.silu_mul(gu), ref
        qkv = randn(37, heads + 2, d, seed=3)  # the first `heads` rotate, the rest stay
        angles = torch.outer(torch.arange(37.0), torch.rand(d // 2, generator=torch.Generator()))
        cos, sin = angles.cos()[:, None], angles.sin()[:, None]
        rotated = qkv.clone()
        layer_ops.rope_(rotated, heads, cos, sin)
        yield "rope_", rotated[:, :heads], RotaryEmbedding.apply(qkv[:, :heads], cos, sin)
        yield "rope_ (the others)", rotated[:, heads:], qkv[:, heads:]


@needs_linear
def test_layer_kernels_match_torch():
    for name, got, ref in layer_ops_cases():
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6, msg=name)


@needs_linear
def test_layer_kernels_refuse_inputs_they_cannot_read():
    x = randn(4, 8)
    for call in (
        lambda: layer_ops.rms_norm(x.double(), randn(8), 1e-5),
        lambda: layer_ops.rms_norm(x, randn(6), 1e-5),
        lambda: layer_ops.silu_mul(randn(4, 7)),
        lambda: layer_ops.rope_(randn(4, 2, 7), 2, randn(4, 3), randn(4, 3)),  # odd head size
        lambda: layer_ops.rope_(randn(4, 2, 8), 3, randn(4, 4), randn(4, 4)),  # too many heads
        lambda: layer_ops.rope_(randn(4, 8, 2).transpose(1, 2), 2, randn(4, 4), randn(4, 4)),
    ):
        with pytest.raises(ValueError, match="unsupported inputs"):
            call()


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
    modules = (linear, attn_kernel, memory, layer_ops)
    for module in modules:
        monkeypatch.setattr(module, "library", lambda: lib)
        module._lib.cache_clear()
    yield request.param
    for module in modules:
        module._lib.cache_clear()  # the next test loads the native library again


@needs_linear
def test_narrower_vectors_compute_the_same(narrower_vectors):
    """The float32 product (tiles of other shapes: 2 or 1 panels per tile), the decode and
    prefill attention (head sizes in more vectors, 128 included), the bandwidth sum and the
    per-token layer kernels, built for narrower vectors, match torch's own as the native build
    does."""
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
            q, kc, vc, table, sl, cases = prefill_case(d, hq, hkv, int8, PREFILL_CHUNKS)
            out = torch.zeros(q.shape[0], hq * d)
            attn_kernel.prefill_attention(q, kc, vc, table, sl, out)
            ref = prefill_reference(q, kc, vc, cases)
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    from pdserve.kernels.memory import read_sum

    x = randn(100_003).abs()
    torch.testing.assert_close(torch.tensor(read_sum(x)), x.sum(), rtol=1e-4, atol=1e-4)
    for name, got, ref in layer_ops_cases():
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6, msg=name)
