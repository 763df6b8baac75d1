"""Short time slices for the message threads (`pdserve/ipc/sched_slice.py`): each case runs in a
fresh process, so that the test runner's own threads keep their slices."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from pdserve.ipc import sched_slice


def run(code: str, **env: str) -> dict:
    """`code` in a fresh interpreter, its last stdout line read as JSON."""
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, sched_slice.ENV_VAR: "1", **env},
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def kernel_takes_slices() -> bool:
    return run(
        """
        import json
        from pdserve.ipc import sched_slice
        print(json.dumps(sched_slice.set_slice(0, sched_slice.SLICE_NS)))
        """
    )


needs_slices = pytest.mark.skipif(
    not sched_slice._syscalls() or not kernel_takes_slices(),
    reason="this kernel grants no per-thread slices (Linux 6.12 or later has them)",
)


@needs_slices
def test_a_process_and_the_threads_it_starts_get_the_short_slice():
    got = run(
        """
        import json, threading
        from pdserve.ipc import sched_slice
        before = sched_slice.get_slice()
        took = sched_slice.shorten_process()
        child = []
        t = threading.Thread(target=lambda: child.append(sched_slice.get_slice()))
        t.start(); t.join()
        print(json.dumps([before, took, sched_slice.get_slice(), child[0]]))
        """
    )
    before, took, after, child = got
    assert took
    assert before != sched_slice.SLICE_NS
    assert after == child == sched_slice.SLICE_NS


@needs_slices
def test_restore_gives_the_default_back_and_keeps_the_nice_value():
    got = run(
        """
        import json, os
        from pdserve.ipc import sched_slice
        default = sched_slice.get_slice()
        sched_slice.shorten_process()
        os.nice(7)
        sched_slice.restore_process()
        print(json.dumps([default, sched_slice.get_slice(), os.nice(0)]))
        """
    )
    default, restored, nice = got
    assert restored == default != sched_slice.SLICE_NS
    assert nice == 7


@needs_slices
def test_threads_are_shortened_by_name():
    got = run(
        """
        import json, threading, time
        from pdserve.ipc import sched_slice
        ready, done = threading.Event(), threading.Event()
        tids = {}
        def body(name):
            tids[name] = threading.get_native_id()
            with open(f"/proc/self/task/{tids[name]}/comm", "w") as f:
                f.write(name)
            ready.set() if len(tids) == 2 else None
            done.wait()
        threads = [threading.Thread(target=body, args=(n,)) for n in ("ZMQbg/IO/0", "compute")]
        for t in threads: t.start()
        ready.wait()
        n = sched_slice.shorten_threads(sched_slice.ZMQ_THREADS)
        slices = {name: sched_slice.get_slice(tid) for name, tid in tids.items()}
        done.set()
        for t in threads: t.join()
        print(json.dumps([n, slices, sched_slice.get_slice()]))
        """
    )
    n, slices, main = got
    assert n == 1
    assert slices["ZMQbg/IO/0"] == sched_slice.SLICE_NS
    assert slices["compute"] != sched_slice.SLICE_NS
    assert main != sched_slice.SLICE_NS


def test_switched_off_by_the_environment():
    got = run(
        """
        import json
        from pdserve.ipc import sched_slice
        before = sched_slice.get_slice()
        took = sched_slice.shorten_process()
        print(json.dumps([took, before, sched_slice.get_slice()]))
        """,
        PDSERVE_SHORT_SLICES="0",
    )
    took, before, after = got
    assert took is False
    assert after == before


def test_nothing_happens_where_the_call_is_unknown(monkeypatch):
    monkeypatch.setattr(sched_slice.platform, "machine", lambda: "sparc64")
    assert sched_slice.get_slice() is None
    assert sched_slice.set_slice(0, sched_slice.SLICE_NS) is False
    assert sched_slice.shorten_threads("") == 0
    sched_slice.restore_process()  # no error
