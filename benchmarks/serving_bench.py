"""What the serving layer costs: `pdserve serve` against the offline engine, and the request rate
one frontend sustains before it, not the model, is the bottleneck.

    python benchmarks/serving_bench.py [--models DIR,DIR] [--output FILE]

1. Latency at low load, per model: the same prompts (built by `pdserve bench`'s own prompt code,
   seed 0) one at a time, greedy, `ignore_eos`, through
   - the offline engine (`pdserve.LLM` in a separate process, per-request `RequestMetrics`), and
   - `pdserve serve` (a subprocess on a free 127.0.0.1 port) with `pdserve bench`'s streaming
     client at `--max-concurrency 1`;
   both with default engine arguments and one untimed warm-up pass. The difference in TTFT, ITL
   and TPOT is what the HTTP/SSE frontend, the IPC hop and the process split add. The server's
   own `timings` (taken in the frontend) split that into "inside the server" and "HTTP + client".
2. Frontend ceiling (the first model, normally the tiny stories260K, short outputs): Poisson
   arrivals at increasing rates against one `pdserve serve`; per rate the completed req/s and
   output tokens/s, and the CPU time of the frontend process (and its busiest thread), the
   worker process and this client process over the run, from /proc, next to the worker's own busy
   time (the sum of its engine step times, from /metrics).

Timed phases wait until no `engine_bench|engine_whatif|pytest` process runs (polled every 20 s,
up to 15 min) and record any such process seen while they ran (`disturbed` in the JSON).

The random llama-125m is written with `pdserve make-model --preset llama-125m` when missing.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from functools import partial
from pathlib import Path

import httpx
import numpy as np

from pdserve.bench.client import ClientConfig, run_requests
from pdserve.bench.metrics import COMPLETED, latency_stats, summarize
from pdserve.bench.tokenizer import HFPromptTokenizer, load_tokenizer
from pdserve.bench.workload import WorkloadConfig, build_prompts, make_specs, with_rate

ROOT = Path(__file__).resolve().parent.parent
STORIES = ROOT.parent / "shared" / "models" / "stories260K"
DEFAULT_125M = Path(tempfile.gettempdir()) / "pdbench" / "llama-125m"
# Other people's benchmarks and tests, and any pdserve process this script did not start (a test's
# server and workers do not match the first three names).
BUSY_PATTERN = "engine_bench|engine_whatif|pytest|pdserve"
CLK_TCK = os.sysconf("SC_CLK_TCK")


# ---- keeping out of another benchmark's way -------------------------------------------------
def own_processes() -> set[int]:
    """This process and all its descendants."""
    parent = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    parent[int(d)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (FileNotFoundError, ProcessLookupError, IndexError):
                pass
    own, frontier = {os.getpid()}, [os.getpid()]
    while frontier:
        p = frontier.pop()
        kids = [c for c, pp in parent.items() if pp == p and c not in own]
        own.update(kids)
        frontier.extend(kids)
    return own


def busy_processes(pattern: str = BUSY_PATTERN) -> list[str]:
    out = subprocess.run(["pgrep", "-af", pattern], capture_output=True, text=True).stdout
    lines = [ln for ln in out.splitlines() if ln.strip()]
    if not lines:
        return []
    own = own_processes()
    return [ln[:160] for ln in lines if int(ln.split()[0]) not in own]


def wait_quiet(pattern: str = BUSY_PATTERN, poll_s: float = 20.0, max_wait_s: float = 900.0):
    """Block until no process matches `pattern` (or `max_wait_s` passed); returns the wait and
    whether it ended quiet."""
    t0 = time.monotonic()
    while True:
        busy = busy_processes(pattern)
        if not busy:
            return {"waited_s": round(time.monotonic() - t0, 1), "quiet": True}
        if time.monotonic() - t0 >= max_wait_s:
            print(f"  still busy after {max_wait_s:.0f} s, measuring anyway: {busy}", flush=True)
            return {"waited_s": round(time.monotonic() - t0, 1), "quiet": False}
        print(f"  waiting for a quiet CPU: {busy[0]}", flush=True)
        time.sleep(poll_s)


class Watch:
    """Records every `BUSY_PATTERN` process seen while a timed phase runs (polled every 2 s)."""

    def __init__(self, pattern: str = BUSY_PATTERN, every_s: float = 1.0) -> None:
        self.pattern, self.every_s, self.seen = pattern, every_s, set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.seen.update(busy_processes(self.pattern))
            self._stop.wait(self.every_s)

    def __enter__(self) -> Watch:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.seen.update(busy_processes(self.pattern))

    @property
    def disturbed(self) -> list[str]:
        return sorted(self.seen)


def measured(fn, label: str, attempts: int = 4):
    """Run `fn` on a quiet CPU; run it again (up to `attempts` times) when another benchmark or
    test showed up while it ran. Returns (result, {waits, attempts, disturbed})."""
    meta: dict = {"waits_s": [], "attempts": 0, "disturbed": []}
    for i in range(attempts):
        meta["waits_s"].append(wait_quiet()["waited_s"])
        meta["attempts"] = i + 1
        with Watch() as w:
            result = fn()
        meta["disturbed"] = w.disturbed
        if not w.disturbed:
            break
        print(
            f"  {label}: disturbed by {w.disturbed[0]}"
            + ("; measuring again" if i + 1 < attempts else "; keeping it, marked"),
            flush=True,
        )
    return result, meta


# ---- CPU accounting from /proc --------------------------------------------------------------
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


def machine_busy() -> tuple[float, float]:
    """(busy, total) jiffies of all CPUs from /proc/stat."""
    with open("/proc/stat") as f:
        vals = [int(x) for x in f.readline().split()[1:]]
    idle = vals[3] + vals[4]
    return sum(vals) - idle, sum(vals)


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


# ---- a pdserve server as a subprocess ---------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_pids(frontend_pid: int) -> dict[str, int]:
    """`{role}{worker id}` -> pid of each engine worker a frontend started (its children running
    `pdserve.engine.worker`), by worker id. /health no longer lists PIDs, so they come from /proc,
    as an operator would find them."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().decode().split("\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == frontend_pid and "pdserve.engine.worker" in argv:
            role = argv[argv.index("--role") + 1]
            found.append((int(argv[argv.index("--worker-id") + 1]), role, int(entry)))
    return {f"{role}{wid}": pid for wid, role, pid in sorted(found)}


