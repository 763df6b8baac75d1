"""How close the simulator comes to measured serving: the same requests, run and simulated.

    pdserve profile --model DIR --output prof.json    # ~6 minutes
    python benchmarks/sim_accuracy_bench.py --profile prof.json --output acc.json   # ~30 minutes
    python benchmarks/sim_accuracy_bench.py --reanalyze acc.json
    python benchmarks/sim_accuracy_bench.py --resimulate acc.json --profile prof.json --output b.json
    python benchmarks/sim_accuracy_bench.py --spread acc.json acc2.json   # run against run

For each workload x deployment, the requests are sent to `pdserve serve` (as disagg_bench.py
does: a random llama-125m by default, float32, one deployment at a time on a quiet machine) and
the very same requests (the prompt lengths the server counted, the arrival times, the output
lengths) go through `pdserve simulate`'s simulation of the same deployment, built from the same
serve flags and the profile, with its step-time noise as `pdserve simulate` draws it
(`--step-noise-seed`, default 0; `--no-step-noise` for the fitted times). Reported: TTFT and TPOT p50 and p90, measured and simulated, and
the relative error of each (simulated / measured - 1); the simulator's speed (simulated requests
per second of wall time).

Workloads (`--workloads`), Poisson arrivals at `--rate` with `--seed`, lengths clipped:

  conv      azure_conv_2023.csv: prompts <= 1024, outputs <= 128
  code      azure_code_2023.csv: prompts <= 1024 (mostly long), outputs <= 32
  mooncake  mooncake_conversation.jsonl, lengths x `--mooncake-scale` (prompts share prefixes
            by their block hash ids, so the prefix cache matters), prompts <= 1024, outputs <= 128

Deployments (`--deployments`), all with `--linear-backend` (default auto, the engine's; the
profile must have been measured with the same):

  colocated-chunked  --cpus 0-1 --max-num-batched-tokens 256
  colocated-nochunk  --cpus 0-1 --no-chunked-prefill
  disagg-1p1d        --prefill-workers 1 --decode-workers 1 --prefill-cpus 0 --decode-cpus 1
  two-colocated      --decode-workers 2 --decode-cpus 0 --decode-cpus 1
                     --max-num-batched-tokens 2048 (not in the default set)

Each measured run waits for a quiet machine (no other benchmark, test or pdserve process) and
runs again when disturbed, as the other serving benchmarks do. With `--anchor`, a probe of a
few seconds (`pdserve profile --anchor`'s) runs in this process just before and just after each
measured run, and the same requests are simulated three ways: with the profile as measured, with
the profile anchored on the probe before the run (what a planner run at that moment would know),
and anchored on both probes (the machine's speed over the run). With `--speed-trace SECONDS`,
a speed trace (`pdserve profile --speed-trace`) is measured into the profile before the first
run, and the same requests are also simulated with the profile as measured, its decode-bound
steps along that trace (`planner/speed.py`); the output keeps the traced profile, which
`--profile` reads back from an output file. With `--run-trace INTERVAL`, a sensor process
(`lib/speed_sensor.py`) probes the machine's speed beside each measured run, every INTERVAL
seconds in the run's idle moments (on the CPUs of the deployment's decode-bound workers: both
for the colocated runs, CPU 1 for 1P+1D), and the same requests are also simulated with the
profile as measured, its decode-bound steps along that run's own trace, read in time: the step
model's error with the machine's speed over the run known, apart from the drift no profile taken
before the run can know. The sensor's probes take CPU from the run now and then (printed: how
much); compare such a run with one without (`--spread`). `--resimulate FILE` keeps a saved
run's measured side and simulates the same requests again with `--profile` (seconds, not half an
hour): how a change to the simulator or the profile moves its error against the same
measurements. `--spread FILE FILE...` compares the measured figures of runs of the same requests
with each other: how far one measured run lies from another is the floor under the simulator's
error; and each run's simulations against its own run and against the per-figure median of all
the runs (a measurement with less of one run's noise in it).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lib.machine import code_info, machine_info  # noqa: E402
from lib.paths import DEFAULT_125M, TRACE, ensure_125m  # noqa: E402
from lib.quiet import measured, wait_quiet  # noqa: E402
from lib.server import Server, send  # noqa: E402

from pdserve.bench.metrics import RequestRecord, latency_stats  # noqa: E402
from pdserve.bench.tokenizer import HFPromptTokenizer, load_tokenizer  # noqa: E402
from pdserve.bench.traces import read_trace  # noqa: E402
from pdserve.bench.workload import RequestSpec, WorkloadConfig, build_prompts, make_specs  # noqa: E402
from pdserve.cli import parse_args  # noqa: E402
from pdserve.commands.flags import from_args  # noqa: E402
from pdserve.commands.serve import disagg_config_from  # noqa: E402
from pdserve.config import EngineArgs, ModelConfig  # noqa: E402
from pdserve.planner.profile import Anchor, Profile  # noqa: E402
from pdserve.planner.scrape import Scrape, Window  # noqa: E402
from pdserve.planner.simulator import Simulation  # noqa: E402
from pdserve.planner.speed import SpeedTrace  # noqa: E402

TRACES = {
    "conv": (TRACE, 1.0, 1024, 128),
    "code": (TRACE.parent / "azure_code_2023.csv", 1.0, 1024, 32),
    "mooncake": (TRACE.parent / "mooncake_conversation.jsonl", None, 1024, 128),
}
# `--run-trace`: the sensor's worker size and CPUs per deployment (its decode-bound workers)
SENSORS = {
    "colocated-chunked": (2, "0,1"),
    "colocated-nochunk": (2, "0,1"),
    "disagg-1p1d": (1, "1"),
    "two-colocated": (1, "1"),
}
FIGURES = (("ttft_ms", "p50"), ("ttft_ms", "p90"), ("tpot_ms", "p50"), ("tpot_ms", "p90"))


def deployments(backend: str) -> dict[str, list[str]]:
    b = ["--linear-backend", backend]
    return {
        "colocated-chunked": [*b, "--cpus", "0-1", "--max-num-batched-tokens", "256"],
        "colocated-nochunk": [*b, "--cpus", "0-1", "--no-chunked-prefill"],
        "disagg-1p1d": [
            *b, "--prefill-workers", "1", "--decode-workers", "1",
            "--prefill-cpus", "0", "--decode-cpus", "1",
        ],
        "two-colocated": [
            *b, "--decode-workers", "2", "--decode-cpus", "0", "--decode-cpus", "1",
            "--max-num-batched-tokens", "2048",
        ],
    }  # fmt: skip


def workload(name: str, a, tok):
    path, scale, max_in, max_out = TRACES[name]
    scale = a.mooncake_scale if scale is None else scale
    wl = WorkloadConfig(
        num_requests=a.num_requests, length_scale=scale, max_input_len=max_in,
        max_output_len=max_out, request_rate=a.rate, seed=a.seed,
    )  # fmt: skip
    specs = make_specs(wl, read_trace(path))
    return specs, build_prompts(specs, tok, a.seed)


def simulate(serve_args: list[str], model: str, specs, records, profile: Profile,
             noise_seed: int | None, speed_trace: bool = False,
             speed_offset_s: float | None = None):  # fmt: skip
    """The simulated records of the same requests: prompt lengths as the server counted them,
    the measured run's send times; step-time noise drawn with `noise_seed` (None: none); with
    `speed_trace`, decode-bound steps along the profile's speed trace (seeded alike), read in
    time from `speed_offset_s` where given (a trace probed beside the run)."""
    _, args = parse_args(["serve", "--model", model, *serve_args])
    engine = from_args(EngineArgs, args)
    disagg = disagg_config_from(args)
    by_index = {r.index: r for r in records}
    same = []
    for s in specs:
        r = by_index[s.index]
        n = r.prompt_tokens or r.prompt_len
        same.append(RequestSpec(s.index, r.t_arrive, n, s.output_len, s.hash_ids))
    max_len = ModelConfig.from_pretrained(model).max_model_len
    t0 = time.perf_counter()
    sim = Simulation(
        profile, engine, disagg, max_model_len=max_len, local_client=True,
        step_noise=noise_seed is not None, speed_trace=speed_trace, seed=noise_seed or 0,
        speed_offset_s=speed_offset_s,
    )  # fmt: skip
    result = sim.run(same)
    wall = time.perf_counter() - t0
    return result.records, wall, simulated_steps(result.steps, sim.workers)


# `--anchor`: the probe before the run, and before and after; `--speed-trace`: the profile as
# measured with the trace taken before the runs; `--run-trace`: with the trace probed beside it
VARIANTS = ("before", "both", "trace", "beside")
TITLES = {
    "before": "the profile anchored on the probe before the run",
    "both": "the profile anchored on the probes before and after the run",
    "trace": "the profile as measured, decode-bound steps along its speed trace",
    "beside": "the profile as measured, decode-bound steps along the trace probed beside the run",
}


def beside_trace(sensor: dict) -> tuple[SpeedTrace, float] | None:
    """The trace a sensor probed beside a run (`entry["sensor"]`), and the run's start in
    seconds after its first probe; None where it kept fewer than two probes."""
    points = sensor["points"]
    if len(points) < 2:
        return None
    trace = SpeedTrace(tuple((t, r) for t, r in points))
    return trace, sensor["run_start"] - (sensor["start"] + points[0][0])


def anchor_variants(profile: Profile, probes: dict) -> dict[str, Profile]:
    """The profile anchored on the probe before the run, and on both probes' steps together
    (`probes`: the saved {"before": {size: Anchor dict}, "after": ...}), each measured against
    this profile's fitted models."""
    out = {}
    for name, which in (("before", ("before",)), ("both", ("before", "after"))):
        anchors = {}
        for size in profile.step_models:
            steps = [row for w in which for row in probes[w].get(str(size), {}).get("steps", [])]
            if steps:
                anchors[size] = Anchor.measure(profile.fitted_step_model(size), steps)
        out[name] = profile.anchored(anchors)
    return out


