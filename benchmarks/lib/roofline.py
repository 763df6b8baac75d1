"""Section 1 of engine_bench.py: this machine's roofline. fp32 GEMM FLOP/s and read and copy
bandwidth (`pdserve.perf.hardware`), and the ceilings of plain torch on the model's own weights
(layer GEMMs at 512 rows, GEMVs at 1 row), with torch's default GEMM (MKL) and with oneDNN on
prepacked weights."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from lib.engine_common import BenchConfig
from lib.quiet import Quiet, best_time
from pdserve import LLM
from pdserve.perf.hardware import cpu_name, measure_bandwidth, measure_gemm_flops


def matrices_of(model_dir: Path) -> list[torch.Tensor]:
    """The 2-D weights a forward multiplies by, read from the checkpoint (the engine may hold them
    prepacked): every projection, and the output matrix once (the tied embedding as lm_head)."""
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    tied = "lm_head.weight" not in tensors
    return [
        t for name, t in tensors.items() if t.dim() == 2 and (tied or "embed_tokens" not in name)
    ]


def _default_linear(weights: list[torch.Tensor]):
    return weights, F.linear


def _onednn_linear(weights: list[torch.Tensor]):
    """oneDNN with weights prepacked once: the private ops Inductor's CPU freezing pass uses.
    None where this torch lacks them or they disagree with F.linear."""
    try:
        packed = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in weights]

        def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [None], "")

        probe = torch.randn(3, weights[0].shape[1])
        if not torch.allclose(linear(probe, packed[0]), F.linear(probe, weights[0]), atol=1e-4):
            return None
    except (AttributeError, RuntimeError):
        return None
    return packed, linear


def linear_ceiling(
    weights: list[torch.Tensor], rows: int, repeats: int, kernel=_default_linear
) -> tuple[float, float] | None:
    """(FLOP/s, weight bytes/s) of multiplying `rows` input rows by every matrix in turn."""
    prepared = kernel(weights)
    if prepared is None:
        return None
    operands, linear = prepared
    flops = sum(2.0 * rows * w.shape[0] * w.shape[1] for w in weights)
    num_bytes = sum(w.numel() * w.element_size() for w in weights)
    inputs = [torch.randn(rows, w.shape[1]) for w in weights]

    def run() -> None:
        for x, w in zip(inputs, operands):
            linear(x, w)

    with torch.inference_mode():
        t = best_time(run, repeats)
    return flops / t, num_bytes / t


def bench_roofline(cfg: BenchConfig, quiet: Quiet, llm: LLM) -> dict[str, Any]:
    gemm = quiet.run("gemm", lambda: measure_gemm_flops("float32", seconds=cfg.gemm_seconds))
    bw = quiet.run("bandwidth", lambda: measure_bandwidth(seconds=cfg.bandwidth_seconds))
    weights = matrices_of(Path(llm.engine.args.model))
    layer_weights = [w for w in weights if max(w.shape) < 30_000]  # without the lm_head
    rep = cfg.ceiling_repeats
    ceilings = {}
    for label, kernel in (("torch", _default_linear), ("onednn", _onednn_linear)):
        gemm_512 = quiet.run(
            f"{label} linear 512", lambda k=kernel: linear_ceiling(layer_weights, 512, 2, k)
        )
        gemv = quiet.run(f"{label} gemv", lambda k=kernel: linear_ceiling(weights, 1, rep, k))
        ceilings[label] = (gemm_512, gemv)
    t512, t1 = ceilings["torch"]
    o512, o1 = ceilings["onednn"]
    return {
        "cpu": cpu_name(),
        "gemm_flops_s": gemm.value,
        "read_bytes_s": bw.value[0],
        "copy_bytes_s": bw.value[1],
        "linear_512_flops_s": t512.value[0],
        "gemv_bytes_s": t1.value[1],
        "onednn_linear_512_flops_s": o512.value[0] if o512.value else None,
        "onednn_gemv_bytes_s": o1.value[1] if o1.value else None,
        "foreign_cores": {
            "gemm": gemm.foreign_cores,
            "bandwidth": bw.foreign_cores,
            "linear_512": t512.foreign_cores,
            "gemv": t1.foreign_cores,
        },
    }
