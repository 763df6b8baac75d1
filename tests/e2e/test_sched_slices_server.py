"""`pdserve serve --short-time-slices`: the frontend's threads and the worker's message threads
on short scheduler slices, the worker's compute threads on the kernel's default; without the
flag, every thread on the default (`pdserve/ipc/sched_slice.py`)."""

from __future__ import annotations

import os

import httpx
import pytest
from server_harness import start_server

from pdserve.ipc import sched_slice

SHORT = sched_slice.SLICE_NS


def threads(pid: int) -> dict[int, str]:
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                out[int(tid)] = f.read().strip()
        except OSError:
            continue
    return out


def slices(pid: int) -> dict[str, int | None]:
    return {f"{name}/{tid}": sched_slice.get_slice(tid) for tid, name in threads(pid).items()}


def completes(server) -> bool:
    body = {"model": "stories", "prompt": "Once", "max_tokens": 4}
    return httpx.post(server.url + "/v1/completions", json=body, timeout=60).status_code == 200


@pytest.fixture(scope="module")
def sliced(stories_path):
    s = start_server(stories_path, "--served-model-name", "stories", "--short-time-slices")
    yield s
    s.stop()


@pytest.mark.slow  # a server of its own (seconds to start): the default run stays short
def test_message_threads_short_compute_threads_default(sliced):
    if sched_slice.get_slice(sliced.proc.pid) != SHORT:
        pytest.skip("this kernel grants no per-thread slices (Linux 6.12 or later has them)")
    assert completes(sliced)
    frontend = slices(sliced.proc.pid)
    assert set(frontend.values()) == {SHORT}, frontend
    worker = sliced.worker_pid("both")
    mine = slices(worker)
    zmq = {k: v for k, v in mine.items() if k.startswith(sched_slice.ZMQ_THREADS)}
    assert zmq and set(zmq.values()) == {SHORT}, mine
    assert sched_slice.get_slice(worker) != SHORT  # its main thread computes


def test_every_thread_on_the_default_without_the_flag(server):
    assert completes(server)
    for pid in (server.proc.pid, server.worker_pid("both")):
        assert SHORT not in slices(pid).values()