class Server:
    """`pdserve serve ARGS` on a free 127.0.0.1 port, in its own process group."""

    def __init__(
        self,
        args: list[str],
        log_path: str | Path,
        timeout_s: float = 300.0,
        prefix: list[str] | None = None,
    ) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.cmd = [*(prefix or []), "pdserve", "serve", *args, "--port", str(self.port)]
        self.cmd += ["--log-level", "warning"]
        self.log_path = str(log_path)
        self.timeout_s = timeout_s

    @property
    def command_line(self) -> str:
        return " ".join(self.cmd)

    def __enter__(self) -> Server:
        self.log = open(self.log_path, "w")
        # Run from the log folder: workers start as `python -m pdserve.engine.worker`, which puts
        # the working directory first on sys.path, so a pdserve/ folder there (a checkout's)
        # would shadow the pdserve the frontend imported.
        self.proc = subprocess.Popen(
            self.cmd,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=Path(self.log_path).parent,
        )
        deadline = time.monotonic() + self.timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited ({self.proc.returncode}); see {self.log_path}")
            try:
                r = httpx.get(self.base_url + "/health", timeout=2, trust_env=False)
                if r.status_code == 200:
                    self.health = r.json()
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.__exit__()
                raise RuntimeError(f"server not healthy in {self.timeout_s} s; see {self.log_path}")
            time.sleep(0.5)
        self.workers = worker_pids(self.proc.pid)
        return self

    def metrics(self) -> str:
        return httpx.get(self.base_url + "/metrics", timeout=10, trust_env=False).text

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            # SIGTERM the frontend only: it stops its workers. (SIGTERM to the whole group stops
            # the workers first, and the frontend then waits forever to send them Shutdown.)
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


