"""One compute thread per CPU while a step runs (`engine/thread_binding.py`).

Binding moves the threads of the whole process, so each check runs in a subprocess of its own.
"""

import os
import subprocess
import sys

import pytest

from pdserve.kernels import threads

pytestmark = [
    pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs"),
    pytest.mark.skipif(not threads.available()[0], reason="no native kernels here"),
]

BINDING = """
import os, sys, torch
from pdserve.engine import cpu_placement, thread_binding
from pdserve.kernels.threads import thread_cpus

cpus = sorted(os.sched_getaffinity(0))[:2]
cpu_placement.run_on(set(cpus))
torch.ones(64, 64) @ torch.ones(64, 64)  # the OpenMP pool exists
assert [n for _, n in thread_cpus(2)] == [2, 2]  # nothing bound yet
with thread_binding.bound_step():
    assert thread_cpus(2) == [(cpus[0], 1), (cpus[1], 1)]  # one CPU each, in order
assert os.sched_getaffinity(0) == set(cpus)  # the calling thread gets its set back
assert thread_cpus(2)[1] == (cpus[1], 1)  # the other stays bound between steps

cpu_placement.run_on(set(cpus))  # moved onto the whole set again: bound again at the next step
assert thread_cpus(2)[1][1] == 2
with thread_binding.bound_step():
    assert thread_cpus(2)[1] == (cpus[1], 1)

torch.set_num_threads(1)  # fewer threads than CPUs: they may go where a CPU is free
with thread_binding.bound_step():
    assert os.sched_getaffinity(0) == set(cpus)
print("ok")
"""

ENGINE = """
import os, sys
from pdserve import LLM, SamplingParams
from pdserve.engine import cpu_placement
from pdserve.kernels.threads import thread_cpus

cpus = sorted(os.sched_getaffinity(0))[:2]
cpu_placement.run_on(set(cpus))
llm = LLM(sys.argv[1], num_threads=2)
llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0.0))
assert thread_cpus(2)[1] == (cpus[1], 1), thread_cpus(2)  # the engine's steps bound it
assert os.sched_getaffinity(0) == set(cpus)
print("ok")
"""


def run(script: str, *args: str) -> None:
    out = subprocess.run(
        [sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]


def test_a_step_runs_one_thread_per_cpu_and_gives_the_calling_thread_its_set_back():
    run(BINDING)


def test_engine_steps_bind_their_threads(tiny_models):
    run(ENGINE, tiny_models["llama"])


def test_a_cpu_that_cannot_be_bound_leaves_the_step_to_run_unbound(monkeypatch):
    """A CPU set that changed under the engine (a cpuset shrunk) must not fail a step."""
    import torch

    from pdserve.engine import thread_binding

    def refuse(pid, cpus):
        raise OSError(22, "Invalid argument")

    monkeypatch.setattr(thread_binding, "_cpus_to_bind", lambda: (0, 1))
    monkeypatch.setattr(thread_binding, "_bind", lambda cpus: True)
    monkeypatch.setattr(thread_binding.os, "sched_setaffinity", refuse)
    ran = False
    with thread_binding.bound_step():
        ran = bool(torch.ones(2).sum() == 2)
    assert ran and thread_binding._bound is None  # bound again at a later step
