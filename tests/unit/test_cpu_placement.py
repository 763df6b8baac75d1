"""Thread placement from the free cores: the choice, and when the monitor changes it."""

from __future__ import annotations

import os

import pytest
import torch

from pdserve.engine import cpu_placement
from pdserve.engine.cpu_placement import PlacementMonitor, choose

pytestmark = pytest.mark.skipif(not cpu_placement.supported(), reason="needs Linux /proc")


def test_one_thread_per_free_cpu_pinned_away_from_busy_ones():
    p = choose({0, 1, 2, 3}, {0: 0.05, 1: 0.97, 2: 0.1, 3: 0.6})
    assert p.cpus == (0, 2) and p.num_threads == 2 and p.pinned
    idle = choose({0, 1}, {0: 0.0, 1: 0.2})
    assert idle.cpus == (0, 1) and idle.num_threads == 2 and not idle.pinned
    swamped = choose({0, 1}, {0: 0.9, 1: 0.8})
    assert swamped.num_threads == 1 and not swamped.pinned  # the OS shares what there is


def test_load_sample_reads_this_machine():
    sample = cpu_placement.LoadSample()
    x = 0
    for i in range(2_000_000):  # keep this process busy for a moment
        x += i
    loads = sample.others_load(os.sched_getaffinity(0))
    assert set(loads) == set(os.sched_getaffinity(0))
    assert all(0.0 <= v <= 1.0 for v in loads.values())


class FakeLoads:
    """Stands in for /proc: the load each new sample will report."""

    def __init__(self, monkeypatch, loads):
        self.loads = loads
        outer = self

        class Sample:
            def __init__(self, ours=("self",)):
                self.t = -1e9  # old enough to be read at once

            def others_load(self, cpus):
                return {c: outer.loads.get(c, 0.0) for c in cpus}

        monkeypatch.setattr(cpu_placement, "LoadSample", Sample)
        monkeypatch.setattr(cpu_placement, "apply", lambda p: None)
        monkeypatch.setattr(cpu_placement.time, "sleep", lambda s: None)


def test_monitor_shrinks_after_slow_decode_steps_and_grows_back_when_idle(monkeypatch):
    fake = FakeLoads(monkeypatch, {0: 0.0, 1: 0.0})
    monitor = PlacementMonitor({0, 1})
    assert monitor.placement.num_threads == 2
    fake.loads = {0: 0.95, 1: 0.0}  # another process takes cpu0
    monitor.on_step("decode", 4, 0.010)  # the best step at batch 4
    for _ in range(cpu_placement.SLOW_STEPS - 1):
        monitor.on_step("decode", 4, 0.05)
    assert monitor.placement.num_threads == 2  # not yet: a few slow steps are noise
    monitor.on_step("decode", 4, 0.05)  # starts a measurement ...
    monitor.on_step("decode", 4, 0.05)  # ... read at the next step
    assert monitor.placement.cpus == (1,) and monitor.placement.num_threads == 1
    fake.loads = {0: 0.0, 1: 0.0}  # the other process is gone
    monitor.on_idle()  # an idle stretch starts a measurement, read after IDLE_REPROBE_S
    monitor.on_idle()
    assert monitor.placement.num_threads == 2


def test_steps_of_other_shapes_or_phases_do_not_trigger(monkeypatch):
    FakeLoads(monkeypatch, {0: 0.0, 1: 0.0})
    monitor = PlacementMonitor({0, 1})
    monitor.on_step("decode", 1, 0.010)
    for _ in range(50):
        monitor.on_step("decode", 64, 0.2)  # a bigger batch is slower, rightly
        monitor.on_step("prefill", 0, 0.5)
    assert monitor._busy_sample is None and monitor.placement.num_threads == 2


def test_an_explicit_thread_count_turns_placement_off(tiny_models):
    from pdserve.config import EngineArgs
    from pdserve.engine.core import place_threads

    before, cpus = torch.get_num_threads(), os.sched_getaffinity(0)
    try:
        assert place_threads(EngineArgs(model=tiny_models["llama"], num_threads=1)) is None
        assert torch.get_num_threads() == 1
        assert isinstance(place_threads(EngineArgs(model=tiny_models["llama"])), PlacementMonitor)
    finally:
        torch.set_num_threads(before)
        os.sched_setaffinity(0, cpus)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to pin to one")
def test_an_explicit_thread_count_undoes_an_earlier_engines_pinning(tiny_models):
    """Offline, engines come and go in one process: one pinned to a single CPU must not leave
    the next one's N threads crowded on it (N OpenMP threads on one core made every small op
    of a later test wait on a barrier, 50x slower)."""
    from pdserve.config import EngineArgs
    from pdserve.engine.core import place_threads

    before, cpus = torch.get_num_threads(), os.sched_getaffinity(0)
    everywhere = cpu_placement.unpinned()  # before any engine of this process pinned it
    try:
        one = min(everywhere)
        cpu_placement.apply(cpu_placement.Placement((one,), 1, {}, pinned=True))
        assert os.sched_getaffinity(0) == {one}
        place_threads(EngineArgs(model=tiny_models["llama"], num_threads=2))
        assert os.sched_getaffinity(0) == everywhere and torch.get_num_threads() == 2
        assert cpu_placement.unpinned() == everywhere  # what a later placement chooses among
    finally:
        torch.set_num_threads(before)
        os.sched_setaffinity(0, cpus)


RUN_ON = """
import os, sys, threading, torch
from pdserve.engine.cpu_placement import parse_cpu_set, run_on
stop = threading.Event()
t = threading.Thread(target=stop.wait)  # a thread made before the move moves too
t.start()
torch.ones(256, 256) @ torch.ones(256, 256)  # the OpenMP pool exists
for text in sys.argv[1:]:
    cpus = parse_cpu_set(text)
    run_on(cpus)
    tids = [int(x) for x in os.listdir("/proc/self/task")]
    assert all(os.sched_getaffinity(tid) == cpus for tid in tids), text
    assert torch.get_num_threads() == len(cpus), text
    threading.Thread(target=lambda: None).start()  # and one made after it inherits the set
stop.set()
print("ok")
"""


@pytest.mark.slow  # a subprocess with torch and OpenMP threads: 15 s on a 2-core Zen 1
def test_run_on_moves_every_thread_and_sets_the_thread_count():
    import subprocess
    import sys

    allowed = sorted(os.sched_getaffinity(0))
    sets = [str(allowed[0])]
    if len(allowed) > 1:  # grow to two CPUs, then move to the other one
        sets += [f"{allowed[0]},{allowed[1]}", str(allowed[1])]
    out = subprocess.run(
        [sys.executable, "-c", RUN_ON, *sets], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_cpu_sets_parse_as_linux_writes_them():
    assert cpu_placement.parse_cpu_set("0") == {0}
    assert cpu_placement.parse_cpu_set("0-2,5") == {0, 1, 2, 5}
    for bad in ("", "a", "3-1", "-1", "0,,1"):
        with pytest.raises(ValueError, match="CPU set"):
            cpu_placement.parse_cpu_set(bad)
