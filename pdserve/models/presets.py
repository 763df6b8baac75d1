"""Model presets: Hugging Face config fields for the random-weight models of `make.py`.

A preset is a plain dict of `config.json` fields (classic top-level `rope_theta` / `rope_scaling`).
The `*-tiny` presets are for tests; the others copy the shapes of real checkpoints so benchmarks
see realistic FLOPs and bytes. `head_dim` is explicit only where it is not hidden_size / num_heads
(Qwen3); `make.py` derives it for the other archs after overrides. No torch here.

The tiny presets are untied on purpose: with random tied weights the logits are dominated by
e_last . e_last, so greedy decoding echoes the last token and greedy-equality tests would see
little of the context. Pass `tie_word_embeddings=True` (`--tie`) to exercise the tied path.
"""

from __future__ import annotations

import copy
from typing import Any

# arch name (the HF model_type) -> HF model class
ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
}

# Token ids of the byte-level tokenizer written next to every model (see make.py).
BOS_TOKEN_ID = 1
EOS_TOKEN_ID = 2


def _common(arch: str) -> dict[str, Any]:
    return {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        "hidden_act": "silu",
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "bos_token_id": BOS_TOKEN_ID,
        "eos_token_id": EOS_TOKEN_ID,
        "use_cache": True,
        "rope_scaling": None,
    }


def _llama(**fields: Any) -> dict[str, Any]:
    base = _common("llama") | {
        "attention_bias": False,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
    }
    return base | fields


def _qwen2(**fields: Any) -> dict[str, Any]:
    # Qwen2 always has q/k/v biases (no config field for it); sliding windows are off.
    base = _common("qwen2") | {
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "use_sliding_window": False,
        "sliding_window": None,
    }
    return base | fields


def _qwen3(**fields: Any) -> dict[str, Any]:
    # Qwen3: RMSNorm over head_dim on q and k (q_norm / k_norm), no biases, explicit head_dim.
    base = _common("qwen3") | {
        "attention_bias": False,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "use_sliding_window": False,
        "sliding_window": None,
    }
    return base | fields


def _mistral(**fields: Any) -> dict[str, Any]:
    base = _common("mistral") | {
        "rms_norm_eps": 1e-5,
        "rope_theta": 1000000.0,
        "sliding_window": None,
    }
    return base | fields


def _tiny(**fields: Any) -> dict[str, Any]:
    shape = {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
        "vocab_size": 512,
        "max_position_embeddings": 2048,
        "torch_dtype": "float32",
    }
    return shape | fields


PRESETS: dict[str, dict[str, Any]] = {
    "llama-tiny": _llama(**_tiny(tie_word_embeddings=False)),
    "qwen2-tiny": _qwen2(**_tiny(tie_word_embeddings=False)),
    "qwen3-tiny": _qwen3(**_tiny(head_dim=32, tie_word_embeddings=False)),
    "mistral-tiny": _mistral(**_tiny(tie_word_embeddings=False)),
    "llama-125m": _llama(
        hidden_size=768,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=4,
        intermediate_size=3072,
        vocab_size=32000,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        torch_dtype="float32",
    ),
    "qwen2.5-0.5b": _qwen2(
        hidden_size=896,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        intermediate_size=4864,
        vocab_size=151936,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
        torch_dtype="bfloat16",
    ),
    "qwen3-0.6b": _qwen3(
        hidden_size=1024,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=3072,
        vocab_size=151936,
        max_position_embeddings=40960,
        tie_word_embeddings=True,
        torch_dtype="bfloat16",
    ),
    "llama-3.2-1b": _llama(
        hidden_size=2048,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=8192,
        vocab_size=128256,
        max_position_embeddings=131072,
        tie_word_embeddings=True,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        torch_dtype="bfloat16",
    ),
}


def get_preset(name: str) -> dict[str, Any]:
    """A fresh copy of preset `name`; ValueError naming the known presets if there is none."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known presets: {', '.join(PRESETS)}")
    return copy.deepcopy(PRESETS[name])


def arch_of(preset: str) -> str:
    """The arch (`llama`, `qwen2`, ...) of a preset."""
    return get_preset(preset)["model_type"]


def default_preset(arch: str) -> str:
    """The tiny preset of an arch; ValueError naming the known archs if it is unknown."""
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown arch {arch!r}; known archs: {', '.join(ARCHITECTURES)}")
    return f"{arch}-tiny"
