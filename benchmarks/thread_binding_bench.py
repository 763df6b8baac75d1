"""Short prompt steps after an idle stretch, served, with and without the step's thread binding.

    git worktree add /tmp/base REV      # a checkout without `engine/thread_binding.py`
    python benchmarks/thread_binding_bench.py --baseline /tmp/base [--rounds 4] [--requests 20]

A conversation's next turn reaches an idle server and computes a few tokens over its cached
context. Each round starts `pdserve serve` (llama-125m, float32, colocated on all allowed CPUs,
chunks of 256) from this checkout and from the baseline in turn (`PYTHONPATH`), and sends
`--requests` requests one at a time, each after 0.3 s idle: 14-token prompts, alternately fresh
and after a 352-token prompt sent just before (a prefix hit). For each: the worker's step time
(its /metrics histogram), the client's TTFT, and how long the worker's threads waited on a run
queue meanwhile (`/proc/PID/task/*/schedstat`: two compute threads on one CPU take turns).
Reported per checkout: medians and p90s, the share of requests whose threads waited more than
5 ms, and this checkout's medians over the baseline's from the same rounds. Then, on the same
server, a decode load (`--load` requests of 128 prompt and 64 output tokens, 4 at a time): its
TPOT p50 and output tokens/s, the steps that bind their threads on the busy path.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from lib.machine import code_info, machine_info  # noqa: E402
from lib.paths import DEFAULT_125M, ensure_125m  # noqa: E402
from lib.procstat import run_queue_wait  # noqa: E402
from lib.quiet import wait_quiet  # noqa: E402
from lib.server import Server, first_token_s, prompt_steps, prompts_for, send  # noqa: E402

from pdserve.bench.metrics import latency_stats  # noqa: E402

PROMPT, CONTEXT, IDLE_S, WAITED_S = 14, 352, 0.3, 0.005


def serve_round(
    checkout: Path, model: str, requests: int, load: list, rng: random.Random, log: Path
) -> tuple[list[dict], dict]:
    env = {"PYTHONPATH": str(checkout)}
    args = ["--model", model, "--max-num-batched-tokens", "256"]
    out = []
    with Server(args, log, env=env) as srv, httpx.Client(timeout=60, trust_env=False) as client:
        (worker,) = srv.workers.values()
        token = lambda: rng.randrange(100, 30000)  # noqa: E731  (llama-125m: 32,000)
        first_token_s(client, srv.base_url, model, [token() for _ in range(64)])  # warm
        for i in range(requests):
            prefix = []
            if i % 2:  # a prefix hit: the context computed just before
                prefix = [token() for _ in range(CONTEXT)]
                first_token_s(client, srv.base_url, model, prefix)
            time.sleep(IDLE_S)
            s0, n0 = prompt_steps(srv)
            w0 = run_queue_wait(worker)
            ttft = first_token_s(
                client, srv.base_url, model, prefix + [token() for _ in range(PROMPT)]
            )
            w1 = run_queue_wait(worker)
            s1, n1 = prompt_steps(srv)
            if n1 > n0:
                out.append({"hit": bool(prefix), "step_s": (s1 - s0) / (n1 - n0),
                            "ttft_s": ttft, "waited_s": w1 - w0})  # fmt: skip
        t0 = time.perf_counter()
        done = [r for r in send(load, srv.base_url, model, 4) if r.status == "completed"]
        wall = time.perf_counter() - t0
    decode = {"tpot_ms_p50": latency_stats(r.tpot for r in done)["p50"],
              "tokens_per_s": sum(r.num_output_tokens for r in done) / wall}  # fmt: skip
    return out, decode


def summary(rows: list[dict]) -> dict:
    def q(key, p):
        xs = sorted(r[key] for r in rows)
        return 1e3 * xs[min(len(xs) - 1, int(p * len(xs)))]

    return {
        "requests": len(rows),
        "step_ms_p50": 1e3 * statistics.median(r["step_s"] for r in rows),
        "step_ms_p90": q("step_s", 0.9),
        "ttft_ms_p50": 1e3 * statistics.median(r["ttft_s"] for r in rows),
        "ttft_ms_p90": q("ttft_s", 0.9),
        "waited_share": sum(r["waited_s"] > WAITED_S for r in rows) / len(rows),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", required=True, type=Path, help="a checkout to compare with")
    p.add_argument("--model", default=None, help=f"model folder (default {DEFAULT_125M})")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--requests", type=int, default=20, help="per server start")
    p.add_argument("--load", type=int, default=16, help="decode-load requests per server start")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", type=Path)
    a = p.parse_args()
    model = a.model or ensure_125m(DEFAULT_125M)
    checkouts = {"baseline": a.baseline.resolve(), "this": HERE.parent}
    rng = random.Random(a.seed)
    rows: dict[str, list[dict]] = {k: [] for k in checkouts}
    loads: dict[str, list[dict]] = {k: [] for k in checkouts}
    load = prompts_for(model, a.load, 128, 64, a.seed)
    logs = Path(os.environ.get("TMPDIR", "/tmp")) / "thread_binding_bench"
    logs.mkdir(exist_ok=True)
    for r in range(a.rounds):
        for name, checkout in checkouts.items():
            wait_quiet()
            got, decode = serve_round(checkout, model, a.requests, load, rng, logs / f"{name}.log")
            rows[name] += got
            loads[name].append(decode)
            s = summary(rows[name])
            print(f"round {r + 1} {name}: step {s['step_ms_p50']:.1f} ms p50, "
                  f"TTFT {s['ttft_ms_p50']:.1f} ms p50, waited {s['waited_share']:.0%}; load TPOT "
                  f"{decode['tpot_ms_p50']:.1f} ms p50, {decode['tokens_per_s']:.1f} tokens/s",
                  flush=True)  # fmt: skip
    result = {"machine": machine_info(), "code": code_info(), "args": vars(a) | {"model": model},
              "baseline": summary(rows["baseline"]), "this": summary(rows["this"]), "rows": rows,
              "loads": loads}  # fmt: skip
    for part in ("hit", "fresh"):
        for name in checkouts:
            sub = [x for x in rows[name] if x["hit"] == (part == "hit")]
            if sub:
                result[f"{name}_{part}"] = summary(sub)
    b, t = result["baseline"], result["this"]
    print(
        f"{'':10s} {'step p50':>9s} {'step p90':>9s} {'TTFT p50':>9s} {'TTFT p90':>9s} waited>5ms"
    )
    for name in checkouts:
        s = result[name]
        print(f"{name:10s} {s['step_ms_p50']:9.1f} {s['step_ms_p90']:9.1f} {s['ttft_ms_p50']:9.1f} "
              f"{s['ttft_ms_p90']:9.1f} {s['waited_share']:9.0%}")  # fmt: skip
    med = {n: {k: statistics.median(x[k] for x in loads[n]) for k in loads[n][0]} for n in loads}
    result["load_median"] = med
    for name in checkouts:
        print(f"{name:10s} load: TPOT p50 {med[name]['tpot_ms_p50']:.1f} ms, "
              f"{med[name]['tokens_per_s']:.1f} tokens/s (median of the rounds)")  # fmt: skip
    print(f"this / baseline: step p50 x{t['step_ms_p50'] / b['step_ms_p50']:.2f}, "
          f"TTFT p50 x{t['ttft_ms_p50'] / b['ttft_ms_p50']:.2f}, load TPOT p50 "
          f"x{med['this']['tpot_ms_p50'] / med['baseline']['tpot_ms_p50']:.2f}, tokens/s "
          f"x{med['this']['tokens_per_s'] / med['baseline']['tokens_per_s']:.2f}")  # fmt: skip
    if a.output:
        a.output.write_text(json.dumps(result, indent=1, default=str))
        print(f"wrote {a.output}")


if __name__ == "__main__":
    main()
