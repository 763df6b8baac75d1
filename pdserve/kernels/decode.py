"""The fused decode step's C interface (`cpu_decode.c`): the layer and step descriptors.

`LayerDesc` holds the pointers and shapes of one decoder layer (filled once, when the model is
loaded: `pdserve.models.fused_decode`), `StepDesc` those of one step; `decode_step(layers, n,
step, x, norm, eps, out[, head, logits, tokens])` runs the first `n` layers of an array of them
on the step's tokens (updating `x` in place), the model's final norm into `out` and, given a
head's `LinearDesc`, the logits and, given `tokens`, each row's argmax, in one call;
`decode_burst` runs several such steps, each row's argmax embedded as its next input. The
descriptors hold raw pointers: whoever fills them keeps the tensors alive.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from pdserve.kernels.build import available as available  # re-exported
from pdserve.kernels.build import library

_I, _F, _P = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
KINDS = {"f32": 0, "int8": 1, "int4": 2}


class LinearDesc(ctypes.Structure):
    _fields_ = [("kind", _I), ("group", _I), ("n", _I), ("k", _I), ("w", _P), ("scale", _P),
                ("bias", _P)]  # fmt: skip


class LayerDesc(ctypes.Structure):
    _fields_ = [
        ("hidden", _I), ("hq", _I), ("hkv", _I), ("d", _I), ("inter", _I), ("kv_int8", _I),
        ("eps", _F), ("in_norm", _P), ("post_norm", _P), ("q_norm", _P), ("k_norm", _P),
        ("qkv", LinearDesc), ("o", LinearDesc), ("gate_up", LinearDesc), ("down", LinearDesc),
        ("k_cache", _P), ("v_cache", _P),
    ]  # fmt: skip


class StepDesc(ctypes.Structure):
    _fields_ = [("nd", _I), ("positions", _P), ("new_slots", _P), ("ctx_slots", _P),
                ("slots_stride", _I), ("lens", _P), ("cos", _P), ("sin", _P),
                ("scratch", _P)]  # fmt: skip


@functools.cache
def _lib() -> ctypes.CDLL:
    lib = library()
    lib.pd_decode_step.argtypes = [ctypes.POINTER(LayerDesc), _I, ctypes.POINTER(StepDesc), _P,
                                   _P, _F, _P, ctypes.POINTER(LinearDesc), _P, _P]  # fmt: skip
    lib.pd_decode_step.restype = ctypes.c_int
    lib.pd_decode_scratch_floats.argtypes = [ctypes.POINTER(LayerDesc), _I]
    lib.pd_decode_scratch_floats.restype = _I
    lib.pd_decode_burst.argtypes = [ctypes.POINTER(LayerDesc), _I, ctypes.POINTER(StepDesc), _I,
                                    _P, _P, _F, _P, ctypes.POINTER(LinearDesc), _P, _P, _P,
                                    _I]  # fmt: skip
    lib.pd_decode_burst.restype = ctypes.c_int
    lib.pd_argmax_rows.argtypes = [_P, _I, _I, _P]
    lib.pd_argmax_rows.restype = ctypes.c_int
    return lib


def ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def scratch_floats(layer: LayerDesc, nd: int) -> int:
    return _lib().pd_decode_scratch_floats(ctypes.byref(layer), nd)


def decode_step(layers, n: int, step: StepDesc, x: torch.Tensor, norm: torch.Tensor,
                eps: float, out: torch.Tensor, head: LinearDesc | None = None,
                logits: torch.Tensor | None = None,
                tokens: torch.Tensor | None = None) -> None:  # fmt: skip
    """The first `n` layers of `layers` (a ctypes array of `LayerDesc`) on x [nd, hidden]
    (updated in place), then out[nd, hidden] = rmsnorm(x) * norm and, with `head`,
    logits[nd, head.n] = out @ W^T, and with `tokens` (int64 [nd]) each row's argmax."""
    if not 0 < n <= len(layers):
        raise ValueError(f"decode_step: {n} layers of {len(layers)}")
    nd = x.shape[0]
    if (head is None) != (logits is None) or (tokens is not None and head is None):
        raise ValueError("decode_step: a head needs its logits tensor, tokens need a head")
    if logits is not None and (logits.dtype != torch.float32 or not logits.is_contiguous()
                               or tuple(logits.shape) != (nd, head.n)):  # fmt: skip
        raise ValueError(f"decode_step: logits must be float32 [{nd}, {head.n}]")
    if tokens is not None and (tokens.dtype != torch.int64 or tuple(tokens.shape) != (nd,)):
        raise ValueError(f"decode_step: tokens must be int64 [{nd}]")
    rc = _lib().pd_decode_step(layers, n, ctypes.byref(step), x.data_ptr(), norm.data_ptr(),
                               eps, out.data_ptr(), None if head is None else ctypes.byref(head),
                               None if logits is None else logits.data_ptr(),
                               None if tokens is None else tokens.data_ptr())  # fmt: skip
    if rc == -1:
        raise MemoryError("decode_step: no memory for its buffers")
    if rc != 0:
        raise ValueError(f"decode_step: bad layer description (rc {rc})")


def decode_burst(layers, n: int, steps, x: torch.Tensor, norm: torch.Tensor, eps: float,
                 out: torch.Tensor, head: LinearDesc, logits: torch.Tensor, tokens: torch.Tensor,
                 embed: torch.Tensor) -> None:  # fmt: skip
    """`len(steps)` decode steps (a ctypes array of `StepDesc`, one per step) of the rows of x
    [nd, hidden] in one call: each step's greedy tokens go to tokens[s] (int64 [steps, nd]) and
    their rows of `embed` [vocab, hidden] are the next step's x."""
    if not 0 < n <= len(layers):
        raise ValueError(f"decode_burst: {n} layers of {len(layers)}")
    nd, hidden = x.shape
    if tuple(tokens.shape) != (len(steps), nd) or tokens.dtype != torch.int64:
        raise ValueError(f"decode_burst: tokens must be int64 [{len(steps)}, {nd}]")
    if tuple(logits.shape) != (nd, head.n) or logits.dtype != torch.float32:
        raise ValueError(f"decode_burst: logits must be float32 [{nd}, {head.n}]")
    if (embed.dtype != torch.float32 or not embed.is_contiguous() or embed.dim() != 2
            or embed.shape[1] != hidden):  # fmt: skip
        raise ValueError(f"decode_burst: embed must be float32 [vocab, {hidden}], contiguous")
    rc = _lib().pd_decode_burst(layers, n, steps, len(steps), x.data_ptr(), norm.data_ptr(),
                                eps, out.data_ptr(), ctypes.byref(head), logits.data_ptr(),
                                tokens.data_ptr(), embed.data_ptr(), embed.shape[0])  # fmt: skip
    if rc == -1:
        raise MemoryError("decode_burst: no memory for its buffers")
    if rc != 0:
        raise ValueError(f"decode_burst: bad layer or step description (rc {rc})")


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """Each row's argmax of x [m, n] (float32) as `decode_step` takes its greedy tokens."""
    x = x.to(torch.float32).contiguous()
    if x.dim() != 2:
        raise ValueError(f"argmax_rows: x must be [m, n], got {tuple(x.shape)}")
    out = torch.empty(x.shape[0], dtype=torch.int64)
    _lib().pd_argmax_rows(x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr())
    return out