def simulate_variants(entry: dict, serve_args, model, specs, records, profile: Profile,
                      noise_seed: int | None) -> None:  # fmt: skip
    """Add to `entry` the simulation of its requests with each anchored profile, and along the
    profile's speed trace where it has one."""
    variants = anchor_variants(profile, entry["probes"]) if entry.get("probes") else {}
    if profile.speed:
        variants["trace"] = profile.anchored({})
    offsets = {}
    if entry.get("sensor") and (beside := beside_trace(entry["sensor"])):
        trace, offsets["beside"] = beside
        size = entry["sensor"]["size"]
        variants["beside"] = dataclasses.replace(profile.anchored({}), speed={size: trace})
    if not variants:
        return
    entry["variants"] = {}
    for name, anchored in variants.items():
        sim_records, _, sim_steps = simulate(
            serve_args, model, specs, records, anchored, noise_seed,
            speed_trace=name in ("trace", "beside"), speed_offset_s=offsets.get(name),
        )  # fmt: skip
        sim = figures(sim_records)
        entry["variants"][name] = {
            "simulated": sim,
            "error": compare(entry["measured"], sim),
            "steps": sim_steps,
            "anchors": {str(k): [a.decode, a.prefill] for k, a in anchored.anchors.items()},
        }


def step_phase(scheduled: list[tuple[str, int]], decoding: set[str]) -> str:
    """The engine's phase of a step (engine/stats.py): decode, prefill or mixed."""
    decodes = sum(rid in decoding for rid, _ in scheduled)
    if decodes == len(scheduled):
        return "decode"
    return "mixed" if decodes else "prefill"


