"""Short scheduler time slices for the threads that carry a token from a worker to its client.

On a machine where a worker's compute threads hold every CPU, a token leaves the step and then
waits for a CPU at each hop on its way out: the worker's ZMQ I/O thread, the frontend's I/O
thread and event loop, the HTTP write. Linux's fair scheduler (EEVDF) lets a running thread finish
its time slice before a woken one of equal weight takes the CPU, so each hop could wait up to a
slice; on a 2-core Zen 4 VM (kernel 6.18, default slice 1.4 ms) the first token of a request
reached the frontend 0.4 to 8 ms after the worker sent it when the worker went straight on to its
next step, and within 0.5 ms when it did not (docs/PERFORMANCE.md, "Tokens out of a busy
machine").

Since 6.12 a SCHED_OTHER thread may ask for its own slice (`sched_setattr`'s `sched_runtime`,
0.1 to 100 ms, no privilege needed); a woken thread with a shorter slice than the running one
preempts it. It changes when a thread runs, not how much: its share of the CPU stays its
weight's. So the frontend's threads and the workers' message threads ask for `SLICE_NS`, and the
compute threads keep the kernel's default.

It is a trade, and off by default: a compute thread preempted in the middle of a parallel
region holds up the others at its barrier, where a message thread that waited might have run in
the worker's serial stretch between steps instead. On that VM a first token's time outside its
step fell from 11.8 to 6.9 ms at the p90 (5.0 to 4.4 at the median), and a loaded server gave
2-4% fewer tokens per second (`benchmarks/short_slice_bench.py`). `pdserve serve
--short-time-slices` turns it on; the frontend tells its workers through the environment
(`ENV_VAR`).

Children inherit a thread's slice across fork and exec, so a worker, or the tokenizer process,
started by a frontend gives its own threads the default back first (`restore_process`).
Elsewhere (another OS, an older kernel that ignores the field, a seccomp filter) nothing changes
and nothing fails.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import sys

logger = logging.getLogger(__name__)

SLICE_NS = 100_000  # the shortest slice the kernel grants
ENV_VAR = "PDSERVE_SHORT_SLICES"  # "1": on (`pdserve serve --short-time-slices` sets it)
ZMQ_THREADS = "ZMQbg/"  # how libzmq names its I/O threads
# (sched_setattr, sched_getattr) per machine
_SYSCALLS = {"x86_64": (314, 315), "aarch64": (274, 275)}
_FAIR_POLICIES = (0, 3, 5)  # SCHED_OTHER, SCHED_BATCH, SCHED_IDLE: sched_runtime is a slice
_RESET_ON_FORK = 0x01


class _SchedAttr(ctypes.Structure):
    _fields_ = [
        ("size", ctypes.c_uint32),
        ("sched_policy", ctypes.c_uint32),
        ("sched_flags", ctypes.c_uint64),
        ("sched_nice", ctypes.c_int32),
        ("sched_priority", ctypes.c_uint32),
        ("sched_runtime", ctypes.c_uint64),
        ("sched_deadline", ctypes.c_uint64),
        ("sched_period", ctypes.c_uint64),
        ("sched_util_min", ctypes.c_uint32),
        ("sched_util_max", ctypes.c_uint32),
    ]


def _syscalls() -> tuple[ctypes.CDLL, int, int] | None:
    numbers = _SYSCALLS.get(platform.machine()) if sys.platform == "linux" else None
    if numbers is None:
        return None
    return ctypes.CDLL(None, use_errno=True), *numbers


def enabled() -> bool:
    return os.environ.get(ENV_VAR, "0") == "1"


def get_slice(tid: int = 0) -> int | None:
    """Thread `tid`'s slice in ns (0: this thread), as the kernel reports it; None where it
    reports none (not Linux, a real-time policy, an unknown thread)."""
    attr = _get(tid)
    if attr is None or attr.sched_policy not in _FAIR_POLICIES:
        return None
    return attr.sched_runtime


def set_slice(tid: int, ns: int) -> bool:
    """Ask for a slice of `ns` for thread `tid` (0: this thread; 0 ns: the kernel's default),
    keeping its policy and nice value. Whether the kernel took it."""
    calls, attr = _syscalls(), _get(tid)
    if calls is None or attr is None or attr.sched_policy not in _FAIR_POLICIES:
        return False
    libc, setattr_nr, _ = calls
    attr.size = ctypes.sizeof(_SchedAttr)
    attr.sched_flags &= _RESET_ON_FORK  # not the clamp flags: the utilisation clamps stay as set
    attr.sched_runtime = ns
    if libc.syscall(setattr_nr, tid, ctypes.byref(attr), 0) != 0:
        return False
    return ns == 0 or get_slice(tid) == ns  # an older kernel accepts the field and ignores it


def _get(tid: int) -> _SchedAttr | None:
    calls = _syscalls()
    if calls is None:
        return None
    libc, _, getattr_nr = calls
    attr = _SchedAttr()
    if libc.syscall(getattr_nr, tid, ctypes.byref(attr), ctypes.sizeof(_SchedAttr), 0) != 0:
        return None
    return attr


def _threads() -> list[tuple[int, str]]:
    """(tid, name) of every thread of this process."""
    out = []
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                out.append((int(tid), f.read().strip()))
        except OSError:  # the thread ended
            continue
    return out


def shorten_process() -> bool:
    """Every thread of this process, and every thread they start from now on, on `SLICE_NS`
    (the frontend). Whether the kernel took it."""
    if not enabled():
        return False
    took = [set_slice(tid, SLICE_NS) for tid, _ in _threads()]
    if took and all(took):
        logger.debug("threads on %d us time slices", SLICE_NS // 1000)
    return bool(took) and all(took)


def shorten_threads(prefix: str) -> int:
    """This process's threads whose names start with `prefix` (a worker's ZMQ I/O threads,
    `ZMQ_THREADS`) on `SLICE_NS`; how many took it."""
    if not enabled():
        return 0
    return sum(set_slice(tid, SLICE_NS) for tid, name in _threads() if name.startswith(prefix))


def restore_process() -> None:
    """Every thread of this process back on the kernel's default slice (a process started by
    one that asked for short ones)."""
    if enabled():
        for tid, _ in _threads():
            set_slice(tid, 0)
