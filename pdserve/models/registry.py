"""Architecture name (config.json `architectures[0]`) -> model class."""

from __future__ import annotations

from torch import nn

from pdserve.config import SUPPORTED_ARCHITECTURES


def model_class(architecture: str) -> type[nn.Module]:
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"invalid architecture={architecture!r}: supported are "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    from pdserve.models.llama import LlamaForCausalLM

    return LlamaForCausalLM  # the four share one implementation (see llama.py)