def simulated_steps(steps, workers) -> dict:
    """Mean simulated step time per (role, phase). A one-token item decodes when the worker
    computed that request's prompt earlier in the step log, or received its KV (decode role)."""
    computed: dict[str, int] = {}
    sums: dict[str, list[float]] = {}
    role = {w.worker_id: str(w.role) for w in workers}
    for st in steps:
        received = role[st.worker_id] == "decode"  # its prompts' KV came from a prefill worker
        decoding = {
            rid for rid, n in st.scheduled
            if n == 1 and (received or computed.get((st.worker_id, rid)))
        }  # fmt: skip
        key = f"{role[st.worker_id]}/{step_phase(st.scheduled, decoding)}"
        sums.setdefault(key, []).append(st.duration_s)
        for rid, n in st.scheduled:
            computed[(st.worker_id, rid)] = computed.get((st.worker_id, rid), 0) + n
    return {k: {"mean_ms": 1e3 * sum(v) / len(v), "count": len(v)} for k, v in sorted(sums.items())}


def measured_steps(w: Window) -> dict:
    """Mean step time per (role, phase) in the server's workers, from its /metrics."""
    out = {}
    sums = w.increases("pdserve_step_time_seconds_sum")
    counts = w.increases("pdserve_step_time_seconds_count")
    for labels, total in sums.items():
        lab = dict(labels)
        n = counts.get(labels, 0)
        if n:
            key = f"{lab['role']}/{lab['phase']}"
            prev = out.get(key, {"sum": 0.0, "count": 0})
            out[key] = {"sum": prev["sum"] + total, "count": prev["count"] + n}
    return {k: {"mean_ms": 1e3 * v["sum"] / v["count"], "count": v["count"]}
            for k, v in sorted(out.items())}  # fmt: skip