def metric_sums(text: str, name: str) -> dict[str, float]:
    """Values of every sample of metric `name` (a counter, a gauge, or a histogram's _sum or
    _count), keyed by its label string."""
    out = {}
    for line in text.splitlines():
        m = re.match(rf"^{re.escape(name)}(\{{[^}}]*\}})?\s+(\S+)$", line)
        if m:
            out[m.group(1) or ""] = float(m.group(2))
    return out


def metric_total(text: str, name: str, label_filter: str = "") -> float:
    return sum(v for k, v in metric_sums(text, name).items() if label_filter in k)


# ---- workloads ---------------------------------------------------------------------------------
def prompts_for(model: str, num: int, input_len: int, output_len: int, seed: int = 0):
    """Exactly the requests `pdserve bench --input-len I --output-len O --num-requests N
    --seed S` sends to a server of this model (completions endpoint)."""
    tok = HFPromptTokenizer(load_tokenizer(model), chat=False)
    cfg = WorkloadConfig(num_requests=num, input_len=input_len, output_len=output_len, seed=seed)
    return build_prompts(make_specs(cfg), tok, seed)


def send(requests, base_url: str, model: str, max_concurrency: int | None = None):
    cfg = ClientConfig(base_url, model, "completions", temperature=0.0)
    return asyncio.run(run_requests(requests, cfg, max_concurrency))


def ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}" if x < 100 else f"{x:.0f}"


# ---- part 1: offline engine vs server at low load -------------------------------------------
def offline_main(
    model: str, prompts_file: str, out_file: str, output_len: int, burst: bool = False
) -> None:
    """Child process: each prompt alone through `pdserve.LLM`, greedy, its RequestMetrics and
    the engine's own step times; or (`burst`) all prompts in one `generate` call."""
    from pdserve import LLM, SamplingParams

    prompts, warmup = json.loads(Path(prompts_file).read_text())
    llm = LLM(model=model)
    params = SamplingParams(
        temperature=0, max_tokens=output_len, min_tokens=output_len, ignore_eos=True
    )
    if burst:
        llm.generate(warmup, params)
        t0, c0 = time.perf_counter(), os.times()
        outs = llm.generate(prompts, params)
        wall, c1 = time.perf_counter() - t0, os.times()
        ntok = sum(len(o.outputs[0].token_ids) for o in outs)
        cpu = (c1.user - c0.user) + (c1.system - c0.system)
        res = {
            "num_requests": len(prompts),
            "wall_s": wall,
            "request_throughput": len(prompts) / wall,
            "output_throughput": ntok / wall,
            "cores": cpu / wall,
        }
        Path(out_file).write_text(json.dumps(res))
        return
    core = llm.engine.core
    core_step, steps = core.step, []

    def timed_step():  # the same step times the server's workers export to /metrics
        prev = core.last_step
        out = core_step()
        if core.last_step is not prev:
            steps.append((core.last_step.phase, core.last_step.step_time_s))
        return out

    core.step = timed_step
    for p in warmup:  # untimed, other prompts (no prefix-cache hits for the timed ones)
        llm.generate([p], params)
    steps.clear()
    rows = []
    for p in prompts:
        (out,) = llm.generate([p], params)
        m = out.metrics
        rows.append(
            {
                "ttft": m.ttft,
                "itl": m.itl,
                "tpot": m.tpot,
                "e2e": m.e2e,
                "prompt_tokens": m.num_prompt_tokens,
                "output_tokens": len(out.outputs[0].token_ids),
            }
        )
    Path(out_file).write_text(json.dumps({"rows": rows, "steps": steps}))


