"""Weight-only quantized linear layers (`--quantization int8|int4`), quantized at load.

- int8: one scale per output channel, `w ~= q * scale`, q in [-127, 127].
- int4: groups of `group_size` consecutive input features per output channel, symmetric, one
  float16 scale per group; the scale maps the group's value of largest magnitude to -8, so all
  16 levels are used (as llama.cpp's Q4_0 does).

Weights are stored unsigned (q + 128, q + 8: the codes) in the layouts `cpu_quant.c` reads.
The products quantize their activations too, per row in blocks of 32 input features
(`quantize_activations`: symmetric, 8 bits, a float scale per block), so the kernel multiplies
bytes with integer dot-product instructions instead of widening every weight to a float. Every
step runs the native kernel (`pdserve/kernels/cpu_quant.c`); where it cannot be built the layer
computes the same arithmetic in torch (quantized activations against the dequantized weight in
an `F.linear`): the same numbers but for the order of float sums, slower (startup logs a
warning saying so). These functions are also the reference the kernel's tests compare against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.kernels import linear as kernels
from pdserve.models.packed_linear import BLOCK, PANEL
from pdserve.models.packed_linear import from_panels as _from_panels
from pdserve.models.packed_linear import to_panels as _to_panels

GROUP_SIZES = (32, 64, 128)  # multiples of the activation block
ACT_BLOCK = 32  # input features per activation scale
PANELS = BLOCK // PANEL  # panels per thread's block


def _pad_k(t: torch.Tensor, multiple: int, value: float = 0) -> torch.Tensor:
    return F.pad(t, (0, -t.shape[-1] % multiple), value=value)


def quantize_activations(x: torch.Tensor) -> torch.Tensor:
    """x[..., K] float32 as the kernels see it: rounded to 8 bits per block of 32 inputs with
    the scale amax / 127 (K padded with zeros to whole blocks): the float values q * scale,
    computed in the same float32 operations as `cpu_quant.c`."""
    k = x.shape[-1]
    b = _pad_k(x.float(), ACT_BLOCK).unflatten(-1, (-1, ACT_BLOCK))
    amax = b.abs().amax(dim=-1, keepdim=True)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    q = torch.round(b * inv).clamp(-127, 127)
    return (q * (amax / 127.0)).flatten(-2)[..., :k]


def _interleave(panels: torch.Tensor) -> torch.Tensor:
    """[Np / 16, X, ...] -> [Np / 64, X, 4, ...]: the 4 panels of a thread's block side by side
    along X, so the kernel reads a block as one stream."""
    p = panels.shape[0]
    return panels.view(p // PANELS, PANELS, *panels.shape[1:]).transpose(1, 2).contiguous()


def _deinterleave(blocks: torch.Tensor) -> torch.Tensor:
    return blocks.transpose(1, 2).flatten(0, 1)


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes [Np / 64, Kp / 4, 4, 16, 4] uint8, scale [Np] float32) with w ~= (code - 128) *
    scale per channel; Kp is K rounded up to whole activation blocks (zero weights)."""
    w = w.detach().float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp(min=torch.finfo(torch.float32).tiny)
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int16) + 128
    u = _to_panels(_pad_k(q, ACT_BLOCK, 128).to(torch.uint8), fill=128)  # [P, Kp, 16]
    codes = u.unflatten(1, (-1, 4)).transpose(2, 3)  # [P, Kp / 4, 16, 4]
    return _interleave(codes), F.pad(scale, (0, -w.shape[0] % BLOCK), value=1.0).contiguous()


def dequantize_int8(codes: torch.Tensor, scale: torch.Tensor, n: int, k: int) -> torch.Tensor:
    u = _deinterleave(codes).transpose(2, 3).flatten(1, 2)  # [P, Kp, 16]
    return (_from_panels(u, n).float() - 128.0)[:, :k] * scale[:n, None]


def quantize_int4(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed codes [Np / 64, Kp / 8, 4, 16, 4] uint8, scales [Np / 64, groups, 4, 16]
    float16); Kp is K rounded up to whole groups (padded with zeros). The codes are rounded
    against the half-precision scale the kernel reads."""
    if group_size not in GROUP_SIZES:
        raise ValueError(f"invalid group size {group_size}: choose one of {GROUP_SIZES}")
    w = w.detach().float()
    n, k = w.shape
    groups = -(-k // group_size)
    g = F.pad(w, (0, groups * group_size - k)).view(n, groups, group_size)
    extreme = g.gather(-1, g.abs().argmax(dim=-1, keepdim=True))  # signed value of largest |w|
    if extreme.abs().max() / 8 > torch.finfo(torch.float16).max:
        raise ValueError("weights too large for int4's float16 scales (|w| > 524,000)")
    scale = (extreme / -8.0).squeeze(-1).half()
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    u = (torch.round(g / scale[..., None].float()).clamp(-8, 7) + 8).to(torch.uint8).view(n, -1)
    u = _to_panels(u, fill=8)  # [P, Kp, 16]; padded channels hold zeros (code 8)
    octets = u.unflatten(1, (-1, 2, 4)).permute(0, 1, 4, 3, 2)  # [P, Kp / 8, 16, 4, half]
    packed = octets[..., 0] | (octets[..., 1] << 4)
    return _interleave(packed), _interleave(_to_panels(scale, fill=1.0))


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, n: int, k: int, group_size: int):
    packed, scale = _deinterleave(packed), _deinterleave(scale)
    octets = torch.stack([packed & 15, packed >> 4], dim=-1)  # [P, Kp / 8, 16, 4, half]
    codes = octets.permute(0, 1, 4, 3, 2).flatten(1, 3)  # [P, Kp, 16]
    values = _from_panels(codes, n).float() - 8.0
    return (values * _from_panels(scale, n).float().repeat_interleave(group_size, dim=1))[:, :k]


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
        return F.linear(quantize_activations(x), self.dequantize(), self.bias)

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
        return dequantize_int8(self.q, self.scale, self.out_features, self.in_features)

    def native_forward(self, x):
        return kernels.int8_linear(x, self.q, self.scale, self.out_features, self.in_features)

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
