"""Default thread placement against the best manual setting, on an idle and on a busy machine.

    python benchmarks/threads_bench.py [--models DIR,DIR] [--output FILE]

"Busy" is one `while True: pass` process (unpinned, as another user's job would be) running the
whole time. For each model and machine state, each setting runs in a fresh process, like a user,
twice, the settings taking turns; the better run counts:

1. `pdserve generate` (200 greedy tokens, `ignore_eos`): decode tokens/s, settings
   default | --num-threads 1 | --num-threads 2.
2. `pdserve serve` colocated on stories260K: median TPOT of 5 sequential 100-token requests,
   settings default | --num-threads 1 | --num-threads 2.
3. `pdserve serve` with 1 prefill + 1 decode worker: the same TPOT, settings default (unpinned)
   | --prefill-cpus 0 --decode-cpus 1 | --prefill-cpus 1 --decode-cpus 0.

Reports each figure and, per case, the default's ratio to the best manual setting (target: the
default within 1.5x of the best in both states).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "e2e"))
from server_harness import start_server  # noqa: E402

STORIES = ROOT.parent / "shared" / "models" / "stories260K"
DEFAULT_125M = Path("/tmp/pdbench/llama-125m")


def generate_tps(model: str, *extra: str) -> float:
    cmd = [sys.executable, "-m", "pdserve.cli", "generate", "--model", model,
           "--prompt", "Once upon a time", "--max-tokens", "200", "--ignore-eos", "--json",
           *extra]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return json.loads(out)["summary"]["decode_tokens_per_s"]


def served_tpot_ms(model: str, *extra: str) -> float:
    server = start_server(model, *extra, timeout_s=300)
    try:
        tpots = []
        for _ in range(6):
            r = httpx.post(
                server.url + "/v1/completions",
                json={"prompt": "Once upon a time", "max_tokens": 100, "ignore_eos": True},
                timeout=600,
            )
            r.raise_for_status()
            tpots.append(r.json()["timings"]["tpot_ms"])
        return statistics.median(tpots[1:])  # the first one warms up
    finally:
        server.stop()


DISAGG = ("--prefill-workers", "1", "--decode-workers", "1")
CASES = {
    "generate": (
        generate_tps,
        "decode tokens/s",
        True,
        {"default": (), "threads=1": ("--num-threads", "1"), "threads=2": ("--num-threads", "2")},
    ),
    "serve colocated": (
        served_tpot_ms,
        "TPOT ms",
        False,
        {"default": (), "threads=1": ("--num-threads", "1"), "threads=2": ("--num-threads", "2")},
    ),
    "serve 1P+1D": (
        served_tpot_ms,
        "TPOT ms",
        False,
        {
            "default": DISAGG,
            "P:cpu0 D:cpu1": (*DISAGG, "--prefill-cpus", "0", "--decode-cpus", "1"),
            "P:cpu1 D:cpu0": (*DISAGG, "--prefill-cpus", "1", "--decode-cpus", "0"),
        },
    ),
}


ROUNDS = 2  # every setting runs once per round, in turn; the best run counts


def run_case(name: str, model: str) -> dict:
    fn, unit, higher_is_better, settings = CASES[name]
    best = max if higher_is_better else min
    runs: dict[str, list[float]] = {label: [] for label in settings}
    for _ in range(ROUNDS):  # interleaved: a slow first start does not land on one setting
        for label, args in settings.items():
            runs[label].append(fn(model, *args))
    values = {label: round(best(xs), 2) for label, xs in runs.items()}
    manual = {k: v for k, v in values.items() if k != "default"}
    best_label = best(manual, key=manual.get)
    top = manual[best_label]
    ratio = top / values["default"] if higher_is_better else values["default"] / top
    return {"unit": unit, "values": values, "runs": runs, "best_manual": best_label,
            "default_vs_best": round(ratio, 2)}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=f"{STORIES},{DEFAULT_125M}")
    p.add_argument(
        "--states", default="idle,busy", help="machine states to measure, comma-separated"
    )
    p.add_argument("--cases", default=",".join(CASES),
                   help="cases for the first model; the others run 'generate' only")  # fmt: skip
    p.add_argument("--output")
    a = p.parse_args()
    models = a.models.split(",")
    if not Path(models[-1]).is_dir() and Path(models[-1]) == DEFAULT_125M:
        subprocess.run([sys.executable, "-m", "pdserve.cli", "make-model", "--preset",
                        "llama-125m", str(DEFAULT_125M)], check=True)  # fmt: skip
    results = []
    for state in a.states.split(","):
        busy = None
        if state == "busy":
            busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
            time.sleep(1.0)
        try:
            for model in models:
                names = ["generate"] if model != models[0] else a.cases.split(",")
                for name in names:
                    r = {"state": state, "model": Path(model).name, "case": name,
                         **run_case(name, model)}  # fmt: skip
                    print(json.dumps(r), flush=True)
                    results.append(r)
        finally:
            if busy is not None:
                busy.kill()
    if a.output:
        Path(a.output).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