def figures(records: list[RequestRecord]) -> dict:
    done = [r for r in records if r.status == "completed"]
    return {
        "ttft_ms": latency_stats(r.ttft for r in done),
        "tpot_ms": latency_stats(r.tpot for r in done),
        "completed": len(done),
    }


def compare(measured_f: dict, sim_f: dict) -> dict:
    out = {}
    for metric, p in FIGURES:
        m, s = measured_f[metric][p], sim_f[metric][p]
        out[f"{metric}_{p}"] = None if not m or s is None else s / m - 1
    return out


def print_table(entries: list[dict]) -> None:
    _print_table(entries)
    for name in VARIANTS:
        chosen = [
            {**e, **e["variants"][name], "steps": {**e["steps"], "simulated": e["variants"][name]["steps"]}}
            for e in entries if name in e.get("variants", {})
        ]  # fmt: skip
        if chosen and name in ("trace", "beside"):
            print(f"\n== {TITLES[name]} ==")
            for e in chosen if name == "beside" else ():
                sn = e["sensor"]
                print(f"  {e['workload']} x {e['deployment']}: {sn['kept']} probes kept "
                      f"({sn['dropped']} dropped, {sn['skipped']} skipped), their CPU "
                      f"{100 * sn['probe_cpu_s'] / sn['seconds']:.1f}% of one core")  # fmt: skip
            _print_table(chosen)
        elif chosen:
            print(f"\n== {TITLES[name]} ==")
            for e in chosen:
                cells = ", ".join(f"{k} t: x{d:.2f} decode, x{p:.2f} prompt"
                                  for k, (d, p) in e["anchors"].items())  # fmt: skip
                print(f"  {e['workload']} x {e['deployment']}: {cells}")
            _print_table(chosen)


