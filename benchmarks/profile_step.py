"""Where one engine step's time goes: torch.profiler over `EngineCore.step`, grouped by kind.

Runs the random-weight ~125M Llama of `engine_bench.py` (float32, 2 threads) in three states:
a batch-1 decode, a batch-32 decode and a 512-token prefill, and splits each step's wall time into
matrix products, attention (SDPA and the KV cache gathers and writes), other torch ops, and host
time outside any torch op (Python: scheduler, input preparation, module calls). The profiler adds
some microseconds per op, so the host share is an upper bound.

    python benchmarks/profile_step.py [--steps 10] [--output profile.json] [--model-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's pdserve

from lib.engine_common import (  # noqa: E402
    NUM_THREADS,
    greedy,
    make_llm,
    make_model,
    model_shape,
    random_prompts,
    start_decoding,
)

MATMUL_OPS = {"aten::mm", "aten::addmm", "aten::bmm"}
ATTENTION_OPS = {"aten::_scaled_dot_product_flash_attention_for_cpu"}
KV_OPS = {"aten::index_copy_"}  # the cache writes; the gathers are aten::index on the cache


def classify(name: str, input_shapes: list, num_slots: int) -> str:
    if name in MATMUL_OPS:
        return "matmul"
    if name in ATTENTION_OPS:
        return "attention (SDPA)"
    if name in KV_OPS:
        return "KV cache write"
    if name == "aten::index" and input_shapes and input_shapes[0][:1] == [num_slots]:
        return "KV cache gather"
    return "other torch ops"


def profile_steps(core, num_steps: int) -> dict[str, Any]:
    """Profile `num_steps` calls of `core.step()`; times in ms per step."""
    num_slots = core.runner.kv_caches[0].shape[1]
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        t0 = time.perf_counter()
        for _ in range(num_steps):
            core.step()
        wall = time.perf_counter() - t0
    kinds: dict[str, float] = {}
    ops: dict[str, float] = {}
    for event in prof.key_averages(group_by_input_shape=True):
        kind = classify(event.key, event.input_shapes, num_slots)
        kinds[kind] = kinds.get(kind, 0.0) + event.self_cpu_time_total / 1e3
        ops[event.key] = ops.get(event.key, 0.0) + event.self_cpu_time_total / 1e3
    op_total = sum(kinds.values())
    kinds["host (outside torch ops)"] = wall * 1e3 - op_total
    per_step = {k: v / num_steps for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])}
    top = sorted(ops.items(), key=lambda kv: -kv[1])[:8]
    return {
        "step_ms": wall * 1e3 / num_steps,
        "ms_per_step": per_step,
        "top_ops_ms_per_step": {k: v / num_steps for k, v in top},
    }


def decode_state(llm, batch: int, prompt_len: int, steps: int, vocab: int) -> None:
    """Leave `batch` requests decoding in the engine core, warmed up."""
    prompts = random_prompts(random.Random(batch), [prompt_len] * batch, vocab)
    start_decoding(llm.engine.core, prompts, 2 * steps + 8, f"p{batch}-")


def run(model_dir: Path, steps: int) -> dict[str, Any]:
    make_model(model_dir)
    shape = model_shape(model_dir)
    llm = make_llm(model_dir, enable_prefix_caching=False, max_num_batched_tokens=4096)
    core = llm.engine.core
    results = {}
    for batch in (1, 32):
        decode_state(llm, batch, 128, steps, shape.vocab_size)
        results[f"decode batch {batch}, context ~140"] = profile_steps(core, steps)
        core.abort_requests(list(core.scheduler.requests))
    rng = random.Random(0)
    n = 512
    llm.generate(random_prompts(rng, [n], shape.vocab_size), greedy(1))  # warm-up
    for i, prompt in enumerate(random_prompts(rng, [n] * steps, shape.vocab_size)):
        core.add_request(core.make_request(f"prefill-{i}", prompt, greedy(1)))
    # The budget (4096) admits several 512-token prompts per step: cap to one by stepping
    # with a single waiting request at a time.
    waiting = list(core.scheduler.waiting)
    core.scheduler.waiting.clear()
    prof_steps = []
    for req in waiting:
        core.scheduler.waiting.append(req)
        prof_steps.append(profile_steps(core, 1))
    results[f"prefill {n} tokens"] = _mean(prof_steps)
    return results


def _mean(runs: list[dict[str, Any]]) -> dict[str, Any]:
    keys = {k for r in runs for k in r["ms_per_step"]}
    ops = {k for r in runs for k in r["top_ops_ms_per_step"]}
    return {
        "step_ms": sum(r["step_ms"] for r in runs) / len(runs),
        "ms_per_step": {
            k: sum(r["ms_per_step"].get(k, 0.0) for r in runs) / len(runs)
            for k in sorted(keys, key=lambda k: -runs[0]["ms_per_step"].get(k, 0.0))
        },
        "top_ops_ms_per_step": {
            k: sum(r["top_ops_ms_per_step"].get(k, 0.0) for r in runs) / len(runs) for k in ops
        },
    }


def print_report(results: dict[str, Any]) -> None:
    for name, r in results.items():
        print(f"\n{name}: {r['step_ms']:.1f} ms/step")
        for kind, ms in r["ms_per_step"].items():
            print(f"  {kind:<28} {ms:8.2f} ms  {ms / r['step_ms']:6.1%}")
        tops = sorted(r["top_ops_ms_per_step"].items(), key=lambda kv: -kv[1])[:6]
        print("  top ops: " + ", ".join(f"{k} {v:.2f}" for k, v in tops))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--output", type=Path)
    parser.add_argument("--model-dir", type=Path)
    args = parser.parse_args(argv)
    torch.set_num_threads(NUM_THREADS)
    with tempfile.TemporaryDirectory(prefix="pdprof-") as tmp:
        results = run(args.model_dir or Path(tmp), args.steps)
    print_report(results)
    if args.output:
        args.output.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
