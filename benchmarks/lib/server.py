"""`pdserve serve` as a subprocess, its /metrics, and requests built and sent by `pdserve bench`'s
own code."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx

from lib.procstat import parent_pids
from pdserve.bench.client import ClientConfig, run_requests
from pdserve.bench.tokenizer import HFPromptTokenizer, load_tokenizer
from pdserve.bench.workload import WorkloadConfig, build_prompts, make_specs
from pdserve.heap import frozen_heap


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_pids(frontend_pid: int) -> dict[str, int]:
    """`{role}{worker id}` -> pid of each engine worker a frontend started (its children running
    `pdserve.engine.worker`), by worker id. /health no longer lists PIDs, so they come from /proc,
    as an operator would find them."""
    found = []
    for pid, ppid in parent_pids().items():
        if ppid != frontend_pid:
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().decode().split("\0")
        except OSError:
            continue
        if "pdserve.engine.worker" in argv:
            role = argv[argv.index("--role") + 1]
            found.append((int(argv[argv.index("--worker-id") + 1]), role, pid))
    return {f"{role}{wid}": pid for wid, role, pid in sorted(found)}


class Server:
    """`pdserve serve ARGS` on a free 127.0.0.1 port, in its own process group."""

    def __init__(
        self,
        args: list[str],
        log_path: str | Path,
        timeout_s: float = 300.0,
        prefix: list[str] | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.port = free_port()
        self.env = None if env is None else {**os.environ, **env}  # added to this process' own
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.cmd = [*(prefix or []), "pdserve", "serve", *args, "--port", str(self.port)]
        self.cmd += ["--log-level", "warning"]
        self.log_path = str(log_path)
        self.timeout_s = timeout_s

    @property
    def command_line(self) -> str:
        return " ".join(self.cmd)

    def __enter__(self) -> Server:
        self.log = open(self.log_path, "w")
        # Run from the log folder: workers start as `python -m pdserve.engine.worker`, which puts
        # the working directory first on sys.path, so a pdserve/ folder there (a checkout's)
        # would shadow the pdserve the frontend imported.
        self.proc = subprocess.Popen(
            self.cmd,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=Path(self.log_path).parent,
            env=self.env,
        )
        deadline = time.monotonic() + self.timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited ({self.proc.returncode}); see {self.log_path}")
            try:
                r = httpx.get(self.base_url + "/health", timeout=2, trust_env=False)
                if r.status_code == 200:
                    self.health = r.json()
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.__exit__()
                raise RuntimeError(f"server not healthy in {self.timeout_s} s; see {self.log_path}")
            time.sleep(0.5)
        self.workers = worker_pids(self.proc.pid)
        return self

    def metrics(self) -> str:
        return httpx.get(self.base_url + "/metrics", timeout=10, trust_env=False).text

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            # SIGTERM the frontend only: it stops its workers. (SIGTERM to the whole group stops
            # the workers first, and the frontend then waits forever to send them Shutdown.)
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


def metric_sums(text: str, name: str) -> dict[str, float]:
    """Values of every sample of metric `name` (a counter, a gauge, or a histogram's _sum or
    _count), keyed by its label string."""
    out = {}
    for line in text.splitlines():
        m = re.match(rf"^{re.escape(name)}(\{{[^}}]*\}})?\s+(\S+)$", line)
        if m:
            out[m.group(1) or ""] = float(m.group(2))
    return out


def prompt_steps(srv: Server) -> tuple[float, float]:
    """The server's steps with prompt tokens so far, from its step-time histogram: (seconds,
    count). Around one request sent alone: that request's prompt steps."""
    text = srv.metrics()
    sums = metric_sums(text, "pdserve_step_time_seconds_sum")
    counts = metric_sums(text, "pdserve_step_time_seconds_count")
    keys = [k for k in sums if 'phase="prefill"' in k or 'phase="mixed"' in k]
    return sum(sums[k] for k in keys), sum(counts[k] for k in keys)


def first_token_s(
    client: httpx.Client, url: str, model: str, prompt: str | list[int], max_tokens: int = 1
) -> float:
    """Stream one greedy completion of `max_tokens` tokens (EOS ignored); the client's TTFT."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "temperature": 0.0, "ignore_eos": True}  # fmt: skip
    t0 = time.perf_counter()
    first = None
    with client.stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if first is None and line.startswith("data: {"):
                first = time.perf_counter() - t0
    if first is None:
        raise RuntimeError("no token came back")
    return first


def metric_total(text: str, name: str, label_filter: str = "") -> float:
    return sum(v for k, v in metric_sums(text, name).items() if label_filter in k)


def prompts_for(model: str, num: int, input_len: int, output_len: int, seed: int = 0):
    """Exactly the requests `pdserve bench --input-len I --output-len O --num-requests N
    --seed S` sends to a server of this model (completions endpoint)."""
    tok = HFPromptTokenizer(load_tokenizer(model), chat=False)
    cfg = WorkloadConfig(num_requests=num, input_len=input_len, output_len=output_len, seed=seed)
    return build_prompts(make_specs(cfg), tok, seed)


def send(requests, base_url: str, model: str, max_concurrency: int | None = None):
    cfg = ClientConfig(base_url, model, "completions", temperature=0.0)
    with frozen_heap():  # as `pdserve bench`: the client's own pauses stay out of its timestamps
        return asyncio.run(run_requests(requests, cfg, max_concurrency))