def step_means(pairs) -> dict[str, float]:
    """Mean step time (ms) per phase from (phase, seconds) pairs."""
    by: dict[str, list[float]] = {}
    for phase, sec in pairs:
        by.setdefault(phase, []).append(sec)
    return {k: float(np.mean(v)) * 1e3 for k, v in by.items()}


def with_overheads(res: dict) -> dict:
    """TTFT beyond the prefill step and TPOT beyond the decode step: what is not the model."""
    st = res["step_ms"]
    res["ttft_minus_prefill_step_ms"] = res["ttft_ms"]["mean"] - st.get("prefill", np.nan)
    res["tpot_minus_decode_step_ms"] = res["tpot_ms"]["mean"] - st.get("decode", np.nan)
    return res


def offline_run(model: str, requests, warmup, output_len: int, workdir: Path) -> dict:
    pf, of = workdir / "prompts.json", workdir / "offline.json"
    pf.write_text(json.dumps([[r.prompt for r in requests], [r.prompt for r in warmup]]))
    cmd = [sys.executable, __file__, "--_offline", model, str(pf), str(of), str(output_len)]
    subprocess.run(cmd, check=True)
    data = json.loads(of.read_text())
    rows = data["rows"]
    return with_overheads(
        {
            "ttft_ms": latency_stats(r["ttft"] for r in rows),
            "itl_ms": latency_stats(g for r in rows for g in r["itl"]),
            "tpot_ms": latency_stats(r["tpot"] for r in rows),
            "e2e_ms": latency_stats(r["e2e"] for r in rows),
            "step_ms": step_means(data["steps"]),
            "prompt_tokens": sorted({r["prompt_tokens"] for r in rows}),
            "output_tokens": sorted({r["output_tokens"] for r in rows}),
        }
    )


def server_run(model: str, requests, warmup, workdir: Path) -> dict:
    with Server(["--model", model], workdir / "serve-latency.log") as srv:
        send(warmup, srv.base_url, model, max_concurrency=1)  # untimed, other prompts
        m0 = srv.metrics()
        records = send(requests, srv.base_url, model, max_concurrency=1)
        m1 = srv.metrics()
        command = srv.command_line
    done = [r for r in records if r.status == COMPLETED]
    s = summarize(records)
    st = [r.server_timings or {} for r in done]
    step_ms = {}
    for phase in ("prefill", "decode", "mixed"):
        f = f'phase="{phase}"'
        n = metric_total(m1, "pdserve_step_time_seconds_count", f) - metric_total(
            m0, "pdserve_step_time_seconds_count", f
        )
        sec = metric_total(m1, "pdserve_step_time_seconds_sum", f) - metric_total(
            m0, "pdserve_step_time_seconds_sum", f
        )
        if n:
            step_ms[phase] = sec / n * 1e3
    return with_overheads(
        {
            "command": command,
            "completed": s["completed"],
            "failed": s["failed"],
            "ttft_ms": s["ttft_ms"],
            "itl_ms": s["itl_ms"],
            "tpot_ms": s["tpot_ms"],
            "e2e_ms": s["e2e_ms"],
            "server_ttft_ms": latency_stats(t["ttft_ms"] / 1e3 for t in st if "ttft_ms" in t),
            "server_tpot_ms": latency_stats(t["tpot_ms"] / 1e3 for t in st if t.get("tpot_ms")),
            "step_ms": step_ms,
            "chunks_per_request": float(np.mean([len(r.token_times) for r in done])),
            "prompt_tokens": sorted({r.prompt_tokens for r in done}),
            "output_tokens": sorted({r.completion_tokens for r in done}),
        }
    )


