"""The machine's speed beside a measured run: decode probes in the run's idle moments.

    python benchmarks/lib/speed_sensor.py --profile prof.json --model DIR --size 2 --cpus 0,1 \\
        --output trace.json     # until SIGTERM or SIGINT; "ready" on stdout once it probes

A shared VM's memory bandwidth moves between levels in stretches of seconds to minutes
(docs/PERFORMANCE.md), and a two-thread decode step with it; a profile or a speed trace taken
before a run cannot know the stretches the run will meet. This process follows them while the run
goes: every `--interval` seconds, once the sensor's CPUs have been idle for `GATE_S` (so it seldom
meets a served step), an engine of its own on `--cpus` runs a few decode steps of one sequence
and records their median time over the profile's fitted model (`perf.step_profile.speed_probe`,
the probe of `pdserve profile --speed-trace`). A probe whose threads waited on a run queue for
more than `MAX_WAIT_MS` met another process's work on its CPUs: it measured the load, not the
host, and is dropped. Written on exit: the probes (seconds since `start`, on the system's
monotonic clock, which `time.perf_counter` shares on Linux), how many were kept, dropped and
skipped, and the CPU time they took (what they may have taken from the run).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lib.procstat import cpus_busy_jiffies, run_queue_wait  # noqa: E402
from pdserve.cli import parse_args  # noqa: E402
from pdserve.commands.engine_args import engine_args_from  # noqa: E402
from pdserve.engine.core import EngineCore  # noqa: E402
from pdserve.perf.step_profile import Driver, profile_description, speed_probe  # noqa: E402
from pdserve.planner.profile import Profile  # noqa: E402

GATE_S = 0.03  # the sensor's CPUs idle this long before a probe
GATE_WAIT_S = 0.5  # a probe's slot is skipped when they are not, within this
MAX_WAIT_MS = 2.0  # a probe whose threads waited longer on a run queue is dropped


def idle_moment(cpus: list[int], stop) -> bool:
    """Whether `cpus` had a quiet `GATE_S` (no busy tick) within `GATE_WAIT_S`."""
    deadline = time.monotonic() + GATE_WAIT_S
    while time.monotonic() < deadline and not stop():
        before = cpus_busy_jiffies(cpus)
        time.sleep(GATE_S)
        if cpus_busy_jiffies(cpus) == before:
            return True
    return False


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--profile", required=True,
                   help="profile JSON, or a sim_accuracy_bench.py output holding one")  # fmt: skip
    p.add_argument("--model", required=True)
    p.add_argument("--linear-backend", default="auto")
    p.add_argument("--size", type=int, required=True, help="threads: the profile's worker size")
    p.add_argument("--cpus", required=True, help="the CPUs to probe on, e.g. 0,1")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between probes")
    p.add_argument("--output", required=True)
    a = p.parse_args()
    cpus = [int(c) for c in a.cpus.split(",")]
    if len(cpus) != a.size:
        p.error(f"--cpus names {len(cpus)} CPUs for a {a.size}-thread probe")
    saved = json.loads(Path(a.profile).read_text())
    profile = Profile.from_dict(saved["profile"] if "entries" in saved else saved)
    _, cli = parse_args(["profile", "--model", a.model, "--linear-backend", a.linear_backend,
                         "--output", "-"])  # fmt: skip
    engine = engine_args_from(cli)
    if profile.description != profile_description(engine):
        raise SystemExit(f"the profile is of {profile.description!r}, not of this engine")
    model = profile.fitted_step_model(a.size)

    stopping = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopping.append(True))
    stop = lambda: bool(stopping)  # noqa: E731

    os.sched_setaffinity(0, cpus)
    torch.set_num_threads(a.size)
    driver = Driver(EngineCore(dataclasses.replace(engine, num_threads=a.size)), seed=os.getpid())
    driver.warm_up()
    points: list[tuple[float, float]] = []
    kept = dropped = skipped = 0
    probe_cpu_s = 0.0
    start = time.monotonic()
    print("ready", flush=True)
    next_probe = start
    while not stop():
        while (now := time.monotonic()) < next_probe and not stop():
            time.sleep(min(0.05, next_probe - now))
        next_probe += a.interval
        if stop() or not idle_moment(cpus, stop):
            skipped += not stop()
            continue
        waited, cpu0, t = run_queue_wait(os.getpid()), time.process_time(), time.monotonic()
        ratio = speed_probe(driver, model)
        probe_cpu_s += time.process_time() - cpu0
        if ratio is None or run_queue_wait(os.getpid()) - waited > MAX_WAIT_MS / 1e3:
            dropped += 1
            continue
        kept += 1
        points.append((t - start, ratio))
    out = {
        "start": start, "size": a.size, "cpus": cpus, "interval_s": a.interval,
        "seconds": time.monotonic() - start, "points": points,
        "kept": kept, "dropped": dropped, "skipped": skipped, "probe_cpu_s": probe_cpu_s,
    }  # fmt: skip
    Path(a.output).write_text(json.dumps(out))


if __name__ == "__main__":
    main()
