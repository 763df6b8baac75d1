"""How many threads an engine uses, and on which CPUs: chosen from the cores that are free.

torch's default (one thread per core) is fast on an idle machine and 5-15x slower when another
process keeps one of those cores busy: every parallel region waits for the thread that shares its
core. So unless the user sets `--num-threads` or a CPU set, the engine measures each allowed CPU's
load from /proc/stat (a fraction of a second), uses one thread per CPU that is mostly idle, and
pins itself to those CPUs.

The load can change later. `PlacementMonitor` re-measures while the worker is idle, and when the
decode steps get much slower than the best this worker has seen for the same batch size (then it
subtracts its own threads' CPU time, per CPU, from the load it reads). A new placement is logged
with the load that caused it. Linux only; elsewhere the engine keeps torch's default.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field

from pdserve.engine import thread_binding

logger = logging.getLogger("pdserve.placement")

BUSY_THRESHOLD = 0.5  # a CPU busier than this with other work is not ours to use
SAMPLE_S = 0.15  # /proc/stat counts in 10 ms ticks: 15 per CPU, enough for a 50% line
IDLE_REPROBE_S = 10.0  # while idle, re-measure this often
SLOWDOWN = 3.0  # decode steps this much slower than this worker's best: re-measure
SLOW_STEPS = 8  # ... for this many steps in a row


@dataclass(frozen=True)
class Placement:
    cpus: tuple[int, ...]  # where the engine's threads may run
    num_threads: int
    others_load: dict[int, float]  # per allowed CPU: fraction of it busy with other work
    pinned: bool  # narrower than the CPUs the process was allowed

    def describe(self) -> str:
        loads = ", ".join(f"cpu{c} {x:.0%}" for c, x in sorted(self.others_load.items()))
        where = f"pinned to CPUs {list(self.cpus)}" if self.pinned else "unpinned"
        return f"{self.num_threads} thread(s), {where} (other work: {loads})"


def supported() -> bool:
    return os.path.exists("/proc/stat") and hasattr(os, "sched_getaffinity")


def cpu_ticks() -> dict[int, tuple[int, int]]:
    """Per CPU: (busy ticks, total ticks) since boot, from /proc/stat."""
    out = {}
    with open("/proc/stat") as f:
        for line in f:
            if not line.startswith("cpu") or line.startswith("cpu "):
                continue
            name, *values = line.split()
            user, nice, system, idle, iowait, irq, softirq, steal = (int(v) for v in values[:8])
            busy = user + nice + system + irq + softirq + steal
            out[int(name[3:])] = (busy, busy + idle + iowait)
    return out


def own_ticks(pids: tuple[int | str, ...] = ("self",)) -> dict[int, int]:
    """Per CPU: CPU ticks the threads of these processes spent, attributed to the CPU each
    thread last ran on (threads rarely move within a pinned set)."""
    out: dict[int, int] = {}
    for pid in pids:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:  # the process ended
            continue
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:  # the thread ended
                continue
            ticks = int(fields[11]) + int(fields[12])  # utime + stime
            cpu = int(fields[36])
            out[cpu] = out.get(cpu, 0) + ticks
    return out


@dataclass
class LoadSample:
    """A snapshot to measure other processes' load from, once some time has passed. `ours`
    are the processes whose CPU time does not count as other work."""

    ours: tuple[int | str, ...] = ("self",)
    cpu: dict[int, tuple[int, int]] = field(default_factory=cpu_ticks)
    own: dict[int, int] = field(init=False)
    t: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        self.own = own_ticks(self.ours)

    def others_load(self, cpus) -> dict[int, float]:
        """Per CPU in `cpus`: the fraction of it other processes used since the snapshot."""
        now_cpu, now_own = cpu_ticks(), own_ticks(self.ours)
        cpus = [c for c in cpus if c in self.cpu and c in now_cpu]
        busy = {c: now_cpu[c][0] - self.cpu[c][0] for c in cpus}
        total = {c: now_cpu[c][1] - self.cpu[c][1] for c in cpus}
        own = {c: now_own.get(c, 0) - self.own.get(c, 0) for c in cpus}
        # Per CPU, our threads' time is attributed to where each last ran, which a migrating
        # thread blurs; over all the CPUs it is exact. So the per-CPU figures are scaled to
        # the exact total of other work.
        per_cpu = {c: max(busy[c] - own[c], 0) for c in cpus}
        exact = max(sum(busy.values()) - sum(own.values()), 0)
        scale = exact / sum(per_cpu.values()) if sum(per_cpu.values()) > 0 else 0.0
        return {c: min(per_cpu[c] * scale / total[c], 1.0) if total[c] > 0 else 0.0 for c in cpus}


def choose(allowed: set[int], others_load: dict[int, float]) -> Placement:
    """One thread per allowed CPU that other work leaves mostly free; at least one thread."""
    free = tuple(sorted(c for c in allowed if others_load.get(c, 0.0) < BUSY_THRESHOLD))
    if not free:  # everything is busy: share one core as fairly as the OS can
        return Placement(tuple(sorted(allowed)), 1, others_load, pinned=False)
    return Placement(free, len(free), others_load, pinned=len(free) < len(allowed))


# The CPUs this process could use before pdserve first pinned it: a later engine in the same
# process (offline use, tests) places itself among these, not among the previous one's pick.
_UNPINNED: set[int] | None = None


def unpinned() -> set[int]:
    return set(_UNPINNED if _UNPINNED is not None else os.sched_getaffinity(0))


def apply(placement: Placement) -> None:
    import torch

    global _UNPINNED
    if _UNPINNED is None:
        _UNPINNED = set(os.sched_getaffinity(0))
    os.sched_setaffinity(0, placement.cpus)
    torch.set_num_threads(placement.num_threads)
    thread_binding.forget()


def unpin() -> None:
    """Undo an earlier engine's pinning (before threads are set by hand, `--num-threads`)."""
    if _UNPINNED is not None:
        os.sched_setaffinity(0, _UNPINNED)
        thread_binding.forget()


