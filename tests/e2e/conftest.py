from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from server_harness import start_server  # noqa: E402


@pytest.fixture(scope="session")
def server(stories_path):
    """One colocated server on the real tiny model, shared by every test that only sends
    requests (tests that kill, restart or reconfigure a server start their own)."""
    s = start_server(stories_path, "--served-model-name", "stories")
    yield s
    s.stop()
