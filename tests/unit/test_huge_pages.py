"""Memory on transparent huge pages (`pdserve/kernels/huge_pages.py`): the arena keeps every
tensor's values, shape and order; the loader moves the streamed weights into one; where this
machine gives huge pages, the arena gets them."""

from __future__ import annotations

import pytest
import torch

from pdserve import LLM
from pdserve.kernels import build, huge_pages
from pdserve.models.packed_linear import NativeLinear
from pdserve.models.quant_linear import Int8Linear

needs_thp = pytest.mark.skipif(
    not huge_pages.available(),
    reason=f"no transparent huge pages here (mode {huge_pages.thp_mode()!r})",
)


@needs_thp
def test_an_arena_holds_copies_side_by_side_on_cache_lines():
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(3, 5, generator=g), torch.arange(7, dtype=torch.int8),
               torch.randn(100, 33, generator=g).half(), torch.tensor([2.5])]  # fmt: skip
    copies = huge_pages.arena(tensors)
    for t, c in zip(tensors, copies):
        assert c.dtype == t.dtype and c.shape == t.shape and c.is_contiguous()
        assert torch.equal(c, t) and c.data_ptr() != t.data_ptr()
        assert c.data_ptr() % huge_pages.ALIGN == 0
    starts = [c.data_ptr() for c in copies]
    assert starts[0] % huge_pages.HUGE_PAGE == 0
    ends = [c.data_ptr() + c.numel() * c.element_size() for c in copies]
    assert all(e <= s < e + huge_pages.ALIGN for e, s in zip(ends, starts[1:]))  # no gaps
    copies[1][0] = 9  # a copy, not a view of the original
    assert tensors[1][0] == 0


@needs_thp
def test_zeros_are_zero_and_written_memory_sits_on_huge_pages():
    z = huge_pages.zeros((4, 3, 2), torch.int8)
    assert z.shape == (4, 3, 2) and z.dtype == torch.int8 and not z.any()
    # 16 MiB written: with the mapping advised, the kernel faults it in as 2 MiB pages (it may
    # fall back to small pages when memory is fragmented; three tries before calling it failed)
    for _ in range(3):
        big = huge_pages.zeros((4 << 20,), torch.float32)
        big.fill_(1.0)
        if huge_pages.huge_bytes(big) >= 4 * huge_pages.HUGE_PAGE:
            break
    assert huge_pages.huge_bytes(big) >= 4 * huge_pages.HUGE_PAGE
    assert float(big.sum()) == 4 << 20


@needs_thp
def test_zeros_of_another_device_or_turned_off_are_torch_memory(monkeypatch):
    meta = huge_pages.zeros((3, 4), torch.float32, "meta")
    assert meta.device.type == "meta" and meta.shape == (3, 4)
    on = huge_pages.zeros((1 << 20,), torch.float32)
    assert on.data_ptr() % huge_pages.HUGE_PAGE == 0
    monkeypatch.setenv(huge_pages.ENV_VAR, "0")
    off = huge_pages.zeros((1 << 20,), torch.float32)
    assert not off.any() and off.untyped_storage().data_ptr() == off.data_ptr()
    assert off.untyped_storage().nbytes() == off.numel() * 4  # torch's own, not a mapping's view


def test_no_huge_pages_means_torch_memory(monkeypatch):
    monkeypatch.setattr(huge_pages, "thp_mode", lambda: "never")
    assert not huge_pages.supported() and not huge_pages.available()
    z = huge_pages.zeros((5,), torch.float32)
    assert not z.any() and huge_pages.huge_bytes(z) == 0
    with pytest.raises(RuntimeError, match="no transparent huge pages"):
        huge_pages.empty(16)


@pytest.mark.skipif(
    huge_pages.thp_mode() != "madvise",
    reason="in 'always' mode torch's own "
    "memory may get huge pages too; without THP there is nothing to turn off",
)
@pytest.mark.slow  # seconds of its own: the default run stays short
def test_the_environment_keeps_the_kv_cache_in_torch_memory(monkeypatch, stories_path):
    caches = {}
    for setting in ("1", "0"):
        monkeypatch.setenv("PDSERVE_HUGE_PAGES", setting)
        assert huge_pages.available() == (setting == "1")
        caches[setting] = LLM(stories_path, max_model_len=64).engine.core.runner.kv_caches[0]
    assert huge_pages.huge_bytes(caches["1"]) >= huge_pages.HUGE_PAGE  # written at startup
    assert huge_pages.huge_bytes(caches["0"]) == 0


@needs_thp
@pytest.mark.skipif(not build.compiler_present(), reason="no C compiler here")
@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_the_streamed_weights_live_in_one_arena_in_layer_order(stories_path, quantization):
    llm = LLM(stories_path, max_model_len=64, quantization=quantization)
    model = llm.engine.core.runner.model
    kind = NativeLinear if quantization == "none" else Int8Linear
    layers = [m for m in model.modules() if isinstance(m, kind)]
    assert len(layers) == 4 * len(model.layers) + 1  # qkv, o, gate_up, down per layer; head
    streamed = [t for m in layers for t in ((m.w,) if quantization == "none" else (m.q, m.scale))]
    starts = [t.data_ptr() for t in streamed]
    ends = [t.data_ptr() + t.numel() * t.element_size() for t in streamed]
    assert starts[0] % huge_pages.HUGE_PAGE == 0  # the arena's start
    # side by side in the order the layers run them
    assert all(e <= s < e + huge_pages.ALIGN for e, s in zip(ends, starts[1:]))
