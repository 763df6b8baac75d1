"""Linear layers with weights prepacked once at load (CPU, float32): `--linear-backend`.

torch's default `F.linear` on CPU calls MKL, which reads the weights at about a fifth to a third
of the machine's bandwidth when the input is a single row (batch-1 decode, on one core). Two
prepacked forms replace it:

- `NativeLinear` (backend "native"): the weights in the panels of pdserve's own kernel
  (`pdserve/kernels/cpu_linear.c`), which streams them at the machine's read bandwidth for a
  few rows and matches oneDNN for many; it needs a C compiler at first use.
- `PackedLinear` (backend "onednn"): oneDNN with the weights reordered into its blocked layout
  (what Inductor's CPU freezing pass does); private torch ops, probed before use.

"auto" takes the first of those that works here and falls back to `F.linear`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.kernels import linear as kernels

PANEL, BLOCK = 16, 64  # the native kernel's output channels per panel and per thread's block

logger = logging.getLogger(__name__)


def onednn_available(device: torch.device, dtype: torch.dtype) -> bool:
    ops = getattr(torch.ops, "mkldnn", None)
    return (
        device.type == "cpu"
        and dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and hasattr(ops, "_reorder_linear_weight")
        and hasattr(ops, "_linear_pointwise")
    )


def to_panels(t: torch.Tensor, fill: float = 0) -> torch.Tensor:
    """[N, X] -> [Np / 16, X, 16] (N padded with `fill` rows to whole blocks): panel p, x,
    lane j holds t[16p + j, x]."""
    n = t.shape[0]
    t = F.pad(t, (0, 0, 0, -n % BLOCK), value=fill)
    return t.view(-1, PANEL, t.shape[1]).transpose(1, 2).contiguous()


def from_panels(p: torch.Tensor, n: int) -> torch.Tensor:
    return p.transpose(1, 2).reshape(-1, p.shape[1])[:n]


def interleave(panels: torch.Tensor) -> torch.Tensor:
    """[Np / 16, X, ...] -> [Np / 64, X, 4, ...]: the 4 panels of a thread's block side by side
    along X, so the kernel reads a block as one stream (four streams a thread, one per panel,
    read 10% slower in a single-row product on a Zen 5)."""
    p = panels.shape[0]
    per = BLOCK // PANEL
    return panels.view(p // per, per, *panels.shape[1:]).transpose(1, 2).contiguous()


def deinterleave(blocks: torch.Tensor) -> torch.Tensor:
    return blocks.transpose(1, 2).flatten(0, 1)


def to_blocks(t: torch.Tensor) -> torch.Tensor:
    """[N, K] float32 -> the native kernel's [Np / 64, K, 4, 16]: block b, k, panel h, lane j
    holds t[64b + 16h + j, k] (N padded with zero rows)."""
    return interleave(to_panels(t))


def from_blocks(b: torch.Tensor, n: int) -> torch.Tensor:
    return from_panels(deinterleave(b), n)


def native_available(device: torch.device, dtype: torch.dtype) -> tuple[bool, str]:
    """(whether `NativeLinear` runs here, why not)."""
    if device.type != "cpu" or dtype != torch.float32:
        return False, f"the native kernel needs a CPU and float32 (device={device}, dtype={dtype})"
    return kernels.available()


class NativeLinear(nn.Module):
    """y = x @ W^T + b with W in the native kernel's float32 panels (no plain copy is kept)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.w = to_blocks(weight.detach().float())
        self.bias = None if bias is None else F.pad(bias.detach().float(), (0, -len(bias) % BLOCK))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        return kernels.f32_linear(x, self.w, self.bias, self.out_features)


class PackedLinear(nn.Module):
    """y = x @ W^T + b with W held in oneDNN's packed layout (no plain copy is kept)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
        self.bias = None if bias is None else bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [None], "")


def replace_linears(
    model: nn.Module, make: Callable[[torch.Tensor, torch.Tensor | None], nn.Module]
) -> int:
    """Replace every `nn.Linear` in `model` by `make(weight, bias)`; returns how many. A tied
    output embedding gets its own `lm_head` made from the table (the table itself stays for the
    input gather), so the logits go through the same kind of layer as the projections."""
    count = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, name, make(child.weight, child.bias))
                count += 1
    if getattr(model, "lm_head", False) is None:
        model.lm_head = make(model.embed_tokens.weight, None)
        count += 1
    return count


def pack_linears(model: nn.Module, backend: str = "onednn") -> int:
    """Every linear layer, the tied lm_head included, as a `PackedLinear` (backend "onednn") or
    a `NativeLinear` ("native"); returns how many."""
    return replace_linears(model, NativeLinear if backend == "native" else PackedLinear)
