"""Weight-only quantized linear layers (`--quantization int8|int4`), quantized at load.

- int8: one scale per output channel, `w ~= q * scale`, q in [-127, 127].
- int4: groups of `group_size` consecutive input features per output channel, symmetric, one
  scale per group; the scale maps the group's value of largest magnitude to -8, so all 16 levels
  are used (as llama.cpp's Q4_0 does). Packed two to a byte in the layout `cpu_linear.c` reads.

Activations stay float32. Every step runs the native kernel (`pdserve/kernels/cpu_linear.c`):
with a few rows (decode) it streams the quantized bytes, with many (prefill) it is compute-bound
on the same tiles. Where the kernel cannot be built the layer dequantizes the whole weight for
every step into a float `F.linear`: the same numbers, slower (startup logs a warning saying so).
`dequantize()` is also the reference the kernel's tests compare against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.kernels import linear as kernels
from pdserve.models.packed_linear import BLOCK
from pdserve.models.packed_linear import from_panels as _from_panels
from pdserve.models.packed_linear import to_panels as _to_panels

GROUP_SIZES = (32, 64, 128)  # multiples of 32: the kernel reads 16 bytes of a group at a time


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q panels [Np / 16, K, 16] int8, scale [Np] float32) with w ~= q * scale per channel."""
    w = w.detach().float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp(min=torch.finfo(torch.float32).tiny)
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return _to_panels(q), F.pad(scale, (0, -w.shape[0] % BLOCK), value=1.0).contiguous()


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, n: int) -> torch.Tensor:
    return _from_panels(q, n).float() * scale[:n, None]


def quantize_int4(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed panels [Np / 16, Kp / 2, 16] uint8, scales [Np / 16, groups, 16] float32); Kp is
    K rounded up to whole groups (padded with zeros)."""
    if group_size not in GROUP_SIZES:
        raise ValueError(f"invalid group size {group_size}: choose one of {GROUP_SIZES}")
    w = w.detach().float()
    n, k = w.shape
    groups = -(-k // group_size)
    g = F.pad(w, (0, groups * group_size - k)).view(n, groups, group_size)
    extreme = g.gather(-1, g.abs().argmax(dim=-1, keepdim=True))  # signed value of largest |w|
    scale = (extreme / -8.0).squeeze(-1)
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    u = (torch.round(g / scale[..., None]).clamp(-8, 7) + 8).to(torch.uint8).view(n, -1)
    u = _to_panels(u, fill=8)  # [P, Kp, 16]; padded channels hold zeros (code 8)
    packed = u[:, 0::2, :] | (u[:, 1::2, :] << 4)
    return packed.contiguous(), _to_panels(scale, fill=1.0)


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, n: int, k: int, group_size: int):
    codes = torch.stack([packed & 15, packed >> 4], dim=2).flatten(1, 2)  # [P, Kp, 16]
    values = _from_panels(codes, n).float() - 8.0
    return (values * _from_panels(scale, n).repeat_interleave(group_size, dim=1))[:, :k]


class _QuantLinear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, native: bool) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.bias = None if bias is None else bias.detach().float()
        self.native = native

    def dequantize(self) -> torch.Tensor:
        """The whole weight as float32 (the reference path, and for tests)."""
        raise NotImplementedError

    def native_forward(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.native:
            y = self.native_forward(x)
            return y if self.bias is None else y + self.bias
        return F.linear(x, self.dequantize(), self.bias)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._quantized())

    def _quantized(self) -> tuple[torch.Tensor, ...]:
        raise NotImplementedError


class Int8Linear(_QuantLinear):
    """int8 weights with a scale per output channel."""

    def __init__(self, weight, bias=None, native: bool = True) -> None:
        super().__init__(weight, bias, native)
        self.q, self.scale = quantize_int8(weight)

    def dequantize(self) -> torch.Tensor:
        return dequantize_int8(self.q, self.scale, self.out_features)

    def native_forward(self, x):
        return kernels.int8_linear(x, self.q, self.scale, self.out_features)

    def _quantized(self):
        return self.q, self.scale


class Int4Linear(_QuantLinear):
    """int4 weights in groups along the input features, a scale per group."""

    def __init__(self, weight, bias=None, native: bool = True, group_size: int = 32) -> None:
        super().__init__(weight, bias, native)
        self.group_size = group_size
        self.q, self.scale = quantize_int4(weight, group_size)

    def dequantize(self) -> torch.Tensor:
        n, k = self.out_features, self.in_features
        return dequantize_int4(self.q, self.scale, n, k, self.group_size)

    def native_forward(self, x):
        n, k = self.out_features, self.in_features
        return kernels.int4_linear(x, self.q, self.scale, n, k, self.group_size)

    def _quantized(self):
        return self.q, self.scale


def quantized_bytes_per_param(model: nn.Module) -> float | None:
    """Stored bytes per weight of the model's quantized matrices (scales included), or None
    where none is quantized: what a step reads of them, for the bandwidth accounting."""
    layers = [m for m in model.modules() if isinstance(m, _QuantLinear)]
    if not layers:
        return None
    return sum(m.nbytes for m in layers) / sum(m.in_features * m.out_features for m in layers)
