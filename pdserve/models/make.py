"""Write a random-weight Hugging Face model folder (config, safetensors weights, tokenizer).

The folder loads with `transformers` offline and with pdserve's own loader. Weights are seeded per
tensor (seed + tensor name), so a model's values do not depend on sharding or on the write order,
and they are scaled so that activations stay O(1) and greedy logits are well separated:
embeddings and lm_head N(0, 1), other linear weights N(0, 1/fan_in), norm weights U(0.5, 1.5),
biases N(0, 0.1^2). Tensors are generated one shard at a time, so memory holds one shard at most.
"""

from __future__ import annotations

import json
import math
import os
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

from pdserve.models.presets import (
    ARCHITECTURES,
    BOS_TOKEN_ID,
    EOS_TOKEN_ID,
    arch_of,
    default_preset,
    get_preset,
)

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>")  # ids 0..3: unk, bos, eos, pad
PAD_TOKEN_ID = 3
NUM_BYTE_TOKENS = 256
MIN_VOCAB_SIZE = len(SPECIAL_TOKENS) + NUM_BYTE_TOKENS
# Fields an override may set although a preset leaves them out (derived when absent).
OPTIONAL_FIELDS = ("head_dim",)
# Turns as <|role|>\n...</s>; tools (Hermes style) in a system turn, calls as <tool_call> JSON.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|system|>\n# Tools\n{% for tool in tools %}"
    "{{ tool | tojson }}\n{% endfor %}To call one, answer "
    '<tool_call>{"name": ..., "arguments": {...}}</tool_call>{{ eos_token }}\n{% endif %}'
    "{% for message in messages %}<|{{ message['role'] }}|>\n"
    "{% if message['content'] %}{{ message['content'] }}{% endif %}"
    "{% for call in message.get('tool_calls') or [] %}<tool_call>"
    '{{ {"name": call.function.name, "arguments": call.function.arguments} | tojson }}'
    "</tool_call>{% endfor %}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
_SIZE_UNITS = {"TB": 10**12, "GB": 10**9, "MB": 10**6, "KB": 10**3}


@dataclass(frozen=True)
class TensorSpec:
    """One weight to generate: its HF name, shape and init (`embedding|linear|norm|bias`)."""

    name: str
    shape: tuple[int, ...]
    init: str

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def write_random_model(
    out_dir: str | Path,
    preset: str | None = None,
    *,
    arch: str | None = None,
    dtype: str | None = None,
    seed: int = 0,
    max_shard_size: int | str | None = None,
    **config_overrides: Any,
) -> Path:
    """Write a random-weight model folder to `out_dir` and return its path.

    `preset` names a shape (see `presets.PRESETS`); `arch` alone picks that arch's tiny preset, and
    both together must agree. `config_overrides` are HF config fields (`num_hidden_layers=4`,
    `tie_word_embeddings=False`, ...). `dtype` is float32|bfloat16|float16 (default: the preset's).
    `max_shard_size` (bytes, or "2GB" with HF's decimal units) splits the weights into
    `model-0000i-of-0000N.safetensors` plus `model.safetensors.index.json`, as `save_pretrained` does.
    Weight files from an earlier write in the same folder are removed first.
    """
    config = build_config(preset, arch=arch, dtype=dtype, **config_overrides)
    max_shard_bytes = None if max_shard_size is None else parse_size(max_shard_size)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _remove_old_weights(out)
    specs = tensor_specs(config)
    write_weights(out, specs, DTYPES[config["torch_dtype"]], seed, max_shard_bytes)
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json", _generation_config(config))
    write_tokenizer(out, config["vocab_size"], config["max_position_embeddings"])
    return out


def build_config(
    preset: str | None = None,
    *,
    arch: str | None = None,
    dtype: str | None = None,
    **config_overrides: Any,
) -> dict[str, Any]:
    """The config.json dict of a preset with overrides applied, derived fields set, validated."""
    if preset is None:
        preset = default_preset(arch or "llama")
    config = get_preset(preset)
    if arch is not None:
        default_preset(arch)  # validates the name
        if arch != arch_of(preset):
            raise ValueError(f"arch {arch!r} does not match preset {preset!r} ({arch_of(preset)})")
    for key, value in config_overrides.items():
        if key not in config and key not in OPTIONAL_FIELDS:
            raise ValueError(f"unknown config field {key!r} for preset {preset!r}")
        config[key] = value
    if dtype is not None:
        config["torch_dtype"] = dtype
    _validate(config)
    return config


