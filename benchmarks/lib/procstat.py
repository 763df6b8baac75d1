"""CPU time of processes, threads and the whole machine, from /proc."""

from __future__ import annotations

import os
import time

CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_jiffies() -> list[int]:
    """The aggregate `cpu` line of /proc/stat: user, nice, system, idle, iowait, irq, softirq,
    steal, ... in clock ticks since boot."""
    with open("/proc/stat", encoding="ascii") as f:
        return [int(x) for x in f.readline().split()[1:]]


def busy_jiffies() -> int:
    """CPU time (clock ticks) all processes spent busy since boot."""
    user, nice, system, _idle, _iowait, irq, softirq, steal = cpu_jiffies()[:8]
    return user + nice + system + irq + softirq + steal


def cpus_busy_jiffies(cpus: list[int]) -> int:
    """Clock ticks the CPUs `cpus` spent busy since boot (their `cpuN` lines of /proc/stat)."""
    names = {f"cpu{c}" for c in cpus}
    total = 0
    with open("/proc/stat", encoding="ascii") as f:
        for line in f:
            fields = line.split()
            if fields and fields[0] in names:
                user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, fields[1:9])
                total += user + nice + system + irq + softirq + steal
    return total


def run_queue_wait(pid: int) -> float:
    """Seconds the process's threads have spent runnable but waiting for a CPU, all together
    (/proc/PID/task/*/schedstat, second field): two threads on one CPU take turns."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat", encoding="ascii") as f:
                total += int(f.read().split()[1])
        except (OSError, IndexError, ValueError):  # a thread that ended meanwhile
            continue
    return total / 1e9


def machine_busy() -> tuple[float, float]:
    """(busy, total) jiffies of all CPUs from /proc/stat."""
    vals = cpu_jiffies()
    idle = vals[3] + vals[4]
    return sum(vals) - idle, sum(vals)


def parent_pids() -> dict[int, int]:
    """pid -> parent pid of every process (those that vanish while read are left out)."""
    parent = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    parent[int(d)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    return parent


def cpu_seconds(pid: int, tid: int | None = None) -> float:
    """user + system CPU seconds of a process (all its threads) or of one of its threads."""
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    with open(path) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime, stime (fields 14, 15)


def thread_cpu(pid: int) -> dict[int, tuple[str, float]]:
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                name = f.read().strip()
            out[int(tid)] = (name, cpu_seconds(pid, int(tid)))
        except (FileNotFoundError, ProcessLookupError):
            pass
    return out


class CpuMeter:
    """CPU time of named processes (and the busiest thread of each) over a window."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids

    def __enter__(self) -> CpuMeter:
        self.t0 = time.perf_counter()
        self.cpu0 = {k: cpu_seconds(p) for k, p in self.pids.items()}
        self.threads0 = {k: thread_cpu(p) for k, p in self.pids.items()}
        self.machine0 = machine_busy()
        return self

    def __exit__(self, *exc) -> None:
        wall = time.perf_counter() - self.t0
        busy1, total1 = machine_busy()
        self.result = {"wall_s": wall, "processes": {}}
        for name, pid in self.pids.items():
            used = cpu_seconds(pid) - self.cpu0[name]
            t1 = thread_cpu(pid)
            per_thread = sorted(
                ((t1[t][1] - self.threads0[name].get(t, ("", 0.0))[1], t1[t][0]) for t in t1),
                reverse=True,
            )
            top_s, top_name = per_thread[0] if per_thread else (0.0, "")
            self.result["processes"][name] = {
                "pid": pid,
                "cpu_s": used,
                "cores": used / wall,
                "busiest_thread": top_name,
                "busiest_thread_cores": top_s / wall,
            }
        busy0, total0 = self.machine0
        ncpu = os.cpu_count() or 1
        self.result["machine_cores_busy"] = (busy1 - busy0) / max(1, total1 - total0) * ncpu
        # CPU the machine spent outside the measured processes (another job, the kernel...)
        self.result["other_cores"] = self.result["machine_cores_busy"] - sum(
            p["cores"] for p in self.result["processes"].values()
        )