def latency_part(models: list[str], a, workdir: Path) -> list[dict]:
    """Offline and server alternately, `a.rounds` times each: the host's speed drifts between
    runs (shared memory bandwidth), so each comparison is between neighbouring runs."""
    results = []
    for model in models:
        name = Path(model).name
        print(f"\n== low-load latency: {name} ==", flush=True)
        both = prompts_for(model, a.num_requests + 5, a.input_len, a.output_len)
        # the first N are what `pdserve bench --num-requests N` sends; 5 more warm up
        requests, warmup = both[: a.num_requests], both[a.num_requests :]
        entry: dict = {"model": model, "name": name, "offline": [], "server": [], "meta": []}
        for i in range(a.rounds):
            runs = {
                "offline": partial(offline_run, model, requests, warmup, a.output_len, workdir),
                "server": partial(server_run, model, requests, warmup, workdir),
            }
            for what, fn in runs.items():
                res, meta = measured(fn, f"{name} {what} round {i + 1}")
                entry[what].append(res)
                entry["meta"].append({"what": what, "round": i + 1, **meta})
                gc.collect()
            print_latency(entry, i)
        results.append(entry)
    return results


def print_latency(e: dict, i: int) -> None:
    off, srv = e["offline"][i], e["server"][i]
    print(
        f"{e['name']} round {i + 1}: prompt tokens {srv['prompt_tokens']} (offline "
        f"{off['prompt_tokens']}), output tokens {srv['output_tokens']} (offline "
        f"{off['output_tokens']})"
    )
    print(
        f"{'ms':<10}{'offline p50':>12}{'server p50':>12}{'diff':>8}"
        f"{'offline mean':>14}{'server mean':>13}{'diff':>8}"
    )
    for key in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"):
        o, s = off[key], srv[key]
        print(
            f"{key[:-3].upper():<10}{ms(o['p50']):>12}{ms(s['p50']):>12}"
            f"{ms(s['p50'] - o['p50']):>8}{ms(o['mean']):>14}{ms(s['mean']):>13}"
            f"{ms(s['mean'] - o['mean']):>8}"
        )
    for label, key in (
        ("TTFT - prefill step", "ttft_minus_prefill_step_ms"),
        ("TPOT - decode step", "tpot_minus_decode_step_ms"),
    ):
        print(f"{label:<20}{ms(off[key]):>8} (offline){ms(srv[key]):>8} (server)")
    print(
        f"step ms offline {off['step_ms']}, server worker {srv['step_ms']}; server-side TTFT "
        f"(frontend timings) p50 {ms(srv['server_ttft_ms']['p50'])} ms"
    )


# ---- part 2: frontend throughput ceiling ------------------------------------------------------
MODES = {
    # name: (command prefix of the server, extra serve args, CPUs of this client process)
    "unpinned": ([], [], None),
    "pinned": (["taskset", "-c", "0"], ["--cpus", "1"], {0}),  # frontend+client core 0, worker 1
}


def ceiling_part(model: str, a, workdir: Path) -> dict:
    name = Path(model).name
    print(
        f"\n== frontend ceiling: {name}, {a.ceiling_input_len} in / {a.ceiling_output_len} out ==",
        flush=True,
    )
    seeds = iter(range(100, 10_000))

    def fresh(n: int):  # new prompt text for every run: no prefix-cache hits across runs
        return prompts_for(model, n, a.ceiling_input_len, a.ceiling_output_len, next(seeds))

    out: dict = {
        "model": model,
        "input_len": a.ceiling_input_len,
        "output_len": a.ceiling_output_len,
    }
    burst, warm = fresh(a.burst_requests), fresh(50)

    def offline_burst():
        pf, of = workdir / "burst.json", workdir / "burst-out.json"
        pf.write_text(json.dumps([[r.prompt for r in burst], [r.prompt for r in warm]]))
        cmd = [sys.executable, __file__, "--_offline", model, str(pf), str(of)]
        subprocess.run([*cmd, str(a.ceiling_output_len), "--burst"], check=True)
        return json.loads(of.read_text())

    out["offline_burst"], out["offline_burst_meta"] = measured(offline_burst, "offline burst")
    ob = out["offline_burst"]
    print(
        f"offline engine, {ob['num_requests']} requests in one generate(): "
        f"{ob['request_throughput']:.1f} req/s, {ob['output_throughput']:.0f} output tok/s, "
        f"{ob['cores']:.2f} cores",
        flush=True,
    )
    out["modes"] = {}
    for mode in a.ceiling_modes.split(","):
        print(f"-- {mode} --", flush=True)
        out["modes"][mode] = sweep(model, mode, fresh, a, workdir)
    return out