def _validate(config: dict[str, Any]) -> None:
    """Check the shapes (ValueError naming the field and value); derive head_dim if absent."""

    def check(ok: bool, field: str, why: str) -> None:
        if not ok:
            raise ValueError(f"{field}={config.get(field)!r}: {why}")

    for field in (
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "intermediate_size",
        "max_position_embeddings",
        "head_dim",
    ):
        if field == "head_dim" and field not in config:
            config["head_dim"] = config["hidden_size"] // config["num_attention_heads"]
        value = config[field]
        check(type(value) is int and value >= 1, field, "must be an integer >= 1")
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    check(heads % kv_heads == 0, "num_key_value_heads", f"must divide num_attention_heads={heads}")
    if config["model_type"] != "qwen3":
        check(
            config["head_dim"] * heads == config["hidden_size"],
            "hidden_size",
            f"must equal num_attention_heads={heads} * head_dim={config['head_dim']}",
        )
    vocab = config["vocab_size"]
    check(
        type(vocab) is int and vocab >= MIN_VOCAB_SIZE,
        "vocab_size",
        f"must be an integer >= {MIN_VOCAB_SIZE} (special + byte tokens)",
    )
    check(config["torch_dtype"] in DTYPES, "torch_dtype", f"must be one of {', '.join(DTYPES)}")


def tensor_specs(config: dict[str, Any]) -> list[TensorSpec]:
    """Every weight of the model, named and ordered as the HF model's `state_dict()`."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config["head_dim"]
    q_dim = config["num_attention_heads"] * head_dim
    kv_dim = config["num_key_value_heads"] * head_dim
    model_type = config["model_type"]
    qkv_bias = model_type == "qwen2" or bool(config.get("attention_bias", False))
    o_bias = model_type != "qwen2" and bool(config.get("attention_bias", False))
    mlp_bias = bool(config.get("mlp_bias", False))

    specs = [TensorSpec("model.embed_tokens.weight", (config["vocab_size"], hidden), "embedding")]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}"
        for proj, out_dim in (("q_proj", q_dim), ("k_proj", kv_dim), ("v_proj", kv_dim)):
            specs.append(TensorSpec(f"{p}.self_attn.{proj}.weight", (out_dim, hidden), "linear"))
            if qkv_bias:
                specs.append(TensorSpec(f"{p}.self_attn.{proj}.bias", (out_dim,), "bias"))
        specs.append(TensorSpec(f"{p}.self_attn.o_proj.weight", (hidden, q_dim), "linear"))
        if o_bias:
            specs.append(TensorSpec(f"{p}.self_attn.o_proj.bias", (hidden,), "bias"))
        if model_type == "qwen3":
            specs.append(TensorSpec(f"{p}.self_attn.q_norm.weight", (head_dim,), "norm"))
            specs.append(TensorSpec(f"{p}.self_attn.k_norm.weight", (head_dim,), "norm"))
        for proj, shape in (
            ("gate_proj", (inter, hidden)),
            ("up_proj", (inter, hidden)),
            ("down_proj", (hidden, inter)),
        ):
            specs.append(TensorSpec(f"{p}.mlp.{proj}.weight", shape, "linear"))
            if mlp_bias:
                specs.append(TensorSpec(f"{p}.mlp.{proj}.bias", (shape[0],), "bias"))
        specs.append(TensorSpec(f"{p}.input_layernorm.weight", (hidden,), "norm"))
        specs.append(TensorSpec(f"{p}.post_attention_layernorm.weight", (hidden,), "norm"))
    specs.append(TensorSpec("model.norm.weight", (hidden,), "norm"))
    if not config["tie_word_embeddings"]:
        # N(0, 1) like the embedding, so tied and untied models give logits of the same scale.
        specs.append(TensorSpec("lm_head.weight", (config["vocab_size"], hidden), "embedding"))
    return specs


def random_tensor(spec: TensorSpec, seed: int, dtype: torch.dtype) -> torch.Tensor:
    """The tensor of `spec`, a pure function of (seed, spec.name, spec.shape) and `dtype`."""
    name_hash = zlib.crc32(spec.name.encode())
    gen = torch.Generator().manual_seed((seed * 0x9E3779B1 + name_hash) % 2**63)
    if spec.init == "norm":
        t = torch.rand(spec.shape, generator=gen).add_(0.5)  # U(0.5, 1.5)
    else:
        t = torch.randn(spec.shape, generator=gen)
        if spec.init == "linear":
            t.mul_(1.0 / math.sqrt(spec.shape[1]))  # N(0, 1/fan_in); shape is [out, in]
        elif spec.init == "bias":
            t.mul_(0.1)
    return t.to(dtype)


def parse_size(size: int | str) -> int:
    """Bytes of `size`: an int, or a string like "2GB" / "500MB" (decimal units, as HF)."""
    if isinstance(size, int):
        value = size
    else:
        text = size.strip().upper()
        unit = text[-2:]
        try:
            value = int(float(text[:-2]) * _SIZE_UNITS[unit]) if unit in _SIZE_UNITS else int(text)
        except ValueError:
            raise ValueError(f"max_shard_size={size!r}: expected bytes or e.g. '2GB'") from None
    if value <= 0:
        raise ValueError(f"max_shard_size={size!r}: must be > 0")
    return value


def plan_shards(specs: list[TensorSpec], dtype_bytes: int, max_shard_bytes: int | None):
    """Group specs into shards with Hugging Face's greedy rule (huggingface_hub's splitter):
    in order, start a new shard when the next tensor would overflow the current one; a tensor
    bigger than the limit gets a shard of its own."""
    if max_shard_bytes is None:
        return [specs]
    shards: list[list[TensorSpec]] = []
    current: list[TensorSpec] = []
    current_bytes = 0
    for spec in specs:
        size = spec.numel * dtype_bytes
        if size > max_shard_bytes:
            shards.append([spec])
            continue
        if current_bytes + size > max_shard_bytes:
            shards.append(current)
            current, current_bytes = [], 0
        current.append(spec)
        current_bytes += size
    if current:
        shards.append(current)
    return shards


def write_weights(
    out: Path,
    specs: list[TensorSpec],
    dtype: torch.dtype,
    seed: int,
    max_shard_bytes: int | None = None,
) -> None:
    """Generate and write the weights shard by shard (plus the index when there are several)."""
    dtype_bytes = torch.finfo(dtype).bits // 8
    shards = plan_shards(specs, dtype_bytes, max_shard_bytes)
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards):
        if len(shards) == 1:
            filename = "model.safetensors"
        else:
            filename = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {spec.name: random_tensor(spec, seed, dtype) for spec in shard}
        save_file(tensors, str(out / filename), metadata={"format": "pt"})
        _like_any_other_file(out / filename)
        del tensors
        weight_map.update({spec.name: filename for spec in shard})
    if len(shards) > 1:
        total_params = sum(s.numel for s in specs)
        index = {
            "metadata": {
                "total_parameters": total_params,
                "total_size": total_params * dtype_bytes,
            },
            "weight_map": weight_map,
        }
        with open(out / "model.safetensors.index.json", "w", encoding="utf-8") as f:
            f.write(json.dumps(index, indent=2, sort_keys=True) + "\n")


def _like_any_other_file(path: Path) -> None:
    """safetensors writes 0600; the weights get the mode the umask gives any new file, like the
    JSON files beside them."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def _remove_old_weights(out: Path) -> None:
    for path in [*out.glob("model*.safetensors"), out / "model.safetensors.index.json"]:
        if path.is_file():
            path.unlink()


