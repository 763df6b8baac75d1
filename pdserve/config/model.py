"""What the engine needs from a Hugging Face `config.json`, parsed and validated once.

`ModelConfig` holds the shapes and options of a supported checkpoint (`RopeConfig` its rotary
embedding); a missing field or an unsupported architecture raises `ValueError` naming it. No torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve.config.settings import require

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "MistralForCausalLM",
)


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"  # "default" | "llama3" | "linear"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> RopeConfig:
        """Read the classic top-level `rope_theta`/`rope_scaling` or transformers 5 `rope_parameters`."""
        params = dict(cfg.get("rope_parameters") or {})
        scaling = dict(cfg.get("rope_scaling") or {})
        merged = {**scaling, **params}
        theta = merged.get("rope_theta", cfg.get("rope_theta", 10000.0))
        rope_type = merged.get("rope_type", merged.get("type", "default")) or "default"
        if rope_type not in ("default", "llama3", "linear"):
            raise ValueError(
                f"invalid rope_scaling.rope_type={rope_type!r}: supported are default, llama3, linear"
            )
        return cls(
            theta=float(theta),
            rope_type=rope_type,
            factor=float(merged.get("factor", 1.0)),
            low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
            high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(
                merged.get("original_max_position_embeddings", 8192)
            ),
        )


@dataclass(frozen=True)
class ModelConfig:
    """The shapes and options of a Llama-family checkpoint."""

    path: str
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope: RopeConfig
    tie_word_embeddings: bool
    qkv_bias: bool  # Qwen2
    qk_norm: bool  # Qwen3
    torch_dtype: str
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    sliding_window: int | None = None

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        if not path.is_dir():
            raise ValueError(f"invalid model={str(path)!r}: no such folder")
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise ValueError(f"invalid model={str(path)!r}: no config.json in that folder")
        try:
            cfg = json.loads(cfg_file.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"invalid model config {cfg_file}: not valid JSON ({e})") from None
        gen_file = path / "generation_config.json"
        gen = json.loads(gen_file.read_text()) if gen_file.is_file() else {}
        return cls.from_hf_dict(cfg, str(path), gen)

    @classmethod
    def from_hf_dict(
        cls, cfg: dict[str, Any], path: str = "", generation: dict[str, Any] | None = None
    ) -> ModelConfig:
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else None
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"invalid architectures={archs!r}: supported are {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        required = (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
        )
        missing = [k for k in required if k not in cfg]
        if missing:
            raise ValueError(f"invalid model config: missing field(s) {', '.join(missing)}")
        num_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        head_dim = cfg.get("head_dim") or hidden // num_heads
        eos = _eos_ids(cfg, generation or {})
        window = cfg.get("sliding_window")
        if arch == "Qwen2ForCausalLM" and not cfg.get("use_sliding_window", False):
            window = None
        return cls(
            path=path,
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope=RopeConfig.from_hf(cfg),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos,
            sliding_window=int(window) if window else None,
        )

    def __post_init__(self) -> None:
        require(
            self.num_heads % self.num_kv_heads == 0,
            "num_key_value_heads",
            self.num_kv_heads,
            f"must divide num_attention_heads ({self.num_heads})",
        )

    @property
    def max_model_len(self) -> int:
        """Longest sequence the engine serves. Sliding-window attention is not implemented, so a
        model with a window is capped at the window, where full attention is exact."""
        if self.sliding_window is not None:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings


def _eos_ids(cfg: dict[str, Any], gen: dict[str, Any]) -> tuple[int, ...]:
    ids: list[int] = []
    for src in (gen.get("eos_token_id"), cfg.get("eos_token_id")):
        if src is None:
            continue
        for i in src if isinstance(src, list) else [src]:
            if i not in ids:
                ids.append(int(i))
    return tuple(ids)
