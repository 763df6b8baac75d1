"""Start `pdserve serve` as a real subprocess on a free loopback port, and read its metrics.

Faults are injected from the test side only: an `env` with a `PDSERVE_FAULT_*` variable puts
`faults/` first on the server's PYTHONPATH, whose `sitecustomize.py` (imported by every Python
process of that server, workers included) applies the fault in the workers it is meant for.
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

FAULTS_DIR = Path(__file__).parent / "faults"
# Read by faults/sitecustomize.py (see its docstring): seconds a prefill, decode or colocated
# worker sleeps after each step, and a file whose existence holds back the start of a
# (re)started decode worker.
FAULT_PREFILL_DELAY = "PDSERVE_FAULT_PREFILL_DELAY_S"
FAULT_DECODE_START_GATE = "PDSERVE_FAULT_DECODE_START_GATE"
FAULT_DECODE_DELAY = "PDSERVE_FAULT_DECODE_DELAY_S"
FAULT_BOTH_DELAY = "PDSERVE_FAULT_BOTH_DELAY_S"


def _sum(text: str, name: str, labels: str = "") -> float:
    """Sum of a metric's samples (in Prometheus text) whose labels contain `labels`."""
    pattern = rf"^{name}{{([^}}]*)}} (\S+)$"
    return sum(float(v) for lab, v in re.findall(pattern, text, re.M) if labels in lab)


def wait_until(cond: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    """Poll `cond()` until it holds."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.02)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    proc: subprocess.Popen
    port: int
    headers: dict = field(default_factory=dict)  # the API key, when the server has one

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def metric(self, name: str, labels: str = "") -> float:
        """Sum of a metric's samples whose labels contain `labels` (e.g. 'role="decode"')."""
        text = self.metrics_text()
        return _sum(text, name, labels)

    def metrics_text(self) -> str:
        with httpx.Client(timeout=10, headers=self.headers) as client:
            return client.get(f"{self.url}/metrics").text

    def wait_for(
        self, cond: Callable[[Callable[..., float]], bool], what: str, timeout_s: float = 60.0
    ) -> Callable[..., float]:
        """Poll /metrics until `cond(m)` holds, where `m(name, labels="")` reads one metric of
        that scrape (summed over the samples whose labels contain `labels`); returns that `m`,
        so a test can check more of the same scrape."""
        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=10, headers=self.headers) as client:
            while True:
                text = client.get(f"{self.url}/metrics").text
                read = functools.partial(_sum, text)
                if cond(read):
                    return read
                if time.monotonic() > deadline:
                    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
                time.sleep(0.02)

    def wait_health(self, cond: Callable[[dict], bool], what: str, timeout_s: float = 60.0) -> dict:
        """Poll /health until `cond(its JSON)` holds; returns that JSON."""
        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=10, headers=self.headers) as client:
            while True:
                health = client.get(f"{self.url}/health").json()
                if cond(health):
                    return health
                if time.monotonic() > deadline:
                    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
                time.sleep(0.02)

    def open_request(self, path: str, body: dict) -> socket.socket:
        """Send a POST on a raw connection and leave the answer unread: closing the socket is a
        client disconnect at a moment the test chooses."""
        data = json.dumps(body).encode()
        head = (
            f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1:{self.port}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(data)}\r\n"
            + "".join(f"{k}: {v}\r\n" for k, v in self.headers.items())
            + "\r\n"
        )
        sock = socket.create_connection(("127.0.0.1", self.port), timeout=10)
        sock.sendall(head.encode() + data)
        return sock

    def wait_idle(self, timeout_s: float = 15.0) -> None:
        """Wait until no request runs or waits and no KV block is referenced (the pool is whole)."""
        deadline = time.monotonic() + timeout_s
        names = ("running", "waiting", "kv_usage")
        with httpx.Client(timeout=10, headers=self.headers) as client:
            while time.monotonic() < deadline:
                text = client.get(f"{self.url}/metrics").text
                values = [
                    _sum(text, "pdserve_num_requests_running"),
                    _sum(text, "pdserve_num_requests_waiting"),
                    _sum(text, "pdserve_kv_cache_usage_ratio"),
                ]
                if not any(values):
                    return
                time.sleep(0.1)
        state = ", ".join(f"{n}={v}" for n, v in zip(names, values))
        raise AssertionError(f"not idle: {state}")

    def worker_pids(self) -> dict[tuple[str, int], int]:
        """(role, worker id) -> pid of every engine worker process (the server's children).
        Found from /proc, the way an operator would (GET /deployment names them too)."""
        found = {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    argv = f.read().decode().split("\0")
            except (OSError, IndexError, ValueError):
                continue
            if ppid == self.proc.pid and "pdserve.engine.worker" in argv:
                role = argv[argv.index("--role") + 1]
                found[(role, int(argv[argv.index("--worker-id") + 1]))] = int(entry)
        return found

    def worker_pid(self, role: str, index: int = 0) -> int:
        """The pid of the `index`-th live worker of a role, by worker id."""
        return [pid for (r, _), pid in sorted(self.worker_pids().items()) if r == role][index]

    def shm_kv_file(self, pid: int) -> str:
        """The shared-memory file holding a decode worker's KV cache (shm transport), found in
        the process's memory maps."""
        with open(f"/proc/{pid}/maps") as f:
            paths = {line.split()[-1] for line in f if "/kv-" in line}
        assert len(paths) == 1, paths
        return paths.pop()

    def listening_tcp_ports(self, pid: int) -> list[int]:
        """The TCP ports a process listens on (from /proc: its socket inodes in /proc/net/tcp)."""
        inodes = set()
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
        ports = []
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            with open(table) as f:
                for line in f.readlines()[1:]:
                    cols = line.split()
                    if cols[3] == "0A" and cols[9] in inodes:  # 0A: LISTEN
                        ports.append(int(cols[1].rsplit(":", 1)[1], 16))
        return ports

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
    model: str,
    *extra: str,
    timeout_s: float = 120.0,
    env: dict | None = None,
    umask: int = -1,
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
    env = {**os.environ, **(env or {})}
    if any(k.startswith("PDSERVE_FAULT_") for k in env):
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(FAULTS_DIR), env.get("PYTHONPATH")]))
    proc = subprocess.Popen(
        cmd,
        env=env,
        start_new_session=True,  # a Ctrl-C reaches pytest, which stops the server itself
        preexec_fn=_die_with_parent,
        umask=umask,
    )
    key = extra[extra.index("--api-key") + 1] if "--api-key" in extra else None
    server = Server(proc, port, {"authorization": f"Bearer {key}"} if key else {})
    _started.append(server)
    try:
        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=1) as client:  # one client: a new one per poll costs CPU
            while time.monotonic() < deadline:
                if proc.poll() is not None:
                    raise RuntimeError(f"server exited with code {proc.returncode}")
                try:
                    if client.get(f"{server.url}/health").status_code == 200:
                        return server
                except httpx.HTTPError:
                    pass
                time.sleep(0.2)
        raise RuntimeError("server did not become healthy")
    except BaseException:  # a failed start, or a Ctrl-C while it loads: leave nothing running
        server.stop()
        raise


_started: list[Server] = []


@atexit.register
def _stop_all() -> None:
    """Whatever a test left running (an interrupted run) is stopped when pytest exits."""
    for server in _started:
        server.stop()


def _die_with_parent() -> None:
    """In the server process: SIGTERM it if pytest dies first (even by SIGKILL)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


PR_SET_PDEATHSIG = 1
