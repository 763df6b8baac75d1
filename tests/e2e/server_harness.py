"""Start `pdserve serve` as a real subprocess on a free loopback port, and read its metrics."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    proc: subprocess.Popen
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def metric(self, name: str, labels: str = "") -> float:
        """Sum of a metric's samples whose labels contain `labels` (e.g. 'role="decode"')."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        pattern = rf"^{name}{{([^}}]*)}} (\S+)$"
        return sum(float(v) for lab, v in re.findall(pattern, text, re.M) if labels in lab)

    def wait_idle(self, timeout_s: float = 15.0) -> None:
        """Wait until no request runs or waits and no KV block is referenced (the pool is whole)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if (
                self.metric("pdserve_num_requests_running") == 0
                and self.metric("pdserve_num_requests_waiting") == 0
                and self.metric("pdserve_kv_cache_usage_ratio") == 0
            ):
                return
            time.sleep(0.1)
        running = self.metric("pdserve_num_requests_running")
        waiting = self.metric("pdserve_num_requests_waiting")
        usage = self.metric("pdserve_kv_cache_usage_ratio")
        raise AssertionError(f"not idle: running={running} waiting={waiting} kv_usage={usage}")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def start_server(
    model: str, *extra: str, timeout_s: float = 120.0, env: dict | None = None
) -> Server:
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "pdserve.cli",
        "serve",
        "--model",
        model,
        "--port",
        str(port),
        "--log-level",
        "warning",
        *extra,
    ]
    proc = subprocess.Popen(cmd, env={**os.environ, **(env or {})})
    server = Server(proc, port)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode}")
        try:
            if httpx.get(f"{server.url}/health", timeout=1).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    server.stop()
    raise RuntimeError("server did not become healthy")