def _print_table(entries: list[dict]) -> None:
    print("\n| workload | deployment | " + " | ".join(f"{m} {p}" for m, p in FIGURES) + " |")
    print("| --- | --- |" + " --- |" * len(FIGURES))
    for e in entries:
        cells = []
        for metric, p in FIGURES:
            m, s = e["measured"][metric][p], e["simulated"][metric][p]
            err = e["error"][f"{metric}_{p}"]
            cells.append(f"{m:.0f} / {s:.0f} ({err:+.0%})" if err is not None else "-")
        print(f"| {e['workload']} | {e['deployment']} | " + " | ".join(cells) + " |")
    print("\nmean step time per role/phase, ms: measured in the server / simulated (count)")
    for e in entries:
        steps = e.get("steps")
        if not steps:
            continue
        cells = []
        for key, m in steps["measured"].items():
            sim = steps["simulated"].get(key)
            sim_ms = f"{sim['mean_ms']:.1f}" if sim else "-"
            cells.append(f"{key} {m['mean_ms']:.1f} / {sim_ms} ({m['count']})")
        print(f"  {e['workload']} x {e['deployment']}: " + ", ".join(cells))
    errs = [abs(v) for e in entries for v in e["error"].values() if v is not None]
    if errs:
        within = sum(v <= 0.15 for v in errs) / len(errs)
        print(
            f"\n(measured / simulated ms (error)). |error| median {sorted(errs)[len(errs) // 2]:.0%}, "
            f"max {max(errs):.0%}; {within:.0%} of the figures within 15%"
        )
    speed = [e["sim_requests_per_s"] for e in entries]
    print(f"simulator speed: {min(speed):.0f}-{max(speed):.0f} simulated requests / s of wall time")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--profile", help="profile JSON (pdserve profile) of the same engine settings")
    p.add_argument("--model", help=f"model folder (default: random llama-125m in {DEFAULT_125M})")
    p.add_argument("--workloads", default="conv,code,mooncake")
    p.add_argument("--deployments", default="colocated-chunked,colocated-nochunk,disagg-1p1d")
    p.add_argument("--num-requests", type=int, default=40)
    p.add_argument("--rate", type=float, default=0.25, help="req/s (default 0.25)")
    p.add_argument("--mooncake-scale", type=float, default=0.05, help="length scale (0.05)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--linear-backend", default="auto")
    p.add_argument("--attempts", type=int, default=2)
    p.add_argument("--anchor", action="store_true",
                   help="probe the machine's speed before and after each run (see above)")  # fmt: skip
    p.add_argument("--speed-trace", type=float, default=0.0, metavar="SECONDS",
                   help="measure a speed trace of this many seconds before the first run and "
                   "simulate along it too (see above)")  # fmt: skip
    p.add_argument("--run-trace", type=float, default=0.0, metavar="INTERVAL",
                   help="probe the machine's speed beside each run every INTERVAL seconds and "
                   "simulate along that trace too (see above)")  # fmt: skip
    p.add_argument("--step-noise", action=argparse.BooleanOptionalAction, default=True,
                   help="simulate with step-time noise drawn from the profile's scatter "
                   "(pdserve simulate's default; --no-step-noise: the fitted times)")  # fmt: skip
    p.add_argument("--step-noise-seed", type=int, default=0, metavar="N")
    p.add_argument("--output", help="write everything (per-request records too) as JSON")
    p.add_argument("--reanalyze", metavar="FILE", help="print the table of a saved --output")
    p.add_argument("--resimulate", metavar="FILE",
                   help="simulate a saved --output's requests again with --profile")  # fmt: skip
    p.add_argument("--spread", metavar="FILE", nargs="+",
                   help="compare the measured figures of saved runs of the same requests")  # fmt: skip
    a = p.parse_args()
    if a.spread:
        spread(a.spread)
        return
    if a.reanalyze:
        print_table(json.loads(Path(a.reanalyze).read_text())["entries"])
        return
    if not a.profile:
        p.error("--profile is required (pdserve profile --model DIR --output FILE)")
    saved = json.loads(Path(a.profile).read_text())
    profile = Profile.from_dict(saved["profile"] if "entries" in saved else saved)
    noise = a.step_noise_seed if a.step_noise else None
    if a.resimulate:
        resimulate(a, profile)
        return
    model = a.model or ensure_125m(DEFAULT_125M)
    tok = HFPromptTokenizer(load_tokenizer(model))
    workdir = Path(tempfile.mkdtemp(prefix="sim_accuracy-"))
    print(f"logs in {workdir}\nprofile: {profile.description}")
    deps = deployments(a.linear_backend)
    engine = profile_engine(model, a.linear_backend) if a.anchor or a.speed_trace else None
    if a.speed_trace:
        from pdserve.perf.step_profile import measure_speed

        log = lambda m: print(f"  speed trace: {m}", flush=True)  # noqa: E731
        wait_quiet()
        speed = measure_speed(engine, profile, a.speed_trace, log=log, cores=PROBE_CORES)
        profile = dataclasses.replace(profile, speed=speed)
    entries = []
    for wname in a.workloads.split(","):
        specs, prompts = workload(wname, a, tok)
        for dname in a.deployments.split(","):
            serve_args = ["--model", model, *deps[dname]]
            print(f"\n== {wname} x {dname} ==", flush=True)
            tag = f"{wname}-{dname}"

            def run(serve_args=serve_args, tag=tag, dname=dname, prompts=prompts):
                probes = {"before": probe(engine, profile)} if a.anchor else {}
                sensor = (
                    Sensor(a, model, dname, workdir / f"{tag}-sensor.json") if a.run_trace else None
                )
                with (
                    sensor or contextlib.nullcontext(),
                    Server(serve_args, workdir / f"{tag}.log") as srv,
                ):
                    before = Scrape.parse(srv.metrics(), time.monotonic())
                    run_start = time.monotonic()  # the client's clock starts a request later
                    records = send(prompts, srv.base_url, model)
                    after = Scrape.parse(srv.metrics(), time.monotonic())
                if a.anchor:
                    probes["after"] = probe(engine, profile)
                beside = sensor and {**sensor.result, "run_start": run_start}
                return records, measured_steps(Window([before, after])), probes, beside

            (records, server_steps, probes, beside), meta = measured(run, tag, a.attempts)
            sim_records, wall, sim_steps = simulate(
                deps[dname], model, specs, records, profile, noise
            )
            entry = {
                "workload": wname,
                "deployment": dname,
                "serve": serve_args,
                "meta": meta,
                "measured": figures(records),
                "simulated": figures(sim_records),
                # mean step time per phase: in the server's workers, and in the simulation
                "steps": {"measured": server_steps, "simulated": sim_steps},
                "sim_wall_s": wall,
                "sim_requests_per_s": len(specs) / wall if wall else None,
                "records": [r.to_dict() for r in records],
                "sim_records": [r.to_dict() for r in sim_records],
                "probes": probes,
                "sensor": beside,
            }
            entry["error"] = compare(entry["measured"], entry["simulated"])
            simulate_variants(entry, deps[dname], model, specs, records, profile, noise)
            entries.append(entry)
            print_table([entry])
    print_table(entries)
    if a.output:
        res = {
            "machine": machine_info(),
            "code": code_info(),
            "args": vars(a),
            "profile": profile.to_dict(),
            "entries": entries,
        }
        Path(a.output).write_text(json.dumps(res, indent=1))
        print(f"wrote {a.output}")


