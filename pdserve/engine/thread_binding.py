"""One compute thread per CPU while a step runs.

An engine with as many torch threads as CPUs wants each of them on a CPU of its own: every
parallel region ends at a barrier, so two threads on one CPU make the whole step wait for the
one that is not running. Left to the kernel's scheduler, they sometimes are on one CPU: after an
idle stretch a worker's main thread is woken by its message thread and both compute threads can
come back on the same CPU, where they take turns until the load balancer moves one away. On a
2-core Zen 4 VM, a 14-token prompt step of llama-125m after 0.3 s idle took 38-40 ms instead of
28 in a third to a half of the cases in a served worker, its two threads waiting 10 ms between
them on a run queue (`/proc/.../schedstat`) and running 10 ms more; the same step in one process
took 28.

`bound_step()` wraps a step: the OpenMP team's other threads are bound one to a CPU (once per
CPU set; `cpu_threads.c`) and the calling thread, torch's thread 0, to the set's first CPU for
the step's length, then given the whole set back, so that the threads it starts between steps
(KV transfers, grammar compilation) do not inherit a single CPU. Nothing is bound where the
engine has fewer threads than CPUs (the threads may then move to whichever CPU is free), with
one thread, where the native kernels cannot be built, or off Linux.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator

logger = logging.getLogger(__name__)

_bound: tuple[int, ...] | None = None  # the CPU set the team's threads are bound to
_failed = False  # binding failed once here: not tried again


def forget() -> None:
    """The process's threads were moved (`cpu_placement.run_on`, `apply`): bind them again at
    the next step."""
    global _bound
    _bound = None


def _cpus_to_bind() -> tuple[int, ...] | None:
    import torch

    if _failed or not hasattr(os, "sched_getaffinity"):
        return None
    cpus = tuple(sorted(os.sched_getaffinity(0)))
    if len(cpus) < 2 or torch.get_num_threads() != len(cpus):
        return None
    return cpus


def _bind(cpus: tuple[int, ...]) -> bool:
    global _bound, _failed
    if _bound == cpus:
        return True
    from pdserve.kernels import threads

    ok, why = threads.available()
    if ok:
        failed = threads.bind_threads(cpus)
        if failed < 0:
            why = f"the OpenMP team is not {len(cpus)} threads wide"
        elif failed > 0:
            why = f"{failed} thread(s) could not be bound to CPUs {list(cpus)}"
    if why or not ok:
        _failed = True
        logger.warning("engine threads left unbound: %s", why or "no native kernels")
        return False
    _bound = cpus
    return True


@contextlib.contextmanager
def bound_step() -> Iterator[None]:
    """For the block (a step): one torch thread per CPU of this thread's set, where the engine
    has one per CPU (see the module docstring)."""
    cpus = _cpus_to_bind()
    if cpus is None or not _bind(cpus):
        yield
        return
    try:
        os.sched_setaffinity(0, (cpus[0],))
    except OSError as e:  # the CPU left this process's cpuset meanwhile: run the step as it is
        logger.warning("engine thread not bound to CPU %d for a step: %s", cpus[0], e)
        forget()
        yield
        return
    try:
        yield
    finally:
        try:
            os.sched_setaffinity(0, cpus)
        except OSError as e:
            logger.warning("engine thread's CPUs %s not given back: %s", list(cpus), e)
            forget()
