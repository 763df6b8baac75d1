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
    readme = (STORIES.parent / "README.md").read_text()
    return re.search(r"```\n(.*?)\n```", readme, re.S).group(1)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, str]:
    """Random-weight folders of each supported architecture, in small shapes."""
    from pdserve.models.make import write_random_model

    root = tmp_path_factory.mktemp("models")
    return {
        arch: str(write_random_model(root / arch, f"{arch}-tiny", seed=1))
        for arch in ("llama", "qwen2", "qwen3", "mistral")
    }