def profile_engine(model: str, backend: str):
    """The engine `pdserve profile --model MODEL --linear-backend BACKEND` measures."""
    from pdserve.commands.engine_args import engine_args_from

    _, args = parse_args(
        ["profile", "--model", model, "--linear-backend", backend, "--output", "-"]
    )
    return engine_args_from(args)


class Sensor:
    """`lib/speed_sensor.py` beside a run: started (and waited for until it probes) on entry,
    stopped on exit; `result` holds its probes (`beside_trace` reads them)."""

    def __init__(self, a, model: str, deployment: str, output: Path) -> None:
        size, cpus = SENSORS[deployment]
        self.output, self.result = output, None
        self.cmd = [
            sys.executable, str(Path(__file__).parent / "lib" / "speed_sensor.py"),
            "--profile", a.profile, "--model", model, "--linear-backend", a.linear_backend,
            "--size", str(size), "--cpus", cpus, "--interval", str(a.run_trace),
            "--output", str(output),
        ]  # fmt: skip

    def __enter__(self) -> Sensor:
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, text=True)
        if self.proc.stdout.readline().strip() != "ready":
            self.proc.kill()
            raise RuntimeError(f"the speed sensor did not start: {' '.join(self.cmd)}")
        return self

    def __exit__(self, *exc) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise
        self.result = json.loads(self.output.read_text())


PROBE_CORES: dict = {}  # `probe`'s engines, built once and probed before and after every run


def probe(engine, profile: Profile) -> dict:
    """This machine's speed of the moment against the profile (`pdserve profile --anchor`)."""
    from pdserve.perf.step_profile import measure_anchors

    log = lambda m: print(f"  probe: {m}", flush=True)  # noqa: E731
    anchors = measure_anchors(engine, profile, log, cores=PROBE_CORES)
    return {str(k): dataclasses.asdict(v) for k, v in anchors.items()}


