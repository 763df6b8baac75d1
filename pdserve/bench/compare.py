"""Compare deployments on one workload: start each server in turn, benchmark it, stop it.

A deployment file (YAML when PyYAML is installed, else JSON) names the command that starts the
server and the URL it serves on. Each server starts in its own process group with its output in
a log file, must answer its health route before the run, and is stopped (SIGTERM, then SIGKILL
after a grace period) whatever happens, Ctrl-C included. A file without `serve` points at a
server that is already running (a remote vLLM, say), benchmarked as it is.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from pdserve.bench.client import normalize_base_url
from pdserve.bench.errors import BenchError
from pdserve.bench.progress import Interrupt
from pdserve.bench.runner import BenchPlan, TargetResult, bench_target

_KEYS = {
    "name": "label in tables and plots (default: the file name)",
    "serve": "command line that starts the server (a string or a list); omit for a running one",
    "base_url": "where it serves, e.g. http://127.0.0.1:8011 (required)",
    "model": "model name to request (default: the first of /v1/models)",
    "tokenizer": "tokenizer folder (default: the model's folder when local)",
    "env": "extra environment variables for the serve command",
    "cwd": "working folder for the serve command",
    "health_path": "route that answers 200 once the server is ready (default /health)",
    "startup_timeout_s": "how long to wait for it (default 600)",
    "stop_timeout_s": "grace period after SIGTERM before SIGKILL (default 30)",
}
_POLL_S = 0.25


@dataclass(frozen=True)
class Deployment:
    """One server setup to benchmark."""

    name: str
    base_url: str
    serve: tuple[str, ...] = ()  # empty: already running, not started or stopped by us
    model: str | None = None
    tokenizer: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    cwd: str | None = None
    health_path: str = "/health"
    startup_timeout_s: float = 600.0
    stop_timeout_s: float = 30.0

    @property
    def health_url(self) -> str:
        return self.base_url + "/" + self.health_path.lstrip("/")


def load_deployment(path: str | Path) -> Deployment:
    """Read a deployment file; any problem is a one-line `BenchError`."""
    path = Path(path)
    data = _read_mapping(path)
    unknown = sorted(set(data) - set(_KEYS))
    if unknown:
        raise BenchError(f"{path}: unknown keys {unknown}; known: {', '.join(_KEYS)}")
    if "base_url" not in data:
        raise BenchError(f"{path}: missing base_url (e.g. http://127.0.0.1:8011)")
    serve = data.get("serve") or ()
    if isinstance(serve, str):
        serve = shlex.split(serve)
    if not isinstance(serve, (list, tuple)) or not all(isinstance(a, str) for a in serve):
        raise BenchError(f"{path}: serve must be a command line string or a list of strings")
    env = data.get("env") or {}
    if not isinstance(env, dict):
        raise BenchError(f"{path}: env must be a mapping of variable names to values")
    try:
        return Deployment(
            name=str(data.get("name") or path.stem),
            base_url=normalize_base_url(str(data["base_url"])),
            serve=tuple(serve),
            model=data.get("model"),
            tokenizer=data.get("tokenizer"),
            env={str(k): str(v) for k, v in env.items()},
            cwd=data.get("cwd"),
            health_path=str(data.get("health_path", "/health")),
            startup_timeout_s=float(data.get("startup_timeout_s", 600.0)),
            stop_timeout_s=float(data.get("stop_timeout_s", 30.0)),
        )
    except (TypeError, ValueError) as e:
        raise BenchError(f"{path}: {e}") from None


def _read_mapping(path: Path) -> dict:
    if not path.is_file():
        raise BenchError(f"deployment file not found: {path}")
    text = path.read_text(encoding="utf-8", errors="replace")
    is_yaml = path.suffix.lower() in (".yaml", ".yml")
    if is_yaml:
        try:
            import yaml
        except ImportError:
            raise BenchError(f"{path}: PyYAML is not installed; write the file as JSON") from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise BenchError(f"{path}: not valid YAML ({_first_line(e)})") from None
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise BenchError(f"{path}: not valid JSON ({e.msg}, line {e.lineno})") from None
    if not isinstance(data, dict):
        raise BenchError(f"{path}: expected a mapping of keys ({', '.join(_KEYS)})")
    return data


class ServerProcess:
    """`with ServerProcess(dep, log_path, stop_requested):` the server is up and healthy inside."""

    def __init__(
        self,
        deployment: Deployment,
        log_path: Path,
        stop_requested: Callable[[], bool] = lambda: False,
    ) -> None:
        self.deployment = deployment
        self.log_path = log_path
        self.stop_requested = stop_requested
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> ServerProcess:
        dep = self.deployment
        if not dep.serve:
            return self
        if _healthy(dep.health_url):
            raise BenchError(
                f"{dep.base_url} already answers before the server started; "
                "stop whatever serves there first"
            )
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "wb")  # noqa: SIM115 (closed with the process)
        try:
            self.proc = subprocess.Popen(
                list(dep.serve), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env={**os.environ, **dep.env}, cwd=dep.cwd, start_new_session=True,
            )  # fmt: skip
        except OSError as e:
            raise BenchError(f"cannot start {dep.serve[0]!r}: {e.strerror}") from None
        finally:
            log.close()  # the child holds its own copy
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _wait_healthy(self) -> None:
        dep = self.deployment
        deadline = time.monotonic() + dep.startup_timeout_s
        while not _healthy(dep.health_url):
            code = self.proc.poll()
            if code is not None:
                raise BenchError(
                    f"the serve command exited with code {code} before "
                    f"{dep.health_path} answered; see {self.log_path}"
                )
            if self.stop_requested():
                raise BenchError("interrupted while waiting for the server")
            if time.monotonic() > deadline:
                raise BenchError(
                    f"{dep.health_url} did not answer within "
                    f"{dep.startup_timeout_s:g}s; see {self.log_path}"
                )
            time.sleep(_POLL_S)

    def stop(self) -> None:
        """SIGTERM the server's process group, SIGKILL it after the grace period."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        _signal_group(proc, signal.SIGTERM)
        try:
            proc.wait(self.deployment.stop_timeout_s)
        except subprocess.TimeoutExpired:
            _signal_group(proc, signal.SIGKILL)
            proc.wait()


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # already gone
        os.killpg(proc.pid, sig)  # the group we created with start_new_session


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2.0, trust_env=False).status_code == 200
    except httpx.HTTPError:
        return False


