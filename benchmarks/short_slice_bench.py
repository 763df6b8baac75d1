"""Tokens out of a busy machine: `pdserve serve --short-time-slices` (the frontend's and the
workers' message threads on short scheduler slices, `pdserve/ipc/sched_slice.py`) against the
kernel's default slices.

    python benchmarks/short_slice_bench.py [--rounds 2] [--output FILE]

One colocated `pdserve serve` of llama-125m (float32, `--cpus 0-1`, 256-token chunks), started
anew per arm, the two arms alternating for `--rounds` rounds, each on a quiet machine:

1. Delivery: the Mooncake conversation requests of `sim_accuracy_bench.py` (45, lengths x 0.05,
   prefixes shared by their hash ids) sent one at a time, 0.3 s apart, two tokens out each, so
   that the worker goes straight on to a decode step after the prompt's. Per request, the
   client's TTFT less the worker's prompt step (the server's step-time histogram before and
   after it): the time the request spends outside the step, on the way in and on the way out.
2. Load: 32 requests of 256 prompt and 64 output tokens (`pdserve bench`'s prompts, seed 0) by
   `pdserve bench`'s client at concurrency 8: TTFT and TPOT, output tokens/s.

The client runs in this process, on the same CPUs, with the kernel's default slice in both arms.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
import types
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sim_accuracy_bench  # noqa: E402
from lib.machine import code_info, machine_info  # noqa: E402
from lib.paths import DEFAULT_125M, ensure_125m  # noqa: E402
from lib.quiet import measured  # noqa: E402
from lib.server import Server, first_token_s, prompt_steps, prompts_for  # noqa: E402

from pdserve.bench.client import ClientConfig, run_requests  # noqa: E402
from pdserve.bench.metrics import summarize  # noqa: E402
from pdserve.bench.tokenizer import HFPromptTokenizer, load_tokenizer  # noqa: E402

ARMS = {"short": ["--short-time-slices"], "default": []}
GAP_S = 0.3


def delivery(srv: Server, model: str, prompts) -> dict:
    outside, steps = [], []
    with httpx.Client(timeout=60, trust_env=False) as client:
        first_token_s(client, srv.base_url, model, "warm up", 2)
        for p in prompts:
            time.sleep(GAP_S)
            s0, n0 = prompt_steps(srv)
            ttft = first_token_s(client, srv.base_url, model, p.prompt, 2)
            s1, n1 = prompt_steps(srv)
            if n1 - n0 != 1:  # chunked into more than one step: not one step's time
                continue
            steps.append((s1 - s0) * 1e3)
            outside.append(ttft * 1e3 - steps[-1])
    return {"requests": len(outside), "outside_ms": quantiles(outside), "step_ms": quantiles(steps)}


def load(srv: Server, model: str) -> dict:
    prompts = prompts_for(model, 32, 256, 64)
    cfg = ClientConfig(srv.base_url, model, "completions")
    t0 = time.perf_counter()
    records = asyncio.run(run_requests(prompts, cfg, 8))
    wall = time.perf_counter() - t0
    s = summarize(records)
    tokens = sum(r.num_output_tokens for r in records if r.status == "completed")
    return {
        "completed": s["completed"],
        "ttft_ms": {k: s["ttft_ms"][k] for k in ("p50", "p90")},
        "tpot_ms": {k: s["tpot_ms"][k] for k in ("p50", "p90")},
        "output_tok_s": tokens / wall,
    }


def quantiles(values: list[float]) -> dict:
    v = sorted(values)
    return {
        "p10": v[len(v) // 10],
        "p50": statistics.median(v),
        "p90": v[9 * len(v) // 10],
    }


def run_arm(model: str, arm: str, prompts, log_dir: Path) -> dict:
    args = ["--model", model, "--cpus", "0-1", "--max-num-batched-tokens", "256", *ARMS[arm]]
    with Server(args, log_dir / f"serve-{arm}.log") as srv:
        return {"delivery": delivery(srv, model, prompts), "load": load(srv, model)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(DEFAULT_125M))
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--output", help="write the results as JSON here")
    a = p.parse_args()
    if a.model == str(DEFAULT_125M):
        ensure_125m(Path(a.model))
    tok = HFPromptTokenizer(load_tokenizer(a.model), chat=False)
    wl = types.SimpleNamespace(mooncake_scale=0.05, num_requests=45, rate=0.25, seed=0)
    _, prompts = sim_accuracy_bench.workload("mooncake", wl, tok)
    log_dir = Path(tempfile.mkdtemp(prefix="short_slice-"))
    runs = []
    for rnd in range(a.rounds):
        for arm in ARMS if rnd % 2 == 0 else reversed(ARMS):
            result, meta = measured(lambda arm=arm: run_arm(a.model, arm, prompts, log_dir), arm)
            runs.append({"round": rnd, "arm": arm, **result, "meta": meta})
            d, ld = result["delivery"], result["load"]
            print(
                f"round {rnd} {arm:7s}: outside the step p50 {d['outside_ms']['p50']:.1f} ms "
                f"p90 {d['outside_ms']['p90']:.1f} (prompt step p50 {d['step_ms']['p50']:.1f}, "
                f"{d['requests']} requests) | load: TTFT p50 {ld['ttft_ms']['p50']:.0f} ms, "
                f"TPOT p50 {ld['tpot_ms']['p50']:.1f} ms, {ld['output_tok_s']:.0f} tok/s",
                flush=True,
            )
    print("\nper arm, the median over rounds:")
    for arm in ARMS:
        mine = [r for r in runs if r["arm"] == arm]

        def med(f, mine=mine):
            return statistics.median(f(r) for r in mine)

        print(
            f"  {arm:7s}: outside p50 {med(lambda r: r['delivery']['outside_ms']['p50']):.1f} ms, "
            f"p90 {med(lambda r: r['delivery']['outside_ms']['p90']):.1f}; load TTFT p50 "
            f"{med(lambda r: r['load']['ttft_ms']['p50']):.0f} ms, TPOT p50 "
            f"{med(lambda r: r['load']['tpot_ms']['p50']):.1f} ms, "
            f"{med(lambda r: r['load']['output_tok_s']):.0f} tok/s"
        )
    if a.output:
        out = {"machine": machine_info(), "code": code_info(), "args": vars(a), "runs": runs}
        Path(a.output).write_text(json.dumps(out, indent=1))
        print(f"wrote {a.output}")


if __name__ == "__main__":
    main()
