"""Build a model without materialising random weights, then fill it from memory-mapped safetensors.

The module tree is created on the meta device (no memory), given uninitialised storage on the
target device, and every parameter is then copied from the checkpoint exactly once; a parameter
the checkpoint does not fill, a tensor of the wrong shape and an unreadable file are each a
`ValueError` that names the file and the tensor.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from pdserve.config import ModelConfig
from pdserve.models.attention import AttentionBackend
from pdserve.models.registry import model_class

logger = logging.getLogger(__name__)

# checkpoint name fragment -> (fused parameter fragment, index of the shard within it)
_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ValueError(f"invalid weight index {index}: {e}") from None
        files = sorted({path / f for f in weight_map.values()})
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"invalid model={str(path)!r}: no *.safetensors weight files")
    for f in files:
        if not f.is_file():
            raise ValueError(f"invalid model={str(path)!r}: weight file {f.name} is missing")
    return files


def iter_checkpoint(files: list[Path]) -> Iterator[tuple[Path, str, torch.Tensor]]:
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():  # noqa: SIM118 (safe_open is not a dict)
                    try:
                        yield f, name, st.get_tensor(name)
                    except SafetensorError as e:
                        raise ValueError(f"corrupt weight file {f}: tensor {name}: {e}") from None
        except SafetensorError as e:
            raise ValueError(f"corrupt weight file {f}: {e}") from None


def _shard_slices(model: nn.Module, cfg: ModelConfig) -> dict[str, list[tuple[int, int]]]:
    """Row ranges of the shards inside each fused parameter kind."""
    q = cfg.num_heads * cfg.head_dim
    kv = cfg.num_kv_heads * cfg.head_dim
    inter = cfg.intermediate_size
    return {
        "qkv_proj": [(0, q), (q, q + kv), (q + kv, q + 2 * kv)],
        "gate_up_proj": [(0, inter), (inter, 2 * inter)],
    }


def _target(name: str) -> tuple[str, int | None]:
    """Map an HF tensor name to (our parameter name, shard index or None)."""
    name = name.removeprefix("model.")
    for frag, (fused, idx) in _FUSED.items():
        if f".{frag}." in name:
            return name.replace(f".{frag}.", f".{fused}."), idx
    return name, None


def _checkpoint_name(pname: str, shard: int | None) -> str:
    """Our parameter (and shard) -> the Hugging Face tensor name it is loaded from."""
    if shard is not None:
        fused = pname.split(".")[-2]
        frag = next(f for f, (fz, i) in _FUSED.items() if fz == fused and i == shard)
        pname = pname.replace(f".{fused}.", f".{frag}.")
    return pname if pname.startswith("lm_head") else f"model.{pname}"


def load_model(
    cfg: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    max_len: int,
    linear_backend: str = "auto",
    attn_backend: AttentionBackend | None = None,
    quantization: str = "none",
    group_size: int = 32,
    tp: tuple[int, int] = (0, 1),
    calibration_tokens: int = 0,
) -> nn.Module:
    """Build and fill the model. `linear_backend`: "torch" (F.linear), "native" (pdserve's
    kernel, CPU float32), "onednn" (prepacked weights, CPU float32), or "auto" (the first of
    native and onednn that works here; but for "torch", the norms, rotary embedding and MLP
    activation run on the native kernels too where they build). `attn_backend`: how its layers
    attend (None: the model's default, `PagedSDPABackend`). `quantization`: "int8" or "int4"
    replaces every linear layer (the tied output head included) by its weight-only quantized
    form, whatever `linear_backend` says; int4 calibrated on `calibration_tokens` tokens the
    model samples (`pdserve.models.calibrate`; 0, or a shard: rounded to nearest). `tp` =
    (rank, size): build rank's shard of a tensor-parallel model
    (`pdserve.runner.tensor_parallel`)."""
    rank, size = tp
    if size > 1:
        from pdserve.models.tp_shard import shard_config, shard_of

        cfg = shard_config(cfg, size)
    cls = model_class(cfg.architecture)
    with torch.device("meta"):
        model = cls(cfg, attn_backend)
    model = model.to_empty(device=device).to(dtype)
    params = dict(model.named_parameters())
    slices = _shard_slices(model, cfg)
    expected: set[tuple[str, int | None]] = set()
    for pname in params:
        kind = pname.split(".")[-2]
        if kind in slices:
            expected.update((pname, i) for i in range(len(slices[kind])))
        else:
            expected.add((pname, None))
    loaded: set[tuple[str, int | None]] = set()
    files = safetensors_files(Path(cfg.path))
    with torch.no_grad():
        for file, name, tensor in iter_checkpoint(files):
            if cfg.tie_word_embeddings and name == "lm_head.weight":
                continue
            if size > 1:
                tensor = shard_of(name, tensor, cfg, rank)
            pname, shard = _target(name)
            param = params.get(pname)
            if param is None:
                if "rotary_emb" in name:
                    continue
                raise ValueError(f"unexpected tensor {name} in {file.name}")
            dst = param if shard is None else param[slice(*slices[pname.split(".")[-2]][shard])]
            if dst.shape != tensor.shape:
                raise ValueError(
                    f"tensor {name} in {file.name} has shape {tuple(tensor.shape)}, "
                    f"expected {tuple(dst.shape)}"
                )
            dst.copy_(tensor)
            loaded.add((pname, shard))
    missing = sorted(_checkpoint_name(p, shard) for p, shard in expected - loaded)
    if missing:
        raise ValueError(
            f"weights missing from {', '.join(f.name for f in files)}: {', '.join(missing)}"
        )
    model.rope.build(max_len, device, dtype)
    if quantization != "none":
        tokens = calibration_tokens if size == 1 else 0
        if calibration_tokens and size > 1 and quantization == "int4":
            logger.warning(
                "int4 rounds each tensor-parallel shard to nearest: the calibration needs the "
                "whole model in one process"
            )
        quantize_linears(model, quantization, group_size, device, dtype, tokens, max_len)
    else:
        _select_linear_backend(model, linear_backend, device, dtype)
    if linear_backend != "torch" or quantization != "none":
        _select_layer_ops(model, device, dtype)
    if device.type == "cpu":
        _streamed_weights_to_huge_pages(model)
    return model.eval()


def _streamed_weights_to_huge_pages(model: nn.Module) -> None:
    """The weights the native kernels stream every step (packed float32, int8 and int4), moved
    into one arena on huge pages, in the order the layers run them (`kernels/huge_pages.py`).
    `torch` and `onednn` layers keep torch's memory."""
    from pdserve.kernels import huge_pages
    from pdserve.models.packed_linear import NativeLinear
    from pdserve.models.quant_linear import Int4Linear, Int8Linear

    if not huge_pages.available():
        return
    streamed = NativeLinear | Int8Linear | Int4Linear
    slots = [(m, name) for m in model.modules() if isinstance(m, streamed)
             for name in ("w", "q", "scale", "bias")
             if isinstance(getattr(m, name, None), torch.Tensor)]  # fmt: skip
    if not slots:
        return
    copies = huge_pages.arena([getattr(m, name) for m, name in slots])
    for (m, name), copy in zip(slots, copies):
        setattr(m, name, copy)
    nbytes = sum(c.numel() * c.element_size() for c in copies)
    logger.info(
        "weights the kernels stream: %.1f MiB in one arena, %.1f MiB of it on huge pages",
        nbytes / 2**20, huge_pages.huge_bytes(copies[0]) / 2**20,
    )  # fmt: skip


def _select_layer_ops(model: nn.Module, device, dtype) -> None:
    """The layers' per-token operations on pdserve's CPU kernels where they run (float32 on the
    CPU, a compiler here); torch's otherwise, and with `linear_backend="torch"`, which keeps the
    whole float32 model on torch's ops."""
    from pdserve.kernels.build import available
    from pdserve.models.llama import use_native_ops

    if device.type != "cpu" or dtype != torch.float32:
        return
    ok, why = available()
    if not ok:
        logger.warning("the native layer kernels are unavailable (%s): torch's ops", why)
        return
    use_native_ops(model)


def quantize_linears(
    model: nn.Module,
    quantization: str,
    group_size: int,
    device,
    dtype,
    calibration_tokens: int = 0,
    max_len: int = 256,
) -> None:
    from pdserve.kernels.linear import available
    from pdserve.models.packed_linear import replace_linears
    from pdserve.models.quant_linear import Int4Linear, Int8Linear

    if device.type != "cpu" or dtype != torch.float32:
        raise ValueError(
            f"invalid quantization={quantization!r}: weight-only quantization runs on the CPU "
            f"with float32 activations (device={device}, dtype={dtype})"
        )
    native, why = available()
    if not native:
        logger.warning("quantized layers dequantize every step (slow): %s", why)
    before = sum(p.numel() * p.element_size() for p in model.parameters())
    if quantization == "int8":
        replace_linears(model, lambda w, b: Int8Linear(w, b, native))
    elif quantization == "int4" and calibration_tokens > 0:
        from pdserve.models.calibrate import calibrate_int4

        calibrate_int4(model, group_size, native, calibration_tokens, max_len)
    elif quantization == "int4":
        replace_linears(model, lambda w, b: Int4Linear(w, b, native, group_size))
    else:
        raise ValueError(f"invalid quantization={quantization!r}: choose none, int8 or int4")
    after = sum(p.numel() * p.element_size() for p in model.parameters())
    after += sum(m.nbytes for m in model.modules() if hasattr(m, "nbytes"))
    logger.info(
        "weights %s: %.1f MiB -> %.1f MiB (the embedding table stays float for the input gather)",
        quantization, before / 2**20, after / 2**20,
    )  # fmt: skip


def _select_linear_backend(model: nn.Module, backend: str, device, dtype) -> None:
    from pdserve.models.packed_linear import native_available, onednn_available, pack_linears

    if backend == "torch":
        return
    if backend in ("native", "auto"):
        ok, why = native_available(device, dtype)
        if ok:
            pack_linears(model, "native")
            return
        if backend == "native":
            raise ValueError(f"invalid linear_backend='native': {why}")
        if device.type == "cpu" and dtype == torch.float32:
            logger.warning("the native matmul kernel is unavailable (%s): trying oneDNN", why)
    if not onednn_available(device, dtype):
        if backend == "onednn":
            raise ValueError(
                f"invalid linear_backend='onednn': needs a CPU, float32 and torch's oneDNN ops "
                f"(device={device}, dtype={dtype})"
            )
        return
    pack_linears(model, "onednn")
