"""What huge pages buy: the engine with its weights and KV cache on transparent huge pages
against the same engine in torch's memory (`PDSERVE_HUGE_PAGES=0`), in one process, alternated.

    python benchmarks/huge_pages_bench.py [--rounds 12] [--output huge.json]    # ~6 min

Per round, each engine once, in alternating order: batch-1 decode (128 new tokens after a
128-token prompt, tok/s), a decode batch of 16 sequences at 1,000 tokens of context (decode
steps/s, timed once every prompt is in the cache: there the KV cache is read as much as the
weights) and a 512-token prefill (tok/s, best of 3); then the native streaming read of a 512 MiB
buffer on 4 KiB pages and on huge pages. Ratios are taken per pair, so this machine's swings
from one minute to the next cancel. Random llama-125m, float32, 2 threads.
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

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's pdserve

from lib.engine_common import (  # noqa: E402
    NUM_THREADS,
    greedy,
    make_model,
    prefill_rate,
    random_prompts,
)
from lib.machine import code_info, machine_info  # noqa: E402

from pdserve import LLM  # noqa: E402
from pdserve.kernels import huge_pages, memory  # noqa: E402


def engine(model_dir: Path, huge: bool) -> LLM:
    os.environ[huge_pages.ENV_VAR] = "1" if huge else "0"
    try:
        return LLM(str(model_dir), num_threads=NUM_THREADS, enable_prefix_caching=False,
                   max_num_seqs=16)  # fmt: skip
    finally:
        del os.environ[huge_pages.ENV_VAR]


def decode_steps_per_s(llm: LLM, prompts: list[list[int]], new_tokens: int) -> float:
    """Decode steps per second of `prompts` decoded together, once all are in the cache."""
    core = llm.engine.core
    for i, p in enumerate(prompts):
        core.add_request(core.make_request(f"r{time.monotonic_ns()}-{i}", p, greedy(new_tokens)))
    while core.scheduler.waiting or any(
        r.num_computed_tokens < r.num_prompt_tokens for r in core.scheduler.running
    ):
        core.step()
    t0, steps = time.perf_counter(), 0
    while core.has_unfinished:
        core.step()
        steps += 1
    return steps / (time.perf_counter() - t0)


def best_read(buf: torch.Tensor, runs: int = 3) -> float:
    best = float("inf")
    for _ in range(runs):
        t0 = time.perf_counter()
        memory.read_sum(buf)
        best = min(best, time.perf_counter() - t0)
    return buf.numel() * 4 / best / 1e9


def deciles(v: list[float]) -> list[float]:
    q = statistics.quantiles(v, n=10)
    return [round(q[0], 3), round(statistics.median(v), 3), round(q[-1], 3)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--model-dir", type=Path, help="reuse (or create) the model folder here")
    p.add_argument("--output", type=Path)
    a = p.parse_args()
    if not huge_pages.supported():
        print(
            f"no transparent huge pages here (mode {huge_pages.thp_mode()!r}): nothing to compare"
        )
        return 1
    torch.set_num_threads(NUM_THREADS)
    model_dir = make_model(a.model_dir or Path("/tmp/pdbench/llama-125m"))
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    rng = random.Random(0)
    single = random_prompts(rng, [128], vocab)
    batch = random_prompts(rng, [1000] * 16, vocab)
    (long,) = random_prompts(rng, [512], vocab)
    engines = {"huge": engine(model_dir, True), "small": engine(model_dir, False)}
    runner = engines["huge"].engine.core.runner
    placed = {"weights_huge_mib": huge_pages.huge_bytes(runner.model.lm_head.w) / 2**20,
              "kv_huge_mib": huge_pages.huge_bytes(runner.kv_caches[0]) / 2**20}  # fmt: skip
    # (adjacent mappings may be merged into one: then both count the weights and the cache)
    print(f"on huge pages: the weights' mapping {placed['weights_huge_mib']:.0f} MiB, "
          f"the KV cache's {placed['kv_huge_mib']:.0f} MiB")  # fmt: skip
    small_buf = torch.ones(512 * 2**20 // 4)
    (huge_buf,) = huge_pages.arena([small_buf])
    for llm in engines.values():  # warm-up
        decode_steps_per_s(llm, single, 8)
    rows = []
    for r in range(a.rounds):
        order = ("huge", "small") if r % 2 == 0 else ("small", "huge")
        row: dict[str, float] = {}
        for name in order:
            row[f"b1_{name}"] = decode_steps_per_s(engines[name], single, 128)
        for name in reversed(order):
            row[f"b16_{name}"] = decode_steps_per_s(engines[name], batch, 24)
        for name in order:
            row[f"prefill_{name}"] = prefill_rate(engines[name], long)
        row["read_small"], row["read_huge"] = best_read(small_buf), best_read(huge_buf)
        rows.append(row)
        print(f"round {r}: batch 1 {row['b1_huge']:.1f} / {row['b1_small']:.1f} tok/s, "
              f"batch 16 @ 1000 {row['b16_huge']:.2f} / {row['b16_small']:.2f} steps/s, "
              f"prefill 512 {row['prefill_huge']:.0f} / {row['prefill_small']:.0f} tok/s, "
              f"read {row['read_huge']:.1f} / {row['read_small']:.1f} GB/s (huge / small)",
              flush=True)  # fmt: skip
    summary = {key: deciles([row[f"{key}_huge"] / row[f"{key}_small"] for row in rows])
               for key in ("b1", "b16", "prefill", "read")}  # fmt: skip
    for key, name in (("b1", "batch-1 decode"), ("b16", "batch 16 at 1,000 tokens"),
                      ("prefill", "512-token prefill"), ("read", "streaming read")):  # fmt: skip
        print(f"{name}: huge / small pages p10-p50-p90 {summary[key]}")
    if a.output:
        a.output.write_text(json.dumps({"machine": machine_info(), "code": code_info(),
                                        "placed": placed, "rounds": rows,
                                        "ratio_p10_p50_p90": summary}, indent=2))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
