from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from server_harness import start_server  # noqa: E402


@pytest.fixture(scope="module")
def server(stories_path):
    s = start_server(stories_path, "--served-model-name", "stories")
    yield s
    s.stop()