def spread(paths: list[str]) -> None:
    """The same requests measured in several saved runs (the same workload arguments): each
    figure in each run, and how far one run's figure lies from another's, as if the first were
    a simulation of the second: the floor under any simulator's error on this machine."""
    runs = [json.loads(Path(f).read_text()) for f in paths]
    keys = ("num_requests", "rate", "seed", "mooncake_scale", "workloads")
    if any({k: r["args"].get(k) for k in keys} != {k: runs[0]["args"].get(k) for k in keys}
           for r in runs):  # fmt: skip
        raise SystemExit("--spread: the runs were not of the same requests (arguments differ)")
    by_run = [{(e["workload"], e["deployment"]): e["measured"] for e in r["entries"]} for r in runs]
    common = [k for k in by_run[0] if all(k in b for b in by_run)]
    print("\n| workload | deployment | " + " | ".join(f"{m} {p}" for m, p in FIGURES) + " |")
    print("| --- | --- |" + " --- |" * len(FIGURES))
    gaps = []
    for key in common:
        cells = []
        for metric, pct in FIGURES:
            values = [b[key][metric][pct] for b in by_run]
            cells.append(" / ".join(f"{v:.0f}" for v in values))
            gaps += [abs(x / y - 1) for i, x in enumerate(values) for y in values[i + 1 :]]
        print(f"| {key[0]} | {key[1]} | " + " | ".join(cells) + " |")
    gaps.sort()
    print(
        f"\nbetween two runs of the same requests ({len(runs)} runs, {len(gaps)} pairs of "
        f"figures): |difference| median {gaps[len(gaps) // 2]:.0%}, max {gaps[-1]:.0%}; "
        f"{sum(g <= 0.15 for g in gaps) / len(gaps):.0%} within 15%"
    )
    median_measured: dict = {}
    for key in common:
        for m, p in FIGURES:
            median = statistics.median(b[key][m][p] for b in by_run)
            median_measured.setdefault(key, {}).setdefault(m, {})[p] = median
    print("\neach run's simulations against its own measured run, and against the median of "
          "the measured runs:")  # fmt: skip
    for path, run in zip(paths, runs):
        for name, pick in (("as profiled", lambda e: e),
                           *((TITLES[v], lambda e, v=v: e.get("variants", {}).get(v))
                             for v in VARIANTS)):  # fmt: skip
            own, pooled = [], []
            for e in run["entries"]:
                sim = pick(e)
                key = (e["workload"], e["deployment"])
                if not sim or key not in median_measured:
                    continue
                own += compare(e["measured"], sim["simulated"]).values()
                pooled += compare(median_measured[key], sim["simulated"]).values()
            if own:
                print(f"  {path} {name}: own run {_errors(own)}; median of runs {_errors(pooled)}")


def _errors(errs: list) -> str:
    """A summary of relative errors; None (a figure measured as zero) is left out."""
    errs = sorted(abs(e) for e in errs if e is not None)
    within = sum(e <= 0.15 for e in errs)
    return (f"|error| median {errs[len(errs) // 2]:.0%}, max {errs[-1]:.0%}, "
            f"{within} of {len(errs)} within 15%")  # fmt: skip


def resimulate(a, profile: Profile) -> None:
    """A saved run's measured records against a new simulation of the same requests."""
    saved = json.loads(Path(a.resimulate).read_text())
    noise = a.step_noise_seed if a.step_noise else None
    args = argparse.Namespace(**saved["args"])
    model = args.model or ensure_125m(DEFAULT_125M)
    tok = HFPromptTokenizer(load_tokenizer(model))
    entries = []
    for e in saved["entries"]:
        if e.get("error") is None or not e.get("records"):
            continue
        specs, _ = workload(e["workload"], args, tok)
        records = [RequestRecord.from_dict(r) for r in e["records"]]
        sim_records, wall, sim_steps = simulate(
            e["serve"][2:], model, specs, records, profile, noise
        )
        entry = {**e, "simulated": figures(sim_records), "sim_wall_s": wall,
                 "sim_requests_per_s": len(specs) / wall if wall else None,
                 "steps": {**e.get("steps", {}), "simulated": sim_steps},
                 "sim_records": [r.to_dict() for r in sim_records]}  # fmt: skip
        entry["error"] = compare(entry["measured"], entry["simulated"])
        simulate_variants(entry, e["serve"][2:], model, specs, records, profile, noise)
        entries.append(entry)
    print_table(entries)
    if a.output:
        res = {**saved, "profile": profile.to_dict(), "entries": entries,
               "resimulated": {"from": a.resimulate, "code": code_info()}}  # fmt: skip
        Path(a.output).write_text(json.dumps(res, indent=1))
        print(f"wrote {a.output}")


if __name__ == "__main__":
    main()
