"""The model's tokenizer, loaded without importing torch: the one loader of the project.

`transformers.AutoTokenizer` imports torch (transformers 5: its module pulls in the model config
classes, and those import torch when it is installed), and the server's frontend must not: it
never runs a model, and torch costs it seconds of start-up and memory. The tokenizer
classes themselves (`TokenizersBackend`, `LlamaTokenizer`, `Qwen2Tokenizer`, ...) do not import
torch, so this module picks the class `AutoTokenizer.from_pretrained(folder)` would pick, reading
`tokenizer_config.json` and `config.json` itself, and calls that class's `from_pretrained`: the
same tokenizer, with the same special tokens, BOS/EOS handling and chat template
(tests/unit/test_tokenizer.py compares them). Local folders only; tokenizers that need custom code
(`auto_map`) are refused, as `AutoTokenizer` refuses them without `trust_remote_code`. Under
transformers 4 (no `TokenizersBackend`), `AutoTokenizer` itself loads the tokenizer.

The frontend, the offline `LLMEngine`, the workers' grammar compiler and `pdserve bench` all load
their tokenizer here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# transformers 5's registry (`TOKENIZER_MAPPING_NAMES`) for the architectures pdserve runs: the
# class `AutoTokenizer` uses for a model type when `tokenizer_config.json` names none, or when the
# one it names is a different one (see `tokenizer_class`). "llama" has no entry: TokenizersBackend.
REGISTERED_CLASSES = {
    "qwen2": "Qwen2Tokenizer",
    "qwen3": "Qwen2Tokenizer",
    "mistral": "TokenizersBackend",  # "MistralCommonBackend" with mistral-common: not supported
}
# transformers 5's `MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS`, for those architectures: the model
# type's registered class wins over the class `tokenizer_config.json` names.
HUB_CLASS_IGNORED = {"qwen2"}
GENERIC_CLASSES = {"TokenizersBackend", "PythonBackend", "PreTrainedTokenizerFast"}


def load_tokenizer(path: str | Path) -> Any:
    """`AutoTokenizer.from_pretrained(path)` without importing torch; ValueError if it cannot."""
    import transformers

    if not hasattr(transformers, "TokenizersBackend"):  # transformers 4: its own AutoTokenizer
        from transformers import AutoTokenizer

        return _load(AutoTokenizer, path)
    folder = Path(path)
    if not folder.is_dir():
        raise ValueError(f"invalid tokenizer={str(path)!r}: not a folder")
    return _load(tokenizer_class(folder), folder)


def _load(cls: Any, path: str | Path) -> Any:
    try:
        return cls.from_pretrained(str(path))
    except (OSError, ValueError) as e:
        raise ValueError(f"invalid tokenizer={str(path)!r}: {e}") from None


def tokenizer_class(folder: Path) -> type:
    """The class transformers 5's `AutoTokenizer.from_pretrained(folder)` loads `folder` with:
    its choice for a local folder, step by step, for the architectures pdserve runs."""
    import transformers

    backend = transformers.TokenizersBackend
    tokenizer_config = _read_json(folder / "tokenizer_config.json")
    config = _read_json(folder / "config.json")
    auto_map = tokenizer_config.get("auto_map")
    if isinstance(auto_map, dict):
        auto_map = auto_map.get("AutoTokenizer")
    if auto_map:
        raise ValueError(
            f"invalid tokenizer={str(folder)!r}: it needs custom code (auto_map), "
            "which pdserve does not run"
        )
    model_type = config.get("model_type")
    registered = REGISTERED_CLASSES.get(model_type)
    declared = tokenizer_config.get("tokenizer_class") or config.get("tokenizer_class")
    if declared is None:
        return (_class_named(registered) if registered else None) or backend
    hub = declared.removesuffix("Fast")
    if hub == "LlamaTokenizer" and model_type not in HUB_CLASS_IGNORED and _byte_level(folder):
        return backend  # LlamaTokenizer would impose its Metaspace pre-tokenizer
    if registered is not None and registered != hub:
        if registered not in GENERIC_CLASSES:
            cls = _class_named(registered if model_type in HUB_CLASS_IGNORED else declared)
            if cls is not None and cls.__name__ not in GENERIC_CLASSES:
                return cls
        return backend
    cls = _class_named(hub) or _class_named(hub + "Fast")
    return backend if cls is None or cls.__name__ == "PythonBackend" else cls


def _class_named(name: str) -> type | None:
    """A tokenizer class transformers exports under `name` (its `Fast` names are aliases)."""
    import transformers

    cls = getattr(transformers, name, None)
    return cls if isinstance(cls, type) else None


def _byte_level(folder: Path) -> bool:
    """Whether tokenizer.json has a ByteLevel pre-tokenizer or decoder (transformers' own test)."""
    path = folder / "tokenizer.json"
    return path.is_file() and '"ByteLevel"' in path.read_text(encoding="utf-8")


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"invalid tokenizer: cannot read {path}: {e}") from None
    return data if isinstance(data, dict) else {}
