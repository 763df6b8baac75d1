"""The garbage collector's pauses in a served deployment under load, two checkouts alternated.

    git worktree add /tmp/old REV
    python benchmarks/gc_bench.py --other /tmp/old      # ~4 min (3 rounds x 2 checkouts)

Starts `pdserve serve` from each checkout in turn (its pdserve first on PYTHONPATH, so the
frontend and the workers run that checkout's code) with a probe loaded into every process of
the deployment (a `sitecustomize` that times each collection through `gc.callbacks`), sends
the same closed-loop load from this process (`--num-requests` prompts of `--input-len` tokens,
`--output-len` outputs, `--concurrency` at once; this checkout's client, its heap frozen as
`pdserve bench` freezes it), and reports per run the load's throughput and latency tails and,
per process, the collections that ran during the load: the full (generation 2) ones, how many,
their total and longest pause, and the young ones (generations 0 and 1) of 0.5 ms or more. The default model is the tiny stories260K: its steps are short, so
the frontend does the most work per second and makes the most garbage.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))  # this checkout's pdserve

from lib.paths import ROOT, STORIES  # noqa: E402
from lib.server import Server, prompts_for, send  # noqa: E402

from pdserve.bench.metrics import summarize  # noqa: E402

PROBE = """
import gc, json, os, sys, time
_out = open(os.path.join(os.environ["GC_PROBE_DIR"], f"{os.getpid()}.jsonl"), "a", buffering=1)
_out.write(json.dumps({"argv": sys.argv[:3]}) + "\\n")
_start = [0.0]
def _probe(phase, info):
    if phase == "start":
        _start[0] = time.perf_counter()
    else:
        ms = (time.perf_counter() - _start[0]) * 1e3
        if info["generation"] == 2 or ms >= 0.5:
            _out.write(json.dumps({"t": time.time(), "g": info["generation"], "ms": ms}) + "\\n")
gc.callbacks.append(_probe)
"""


def process_name(argv: list[str]) -> str:
    """A probed process' kind from its first arguments (a `-m` module's name is not among them
    yet when `sitecustomize` runs)."""
    if "--engine-args" in argv:
        return "worker"
    return "frontend" if "serve" in argv else "other"


def pauses(probe_dir: Path, t0: float, t1: float) -> dict[str, dict[str, list[float]]]:
    """Collection pauses (ms) between t0 and t1 per process kind: "full" (generation 2, every
    one) and "young" (generations 0 and 1, those of 0.5 ms or more)."""
    out: dict[str, dict[str, list[float]]] = {}
    for path in probe_dir.glob("*.jsonl"):
        lines = [json.loads(x) for x in path.read_text().splitlines()]
        mine = out.setdefault(process_name(lines[0]["argv"]), {"full": [], "young": []})
        for x in lines[1:]:
            if t0 <= x["t"] <= t1:
                mine["full" if x["g"] == 2 else "young"].append(x["ms"])
        path.unlink()
    return out


def one_run(checkout: str, args, prompts, workdir: Path) -> dict:
    probe_dir = workdir / "probe"
    probe_dir.mkdir(exist_ok=True)
    (probe_dir / "sitecustomize.py").write_text(PROBE)
    env = {"PYTHONPATH": f"{checkout}{os.pathsep}{probe_dir}", "GC_PROBE_DIR": str(probe_dir)}
    with Server(["--model", args.model], workdir / "serve.log", env=env) as srv:
        t0 = time.time()
        records = send(prompts, srv.base_url, args.model, args.concurrency)  # heap frozen
        t1 = time.time()
    s = summarize(records)
    gaps = sorted(g for r in records for g in r.itl)
    return {
        "req_per_s": s["request_throughput"],
        "ttft_p50_ms": s["ttft_ms"]["p50"],
        "ttft_p99_ms": s["ttft_ms"]["p99"],
        "itl_p99_ms": s["itl_ms"]["p99"],
        "itl_max_ms": gaps[-1] * 1e3 if gaps else None,
        "completed": s["completed"],
        "gc": pauses(probe_dir, t0, t1),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--other", help="another checkout to alternate with (e.g. a git worktree)")
    p.add_argument("--model", default=str(STORIES))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--num-requests", type=int, default=3000)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--output", help="write the runs as JSON")
    a = p.parse_args()
    checkouts = {"this": str(ROOT)}
    if a.other:
        checkouts["other"] = str(Path(a.other).resolve())
    prompts = prompts_for(a.model, a.num_requests, a.input_len, a.output_len)
    workdir = Path(tempfile.mkdtemp(prefix="gc_bench-"))
    runs = []
    for rnd in range(a.rounds):
        order = list(checkouts.items())
        for name, path in order if rnd % 2 == 0 else order[::-1]:
            r = {"checkout": name, "round": rnd, **one_run(path, a, prompts, workdir)}
            runs.append(r)
            gc_text = "; ".join(
                f"{proc}: {len(g['full'])} full collections {sum(g['full']):.0f} ms "
                f"(longest {max(g['full'], default=0):.0f}), young {sum(g['young']):.0f} ms "
                f"(longest {max(g['young'], default=0):.0f})"
                for proc, g in sorted(r["gc"].items())
            )
            print(
                f"round {rnd} {name:5s}: {r['req_per_s']:6.1f} req/s, TTFT p50/p99 "
                f"{r['ttft_p50_ms']:.0f}/{r['ttft_p99_ms']:.0f} ms, ITL p99/max "
                f"{r['itl_p99_ms']:.0f}/{r['itl_max_ms']:.0f} ms | {gc_text}",
                flush=True,
            )
    for name in checkouts:
        mine = [r for r in runs if r["checkout"] == name]
        med = {k: statistics.median(r[k] for r in mine) for k in ("req_per_s", "ttft_p99_ms")}
        fe = [sum(r["gc"].get("frontend", {}).get("full", [])) for r in mine]
        print(
            f"{name}: median {med['req_per_s']:.1f} req/s, TTFT p99 {med['ttft_p99_ms']:.0f} ms, "
            f"frontend full-collection time per run {statistics.median(fe):.0f} ms"
        )
    if a.output:
        Path(a.output).write_text(json.dumps({"args": vars(a), "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
