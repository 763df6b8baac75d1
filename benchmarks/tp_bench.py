"""Tensor parallelism on this machine: two ranks of one thread each against one engine with two
threads, prefill and decode, side by side in one run, and what the all-reduces cost per step.

    python benchmarks/tp_bench.py [--model /tmp/pdbench/llama-125m] [--output tp.json]  # ~3 min

Engines (all float32, 2 threads in all):
- `tp1`: one rank, 2 threads, as pdserve runs by default (the fused decode step where it can);
- `tp1-eager`: the same, layer by layer (`enforce_eager`), the path tensor parallelism takes;
- `tp2`: two ranks of 1 thread each (this process and a follower, one CPU each).

Per engine, best of `--rounds`: a fresh 512-token prefill (max_tokens=1, its wall time), batch-1
decode tokens/s over 64 tokens, batch-8 decode tokens/s; for `tp2` the time spent in the
all-reduces (timed around each call on rank 0) as a share of its decode and prefill steps.
The model is written first if missing (`pdserve make-model --preset llama-125m`).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path

from pdserve import LLM, SamplingParams

ENGINES = {
    "tp1": {"num_threads": 2},
    "tp1-eager": {"num_threads": 2, "enforce_eager": True},
    "tp2": {"tensor_parallel_size": 2},
}


def ensure_model(path: Path) -> Path:
    if not (path / "config.json").exists():
        from pdserve.models.make import write_random_model

        write_random_model(path, "llama-125m", seed=0)
    return path


class ReduceTimer:
    """Seconds spent in the all-reduces of rank 0 (wrapped around each layer's call)."""

    def __init__(self, llm: LLM) -> None:
        self.seconds = 0.0
        for layer in llm.engine.core.runner.model.layers:
            for block in (layer.self_attn, layer.mlp):
                block.reduce = self.wrap(block.reduce)

    def wrap(self, fn):
        def timed(x):
            t = time.perf_counter()
            out = fn(x)
            self.seconds += time.perf_counter() - t
            return out

        return timed


def measure(llm: LLM, vocab: int, rounds: int, timer: ReduceTimer | None) -> dict:
    rng = random.Random(0)
    prompt = [rng.randrange(3, vocab) for _ in range(512)]
    short = [[rng.randrange(3, vocab) for _ in range(16)] for _ in range(8)]
    out: dict = {}

    def best(fn):
        results = [fn() for _ in range(rounds)]
        return min(results, key=lambda r: r[0])

    def prefill():  # a fresh prompt each time: nothing served from the prefix cache
        fresh = [rng.randrange(3, vocab) for _ in range(512)]
        t0, r0 = time.perf_counter(), timer.seconds if timer else 0.0
        llm.generate([fresh], SamplingParams(temperature=0, max_tokens=1))
        dt = time.perf_counter() - t0
        return dt, ((timer.seconds - r0) / dt if timer else None)

    def decode(batch: int):
        params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
        r0 = timer.seconds if timer else 0.0
        t0 = time.perf_counter()
        outs = llm.generate(short[:batch], params)
        dt = time.perf_counter() - t0
        decode_s = max(o.metrics.token_times[-1] - o.metrics.first_token_time for o in outs)
        tokens = sum(len(o.outputs[0].token_ids) - 1 for o in outs)
        return -tokens / decode_s, ((timer.seconds - r0) / dt if timer else None)

    llm.generate([prompt[:64]], SamplingParams(max_tokens=2))  # warm up
    t, share = best(prefill)
    out["prefill_512_ms"] = round(t * 1e3, 1)
    out["prefill_allreduce_share"] = None if share is None else round(share, 3)
    for batch in (1, 8):
        neg, share = best(lambda b=batch: decode(b))
        out[f"decode_b{batch}_tok_s"] = round(-neg, 1)
        out[f"decode_b{batch}_allreduce_share"] = None if share is None else round(share, 3)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="/tmp/pdbench/llama-125m")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--engines", default=",".join(ENGINES))
    p.add_argument("--output")
    a = p.parse_args()
    model = str(ensure_model(Path(a.model)))
    if len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("needs 2 CPUs")
    results = {}
    for name in a.engines.split(","):
        llm = LLM(model, **ENGINES[name])
        vocab = llm.engine.core.model_config.vocab_size
        timer = ReduceTimer(llm) if name == "tp2" else None
        results[name] = measure(llm, vocab, a.rounds, timer)
        llm.close()
        print(name, json.dumps(results[name]), flush=True)
    base = results.get("tp1")
    if base:
        for name, r in results.items():
            print(f"{name:10s} prefill {base['prefill_512_ms'] / r['prefill_512_ms']:.2f}x  "
                  f"decode b1 {r['decode_b1_tok_s'] / base['decode_b1_tok_s']:.2f}x  "
                  f"b8 {r['decode_b8_tok_s'] / base['decode_b8_tok_s']:.2f}x  (vs tp1)")  # fmt: skip
    if a.output:
        Path(a.output).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