def parse_cpu_set(text: str) -> frozenset[int]:
    """A CPU set as Linux writes it ("0", "0-3", "0,2-3")."""
    ids: set[int] = set()
    try:
        for part in text.split(","):
            lo, _, hi = part.strip().partition("-")
            lo_i, hi_i = int(lo), int(hi or lo)
            if lo_i < 0 or hi_i < lo_i:
                raise ValueError
            ids.update(range(lo_i, hi_i + 1))
    except ValueError:
        raise ValueError(f"invalid CPU set {text!r}: expected e.g. 0, 0-3 or 0,2-3") from None
    return frozenset(ids)


def run_on(cpus: set[int] | frozenset[int]) -> None:
    """Move every thread of this process onto `cpus` and run one torch (and kernel) thread per
    CPU from the next parallel region on. Threads made later inherit the set; an idle OpenMP
    thread beyond the count stays asleep."""
    import torch

    if not cpus:
        raise ValueError("an empty CPU set")
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except ProcessLookupError:  # the thread ended meanwhile
            continue
    torch.set_num_threads(len(cpus))
    thread_binding.forget()  # the team's threads were moved onto the whole set


def measure(allowed: set[int], ours=("self",), seconds: float = SAMPLE_S) -> Placement:
    sample = LoadSample(tuple(ours))
    time.sleep(seconds)
    return choose(allowed, sample.others_load(allowed))


class PlacementMonitor:
    """Owns the engine's placement when the user did not set one (see the module docstring).

    `on_idle()` from the worker loop when it has nothing to do; `on_step(phase, num_decode_seqs,
    step_time_s)` after each step."""

    def __init__(self, allowed: set[int] | None = None) -> None:
        self.allowed = set(allowed or unpinned())
        # At start the parent (a server's frontend) is busy loading too, only for now.
        self.placement = measure(self.allowed, ours=("self", os.getppid()))
        apply(self.placement)
        logger.info("engine threads: %s", self.placement.describe())
        self._idle_sample: LoadSample | None = None
        self._busy_sample: LoadSample | None = None
        self._best_step_s: dict[int, float] = {}  # decode batch size -> fastest step
        self._num_slow = 0

    def on_idle(self) -> None:
        now = time.monotonic()
        if self._idle_sample is None:
            self._idle_sample = LoadSample()
        elif now - self._idle_sample.t >= IDLE_REPROBE_S:
            self._update(self._idle_sample.others_load(self.allowed), "while idle")
            self._idle_sample = LoadSample()

    def on_step(self, phase: str, num_decode_seqs: int, step_time_s: float) -> None:
        self._idle_sample = None  # an idle stretch starts afresh
        if self._busy_sample is not None:
            if time.monotonic() - self._busy_sample.t >= SAMPLE_S:
                loads = self._busy_sample.others_load(self.allowed)
                self._busy_sample = None
                self._update(loads, "after slow decode steps")
            return
        if phase != "decode" or step_time_s <= 0:
            return
        best = self._best_step_s.get(num_decode_seqs)
        if best is None or step_time_s < best:
            self._best_step_s[num_decode_seqs] = step_time_s
            self._num_slow = 0
        elif step_time_s > SLOWDOWN * best:
            self._num_slow += 1
            if self._num_slow >= SLOW_STEPS:
                self._num_slow = 0
                self._busy_sample = LoadSample()
        else:
            self._num_slow = 0

    def _update(self, loads: dict[int, float], when: str) -> None:
        new = choose(self.allowed, loads)
        if (new.cpus, new.num_threads) == (self.placement.cpus, self.placement.num_threads):
            return
        logger.warning(
            "engine threads %s: %s (was %s thread(s)); set --num-threads or a CPU set to "
            "place the engine yourself",
            when,
            new.describe(),
            self.placement.num_threads,
        )
        self.placement = new
        apply(new)
        self._best_step_s.clear()  # the new placement has its own best
