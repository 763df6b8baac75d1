"""Weight-only quantized linear layers (`--quantization int8|int4`), quantized at load.

- int8: one scale per output channel, `w ~= q * scale`, q in [-127, 127].
- int4: groups of `group_size` consecutive input features per output channel, asymmetric, a
  float16 scale and a float16 minimum per group: `w ~= code * scale + min`, code in 0..15 (as
  llama.cpp's Q4_1). Rounded to nearest (`quantize_int4`), the scale and minimum are the pair
  of least squared error among a search around the group's range (`int4_params`, after
  llama.cpp's make_qkx2_quants); at load the model's own sampled text calibrates them instead
  (`pdserve.models.calibrate`: error-compensated rounding), which hands the codes in.

Weights are stored unsigned (q + 128 for int8; int4's codes as they are) in the layouts
`cpu_quant.c` reads. The products quantize their activations too, per row in blocks of 32
input features (`quantize_activations`: symmetric, 8 bits, a float scale per block), so the
kernel multiplies bytes with integer dot-product instructions instead of widening every weight
to a float. Every step runs the native kernel (`pdserve/kernels/cpu_quant.c`); where it cannot
be built the layer computes the same arithmetic in torch (quantized activations against the
dequantized weight in an `F.linear`): the same numbers but for the order of float sums, slower
(startup logs a warning saying so). These functions are also the reference the kernel's tests
compare against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.kernels import linear as kernels
from pdserve.models.packed_linear import BLOCK
from pdserve.models.packed_linear import deinterleave as _deinterleave
from pdserve.models.packed_linear import from_panels as _from_panels
from pdserve.models.packed_linear import interleave as _interleave
from pdserve.models.packed_linear import to_panels as _to_panels

GROUP_SIZES = (32, 64, 128)  # multiples of the activation block
ACT_BLOCK = 32  # input features per activation scale


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


def _half(t: torch.Tensor) -> torch.Tensor:
    return t.half().float()


def int4_params(
    g: torch.Tensor, weight: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, min) [..., 1] as float32 values of float16s for groups g[..., G]: among the
    plain range (max - min) / 15 and 21 least-squares fits of the codes a stretched range gives
    (llama.cpp's make_qkx2_quants: 15 - 1 .. 15 + 1 steps over the range), the pair whose codes
    give the least squared error, weighted per input by `weight` [..., G] (None: equally)."""
    g = g.float()
    wt = torch.ones_like(g) if weight is None else weight.float().expand_as(g)
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    width = hi - lo

    def error(scale, low):
        scale, low = _half(scale), _half(low)
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # a constant group
        r = torch.round((g - low) / scale).clamp(0, 15) * scale + low
        return scale, low, ((r - g).square() * wt).sum(-1, keepdim=True)

    best_s, best_m, best_e = error(width / 15, lo)
    sw, sx = wt.sum(-1, keepdim=True), (wt * g).sum(-1, keepdim=True)
    for i in range(21):
        codes = torch.round((g - lo) * ((14 + 0.1 * i) / width.clamp(min=1e-30))).clamp(0, 15)
        sq, sqq = (wt * codes).sum(-1, keepdim=True), (wt * codes * codes).sum(-1, keepdim=True)
        sqx = (wt * codes * g).sum(-1, keepdim=True)
        det = sw * sqq - sq * sq
        ok = det > 0
        det = torch.where(ok, det, torch.ones_like(det))
        scale = torch.where(ok, (sw * sqx - sq * sx) / det, width / 15)
        low = torch.where(ok, (sqq * sx - sq * sqx) / det, lo)
        scale, low, e = error(scale, low)
        better = e < best_e
        best_s = torch.where(better, scale, best_s)
        best_m = torch.where(better, low, best_m)
        best_e = torch.where(better, e, best_e)
    return best_s, best_m


def int4_codes(g: torch.Tensor, scale: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """The nearest codes 0..15 of g for `scale` and `low` (broadcast against g)."""
    return torch.round((g - low) / scale).clamp(0, 15)


def _check_group(group_size: int) -> None:
    if group_size not in GROUP_SIZES:
        raise ValueError(f"invalid group size {group_size}: choose one of {GROUP_SIZES}")


def _check_range(w: torch.Tensor) -> None:
    if w.abs().max() > 60000:
        raise ValueError("weights too large for int4's float16 scales and minima (|w| > 60,000)")


def quantize_int4(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each group rounded to nearest with `int4_params`'s scale and minimum; packed as
    `pack_int4` does. Kp is K rounded up to whole groups; the padding takes no part in the
    search."""
    _check_group(group_size)
    w = w.detach().float()
    _check_range(w)
    n, k = w.shape
    groups = -(-k // group_size)
    g = F.pad(w, (0, groups * group_size - k)).view(n, groups, group_size)
    real = (torch.arange(groups * group_size) < k).view(groups, group_size).float()
    # the padding: weight 0 in the search, and the group's own values for its range
    g = torch.where(real.bool(), g, g[..., :1])
    scale, low = torch.empty(n, groups, 1), torch.empty(n, groups, 1)
    for r in range(0, n, 256):  # rows a few at a time: the search's temporaries stay in cache
        scale[r : r + 256], low[r : r + 256] = int4_params(g[r : r + 256], real)
    codes = int4_codes(g, scale, low).view(n, -1)
    return pack_int4(codes, scale.squeeze(-1), low.squeeze(-1))


def pack_int4(
    codes: torch.Tensor, scale: torch.Tensor, low: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """codes [N, Kp] (0..15), scale and low [N, groups] -> (packed codes [Np / 64, Kp / 8, 4,
    16, 4] uint8, scales [Np / 64, groups, 2, 4, 16] float16: per group the 4 panels' scales,
    then their minima)."""
    u = _to_panels(codes.to(torch.uint8), fill=0)  # [P, Kp, 16]; padded channels: zeros
    octets = u.unflatten(1, (-1, 2, 4)).permute(0, 1, 4, 3, 2)  # [P, Kp / 8, 16, 4, half]
    packed = octets[..., 0] | (octets[..., 1] << 4)
    s = _interleave(_to_panels(scale.half(), fill=1.0))  # [Np / 64, groups, 4, 16]
    m = _interleave(_to_panels(low.half(), fill=0.0))
    return _interleave(packed), torch.stack([s, m], dim=2).contiguous()


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, n: int, k: int, group_size: int):
    packed = _deinterleave(packed)
    octets = torch.stack([packed & 15, packed >> 4], dim=-1)  # [P, Kp / 8, 16, 4, half]
    codes = octets.permute(0, 1, 4, 3, 2).flatten(1, 3)  # [P, Kp, 16]
    values = _from_panels(codes, n).float()
    s, m = (_from_panels(_deinterleave(scale[:, :, i]), n).float() for i in (0, 1))
    w = values * s.repeat_interleave(group_size, 1) + m.repeat_interleave(group_size, 1)
    return w[:, :k]


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
    """int4 weights in groups along the input features, a scale and a minimum per group.
    `quantized`: (codes [N, Kp], scale, low [N, groups]) chosen elsewhere (the calibration);
    None: `quantize_int4` rounds `weight` to nearest."""

    def __init__(
        self, weight, bias=None, native: bool = True, group_size: int = 32, quantized=None
    ) -> None:
        super().__init__(weight, bias, native)
        self.group_size = group_size
        if quantized is None:
            self.q, self.scale = quantize_int4(weight, group_size)
        else:
            _check_group(group_size)
            self.q, self.scale = pack_int4(*quantized)

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