def _generation_config(config: dict[str, Any]) -> dict[str, Any]:
    return {
        "bos_token_id": config["bos_token_id"],
        "eos_token_id": config["eos_token_id"],
        "pad_token_id": PAD_TOKEN_ID,
        "do_sample": False,
    }


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


# ---------------------------------------------------------------------------------------------
# Tokenizer


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: each byte maps to one printable character."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def build_tokenizer(vocab_size: int) -> Tokenizer:
    """A byte-level tokenizer with exactly `vocab_size` ids.

    Ids 0-3 are `<unk> <s> </s> <pad>`, 4-259 the 256 bytes in byte order, and the rest normal
    filler tokens `<t_ID>`, so every id a model can sample decodes to text. No merges: text
    encodes one token per UTF-8 byte, and encode/decode round-trips any text. BOS is prepended.
    """
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"vocab_size={vocab_size}: must be >= {MIN_VOCAB_SIZE}")
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    byte_chars = byte_to_unicode()
    for byte in range(NUM_BYTE_TOKENS):
        vocab[byte_chars[byte]] = len(vocab)
    for token_id in range(len(vocab), vocab_size):
        vocab[f"<t_{token_id}>"] = token_id
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    bos = SPECIAL_TOKENS[BOS_TOKEN_ID]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, BOS_TOKEN_ID)]
    )
    return tok


def write_tokenizer(out: Path, vocab_size: int, max_length: int) -> None:
    """Write tokenizer.json and tokenizer_config.json (loadable by `AutoTokenizer`)."""
    build_tokenizer(vocab_size).save(str(out / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIAL_TOKENS[BOS_TOKEN_ID],
        "eos_token": SPECIAL_TOKENS[EOS_TOKEN_ID],
        "unk_token": SPECIAL_TOKENS[0],
        "pad_token": SPECIAL_TOKENS[PAD_TOKEN_ID],
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_length,
        "chat_template": CHAT_TEMPLATE,
    }
    _write_json(out / "tokenizer_config.json", tokenizer_config)


__all__ = [
    "ARCHITECTURES",
    "DTYPES",
    "TensorSpec",
    "build_config",
    "build_tokenizer",
    "parse_size",
    "plan_shards",
    "random_tensor",
    "tensor_specs",
    "write_random_model",
    "write_tokenizer",
]
