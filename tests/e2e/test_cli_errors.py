"""Mistakes a new user makes on the command line fail fast, in one line, naming the mistake."""

from __future__ import annotations

import socket
import subprocess
import sys

from server_harness import free_port


def pdserve(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pdserve.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_a_missing_model_folder_is_named(tmp_path):
    missing = str(tmp_path / "no-such-model")
    for command in ("serve", "generate"):
        extra = ["--prompt", "hi"] if command == "generate" else ["--port", str(free_port())]
        r = pdserve(command, "--model", missing, *extra)
        assert r.returncode == 2, r.stderr
        assert "no such folder" in r.stderr and missing in r.stderr
        assert "Traceback" not in r.stderr


def test_a_port_in_use_fails_before_the_model_loads(stories_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = pdserve("serve", "--model", stories_path, "--port", str(port))
    assert r.returncode == 2 and f"cannot listen on 127.0.0.1:{port}" in r.stderr, r.stderr
    assert "worker" not in r.stderr  # no engine worker was started