def sweep(model: str, mode: str, fresh, a, workdir: Path) -> dict:
    prefix, extra, client_cpus = MODES[mode]
    rates = [float(x) for x in a.rates.split(",")]
    n_max = max(a.min_requests, int(max(r for r in rates if np.isfinite(r)) * a.seconds_per_rate))
    out: dict = {"rates": []}
    old_affinity = os.sched_getaffinity(0)
    wait_quiet()
    srv = Server(["--model", model, *extra], workdir / f"serve-ceiling-{mode}.log", prefix=prefix)
    with srv:
        if client_cpus:
            os.sched_setaffinity(0, client_cpus)
        out["command"] = srv.command_line
        send(fresh(50), srv.base_url, model, max_concurrency=8)  # warm-up
        ((worker_name, worker_pid),) = srv.workers.items()
        pids = {"frontend": srv.proc.pid, "worker": worker_pid, "client": os.getpid()}
        saturated = 0
        for rate in rates:
            n = (
                a.burst_requests
                if not np.isfinite(rate)
                else max(a.min_requests, min(n_max, int(rate * a.seconds_per_rate)))
            )

            def one_rate(n=n, rate=rate):
                reqs = with_rate(fresh(n), rate, 1.0, seed=1)
                m0 = srv.metrics()
                with CpuMeter(pids) as cpu:
                    records = send(reqs, srv.base_url, model)
                return m0, srv.metrics(), cpu, records

            (m0, m1, cpu, records), meta = measured(one_rate, f"rate {rate}")
            s = summarize(records)
            step_s = metric_total(m1, "pdserve_step_time_seconds_sum") - metric_total(
                m0, "pdserve_step_time_seconds_sum"
            )
            steps = metric_total(m1, "pdserve_step_time_seconds_count") - metric_total(
                m0, "pdserve_step_time_seconds_count"
            )
            row = {
                "rate": rate if np.isfinite(rate) else "inf",
                "num_requests": n,
                "summary": s,
                "cpu": cpu.result,
                "worker_step_busy": step_s / cpu.result["wall_s"],
                "steps": steps,
                "ms_per_step": step_s / steps * 1e3 if steps else None,
                "meta": meta,
            }
            out["rates"].append(row)
            print_ceiling_row(row, first=len(out["rates"]) == 1)
            if np.isfinite(rate) and s["request_throughput"] < 0.85 * rate:
                saturated += 1
                if saturated >= 2:
                    print("  (two rates well above what completes: stopping the sweep)")
                    break
    os.sched_setaffinity(0, old_affinity)
    best = max(out["rates"], key=lambda r: r["summary"]["request_throughput"])
    out["max_request_throughput"] = best["summary"]["request_throughput"]
    out["max_output_throughput"] = best["summary"]["output_throughput"]
    out["at_rate"] = best["rate"]
    print(
        f"max completed: {out['max_request_throughput']:.1f} req/s, "
        f"{out['max_output_throughput']:.0f} output tokens/s (offered rate {out['at_rate']})",
        flush=True,
    )
    return out


