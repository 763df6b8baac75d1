"""How long an engine and a server take to start, for one or two checkouts in fresh processes.

    python benchmarks/startup_bench.py [--other CHECKOUT] [--rounds 5]     # ~30 s per round

Per round and checkout, two fresh processes:
- **engine**: `import pdserve`, then `LLM(model)` (config, tokenizer, weights, native kernels
  loaded from their cache, warm-up forward); the seconds of each and whether the start imported
  `torch._dynamo` (which nothing on the serving path needs).
- **server**: `pdserve serve --model MODEL` (one colocated worker) until `/health` answers 200.
With `--other`, the two checkouts alternate (which goes first alternates too), so a shared
machine's swings fall on both. The default model is the tiny stories260K: what is measured is
the fixed cost of a start, which a bigger model only adds its weights' load to.
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
sys.path.insert(1, str(HERE))

from lib import checkouts  # noqa: E402
from lib.paths import STORIES  # noqa: E402


def child(checkout: str, model: str) -> None:
    """Runs in a fresh process with `checkout` first on the path; prints one JSON line."""
    sys.path.insert(0, checkout)
    t0 = time.perf_counter()
    from pdserve import LLM

    t1 = time.perf_counter()
    LLM(model)
    t2 = time.perf_counter()
    print(json.dumps({"import_s": t1 - t0, "engine_s": t2 - t1,
                      "dynamo": "torch._dynamo" in sys.modules}))  # fmt: skip


def server_start(checkout: str, model: str) -> float:
    """Seconds from launching `pdserve serve` to its first 200 from /health."""
    from lib.server import Server

    env = {"PYTHONPATH": checkout + os.pathsep + os.environ.get("PYTHONPATH", "")}
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        with Server(["--model", model], Path(tmp) / "server.log",
                    prefix=[sys.executable, "-m"], env=env):  # fmt: skip
            return time.perf_counter() - t0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    checkouts.add_arguments(p, rounds=5, model_dir=STORIES)
    args = p.parse_args()
    model = str(args.model_dir.resolve())
    if args.child:
        child(args.child, model)
        return 0
    runs: dict[str, list[dict]] = {c: [] for c in checkouts.checkouts(args.other)}
    checkouts.run_child(__file__, list(runs)[0], model)  # the kernels' build, the page cache
    for r, c in checkouts.alternated(list(runs), args.rounds):
        res = checkouts.run_child(__file__, c, model) | {"server_s": server_start(c, model)}
        runs[c].append(res)
        print(f"round {r} {c}: import {res['import_s']:.2f} s, LLM() {res['engine_s']:.2f} s"
              f" (torch._dynamo imported: {res['dynamo']}), server {res['server_s']:.2f} s",
              flush=True)  # fmt: skip
    print("\nmedian (range) over rounds:")
    print("| checkout | import pdserve s | LLM() s | pdserve serve to /health s |")
    print("| --- | --- | --- | --- |")
    for c, rs in runs.items():
        cells = []
        for key in ("import_s", "engine_s", "server_s"):
            xs = [x[key] for x in rs]
            cells.append(f"{statistics.median(xs):.2f} ({min(xs):.2f}-{max(xs):.2f})")
        print(f"| {c} | " + " | ".join(cells) + " |")
    if args.output:
        args.output.write_text(json.dumps(runs, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
