"""Linear layers with weights prepacked once for oneDNN (CPU, float32).

torch's default `F.linear` on CPU calls MKL, which reads the weights at about half the machine's
bandwidth when the input is a single row (batch-1 decode). oneDNN with weights reordered once
into its blocked layout (what Inductor's CPU freezing pass does) moves them about twice as fast
and is also faster for prefill GEMMs. The ops are private to torch, so this is opt-in per engine
(`linear_backend`) and falls back to `F.linear` wherever they are missing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

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


def pack_linears(model: nn.Module) -> int:
    """Every linear layer, the tied lm_head included, as a `PackedLinear`; returns how many."""
    return replace_linears(model, PackedLinear)