def _first_line(e: Exception) -> str:
    lines = str(e).strip().splitlines()
    return lines[0] if lines else e.__class__.__name__


@dataclass
class Outcome:
    """One deployment's part of a comparison: its result, or why it has none."""

    deployment: Deployment
    result: TargetResult | None = None
    error: str | None = None


def run_comparison(
    plan: BenchPlan, deployments: list[Deployment], interrupt: Interrupt, log_dir: Path
) -> list[Outcome]:
    """Each deployment in turn: start, wait for health, run the plan, stop. A deployment that
    fails to start is reported and skipped; Ctrl-C stops the comparison after the current one."""
    prompts: dict = {}  # shared, so deployments with one tokenizer get identical requests
    outcomes = []
    for dep in deployments:
        if interrupt.requested:
            outcomes.append(Outcome(dep, error="not run: interrupted"))
            continue
        log_path = log_dir / f"{_safe_name(dep.name)}.log"
        started = f"starting `{shlex.join(dep.serve)}`" if dep.serve else "already running"
        _note(f"[{dep.name}] {started} ({dep.base_url})")
        try:
            with ServerProcess(dep, log_path, lambda: interrupt.requested):
                result = bench_target(
                    plan, dep.base_url, dep.model, dep.tokenizer, interrupt, dep.name, prompts
                )
            outcomes.append(Outcome(dep, result))
        except BenchError as e:
            _note(f"[{dep.name}] skipped: {e}")
            outcomes.append(Outcome(dep, error=str(e)))
    return outcomes


def _safe_name(name: str) -> str:
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in name) or "deployment"


def _note(text: str) -> None:
    print(text, file=sys.stderr, flush=True)
