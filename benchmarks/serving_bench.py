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
import json
import sys
import tempfile
from pathlib import Path

from lib.machine import code_info, machine_info
from lib.paths import DEFAULT_125M, STORIES, ensure_125m
from lib.serving_ceiling import ceiling_part
from lib.serving_latency import latency_part, offline_main


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