def print_ceiling_row(row: dict, first: bool) -> None:
    if first:
        print(
            f"{'rate':>6}{'n':>5}{'req/s':>8}{'tok/s':>8}{'TTFT p50':>10}{'TTFT p99':>10}"
            f"{'ITL p50':>9}{'ITL p99':>9}{'front':>7}{'f.main':>7}{'worker':>7}"
            f"{'w.steps':>8}{'ms/step':>8}{'client':>7}{'machine':>8}{'other':>7}"
        )
    s, c = row["summary"], row["cpu"]["processes"]
    print(
        f"{row['rate']:>6}{row['num_requests']:>5}{s['request_throughput']:>8.1f}"
        f"{s['output_throughput']:>8.0f}{ms(s['ttft_ms']['p50']):>10}{ms(s['ttft_ms']['p99']):>10}"
        f"{ms(s['itl_ms']['p50']):>9}{ms(s['itl_ms']['p99']):>9}"
        f"{c['frontend']['cores']:>7.2f}{c['frontend']['busiest_thread_cores']:>7.2f}"
        f"{c['worker']['cores']:>7.2f}{row['worker_step_busy']:>8.2f}{ms(row['ms_per_step']):>8}"
        f"{c['client']['cores']:>7.2f}"
        f"{row['cpu']['machine_cores_busy']:>8.2f}{row['cpu']['other_cores']:>7.2f}",
        flush=True,
    )


def machine_info() -> dict:
    with open("/proc/cpuinfo") as f:
        cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "?")
    return {
        "cpus": os.cpu_count(),
        "cpu_model": cpu,
        "mem_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
    }


def code_info() -> dict:
    """Which pdserve is measured (set PYTHONPATH to a clean export to pin a commit)."""
    import pdserve

    git = ["git", "-C", str(ROOT)]
    head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    dirty = subprocess.run(
        [*git, "status", "--porcelain", "pdserve"], capture_output=True, text=True
    ).stdout.split("\n")
    return {
        "pdserve": str(Path(pdserve.__file__).parent),
        "repo_head": head.strip(),
        "repo_pdserve_dirty": [d for d in dirty if d],
    }


def ensure_125m(path: Path) -> str:
    if not (path / "config.json").exists():
        subprocess.run(["pdserve", "make-model", "--preset", "llama-125m", str(path)], check=True)
    return str(path)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--_offline":
        offline_main(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]), "--burst" in sys.argv)
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--models",
        help=f"comma-separated model folders (default: {STORIES} and a "
        f"random llama-125m in {DEFAULT_125M})",
    )
    p.add_argument("--num-requests", type=int, default=20)
    p.add_argument("--rounds", type=int, default=2, help="offline/server pairs per model")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument(
        "--rates", default="10,20,40,60,80,120,160,inf", help="ceiling sweep: request rates (req/s)"
    )
    p.add_argument("--ceiling-input-len", type=int, default=128)
    p.add_argument("--ceiling-output-len", type=int, default=16)
    p.add_argument("--seconds-per-rate", type=float, default=12.0)
    p.add_argument("--min-requests", type=int, default=120)
    p.add_argument("--burst-requests", type=int, default=600, help="requests sent at rate inf")
    p.add_argument(
        "--ceiling-modes",
        default="unpinned,pinned",
        help="unpinned: default placement; pinned: frontend and client on CPU 0, worker on CPU 1",
    )
    p.add_argument("--skip-latency", action="store_true")
    p.add_argument("--skip-ceiling", action="store_true")
    p.add_argument("--output", help="write every result as JSON here")
    a = p.parse_args()
    models = a.models.split(",") if a.models else [str(STORIES), ensure_125m(DEFAULT_125M)]
    workdir = Path(tempfile.mkdtemp(prefix="serving_bench-"))
    print(f"logs in {workdir}")
    res: dict = {"machine": machine_info(), "code": code_info(), "args": vars(a)}
    print(f"pdserve from {res['code']['pdserve']}")
    if not a.skip_latency:
        res["latency"] = latency_part(models, a, workdir)
    if not a.skip_ceiling:
        res["ceiling"] = ceiling_part(models[0], a, workdir)
    if a.output:
        Path(a.output).write_text(json.dumps(res, indent=1))
        print(f"wrote {a.output}")


if __name__ == "__main__":
    main()
