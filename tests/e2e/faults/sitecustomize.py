"""Fault injection for the end-to-end tests: never part of pdserve, and inert unless asked.

The harness (`server_harness.start_server(..., faults=...)`) puts this folder first on the
server's PYTHONPATH, so every Python process of that server (the frontend and the engine workers
it spawns, which inherit the environment) imports this module at startup. It acts only in an
engine worker whose command line names the role a fault is for:

- `PDSERVE_FAULT_PREFILL_DELAY_S=<seconds>`: a prefill worker (`--role prefill`) sleeps that
  long after each `EngineCore.execute` (one scheduled plan: one prefill chunk), so a long prompt
  takes a known minimum time to prefill and a test can act while it is under way.
- `PDSERVE_FAULT_DECODE_DELAY_S=<seconds>`: the same for a decode worker (`--role decode`),
  so a long answer takes a known minimum time.
- `PDSERVE_FAULT_BOTH_DELAY_S=<seconds>`: the same for a colocated worker (`--role both`, the
  role every worker of `--pd-ratio manual|auto` starts in; it keeps the delay when it switches).
- `PDSERVE_FAULT_DECODE_START_GATE=<path>`: a decode worker (`--role decode`) does not start
  while that file exists (a test creates it once the server is up, so only a worker started
  later, e.g. by `--restart-workers`, waits, until the test removes it).

`EngineCore` is patched when `pdserve.engine.core` is first imported (an import hook), so
nothing is imported here that the worker would not import anyway.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import os
import sys
import time

PREFILL_DELAY_ENV = "PDSERVE_FAULT_PREFILL_DELAY_S"
DECODE_DELAY_ENV = "PDSERVE_FAULT_DECODE_DELAY_S"
BOTH_DELAY_ENV = "PDSERVE_FAULT_BOTH_DELAY_S"
DELAY_ENVS = {"prefill": PREFILL_DELAY_ENV, "decode": DECODE_DELAY_ENV, "both": BOTH_DELAY_ENV}
DECODE_START_GATE_ENV = "PDSERVE_FAULT_DECODE_START_GATE"


def _worker_role() -> str | None:
    """The `--role` of this process when it is a pdserve engine worker, else None."""
    argv = list(getattr(sys, "orig_argv", None) or sys.argv)
    if "pdserve.engine.worker" not in argv or "--role" not in argv:
        return None
    i = argv.index("--role")
    return argv[i + 1] if i + 1 < len(argv) else None


class _PatchOnImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Runs `patch(module)` right after the module `name` is first executed."""

    def __init__(self, name: str, patch) -> None:
        self.name, self.patch, self.inner = name, patch, None

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)  # once
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        self.inner, spec.loader = spec.loader, self
        return spec

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module) -> None:
        self.inner.exec_module(module)
        self.patch(module)


def _slow_execute(delay_s: float):
    def patch(core) -> None:
        execute = core.EngineCore.execute

        @functools.wraps(execute)
        def slow_execute(self, plan):
            outputs = execute(self, plan)
            time.sleep(delay_s)
            return outputs

        slow_execute.fault_delay_s = delay_s
        core.EngineCore.execute = slow_execute

    return patch


def _install() -> None:
    role = _worker_role()
    delay = os.environ.get(DELAY_ENVS.get(role, ""))
    if delay:
        sys.meta_path.insert(0, _PatchOnImport("pdserve.engine.core", _slow_execute(float(delay))))
        print(
            f"[fault injection] {role} worker: sleeping {float(delay)} s after each "
            "EngineCore.execute",
            file=sys.stderr,
            flush=True,
        )
    gate = os.environ.get(DECODE_START_GATE_ENV)
    if role == "decode" and gate:
        parent = os.getppid()
        while os.path.exists(gate):
            if os.getppid() != parent:  # the server is gone: do not linger
                os._exit(1)
            time.sleep(0.05)


_install()
