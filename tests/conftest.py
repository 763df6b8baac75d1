"""Shared fixtures: the real tiny model, random-weight model folders, engine factories."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

SHARED = Path(__file__).resolve().parents[2] / "shared"
STORIES = SHARED / "models" / "stories260K"
TRACES = SHARED / "traces"


@pytest.fixture(scope="session")
def stories_path() -> str:
    if not STORIES.is_dir():
        pytest.skip(f"{STORIES} not present")
    return str(STORIES)


@pytest.fixture(scope="session")
def stories_reference_text() -> str:
    """The greedy continuation of [1] that the model's README documents (200 new tokens)."""
    readme = STORIES.parent / "README.md"
    if not readme.is_file():
        pytest.skip(f"{readme} not present")
    readme = readme.read_text()
    return re.search(r"```\n(.*?)\n```", readme, re.S).group(1)


HELD_OUT_STORIES = [  # written for the quantization tests, not from the model's training data
    "Tom had a small dog named Max. Every morning they walked to the river. One day Max found "
    "a shiny stone and gave it to Tom. Tom was very happy and said thank you.",
    "Sue liked to bake cakes with her mom. They put sugar, eggs and milk in a big bowl. The "
    "cake was warm and sweet, and Sue shared it with her friends.",
    "A little bird could not fly. It sat in a tree and felt sad. A kind boy came and helped "
    "the bird. Soon the bird was strong and flew up high in the sky.",
]


@pytest.fixture(scope="session")
def held_out_stories() -> list[str]:
    """Stories the tiny model has not seen (benchmarks/quant_bench.py --quality uses the same)."""
    return HELD_OUT_STORIES


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, str]:
    """Random-weight folders of each supported architecture, in small shapes."""
    from pdserve.models.make import write_random_model

    root = tmp_path_factory.mktemp("models")
    return {
        arch: str(write_random_model(root / arch, f"{arch}-tiny", seed=1))
        for arch in ("llama", "qwen2", "qwen3", "mistral")
    }
