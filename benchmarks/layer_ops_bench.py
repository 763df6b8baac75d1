"""The parts of a prefill step that are not matrix products, pdserve's native kernels against
torch's ops, on the shapes of a served load's prefill steps; alternated in one process.

    python benchmarks/layer_ops_bench.py [--rounds 30] [--output ops.json]      # ~10 s

The load is `prefill_bench.py`'s (32 requests of the Azure conversation trace, lengths / 8,
all queued at once, a 2,048-token budget): two prefill steps of 2,048 and ~1,300 tokens made of
24 and 9 prompt chunks (one prompt split across the two). On llama-125m's shapes (12 query and
4 KV heads of 64, hidden 768, MLP 3,072, 12 layers), per layer:

- attention over the step's chunks: `PagedSDPABackend` (SDPA per chunk over its gathered
  context) against `NativeBackend` (one call for every chunk, keys and values read in the
  cache), both from the layer's q, k and v with the K/V already in the cache;
- RMSNorm of the step's rows: `F.rms_norm` against `kernels.layer.rms_norm`;
- the rotary embedding of q and k: `RotaryEmbedding.apply` (a new tensor) against
  `kernels.layer.rope_` (in place in the qkv product's output);
- the MLP's activation on one 640-row chunk (the MLP runs long steps in chunks, one of these per
  chunk): `F.silu(gate).mul_(up)` against `kernels.layer.silu_mul`.

Each pair is timed `--rounds` times, torch and native alternated (who goes first alternates
too); medians per call, their ratio, and the step's total over its 12 layers. The attention's
rate counts the causal product's FLOPs (4 * head_dim per query-key pair that is computed).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(1, str(HERE))

from lib.paths import TRACE  # noqa: E402

from pdserve.bench.traces import read_trace  # noqa: E402
from pdserve.bench.workload import WorkloadConfig, make_specs  # noqa: E402
from pdserve.kernels import layer as layer_ops  # noqa: E402
from pdserve.models.attention import (  # noqa: E402
    AttentionMetadata,
    NativeBackend,
    PagedSDPABackend,
    PrefillChunk,
)
from pdserve.models.rope import RotaryEmbedding  # noqa: E402

HQ, HKV, D, HIDDEN, INTER, LAYERS, BUDGET, MLP_CHUNK = 12, 4, 64, 768, 3072, 12, 2048, 640
WORKLOAD = dict(num_requests=32, length_scale=0.125, max_input_len=1536, max_output_len=384,
                request_rate=float("inf"), seed=0)  # fmt: skip


def prefill_steps(lengths: list[int]) -> list[list[tuple[int, int]]]:
    """The prompts split into steps of at most BUDGET tokens in arrival order, a prompt that
    does not fit continued in the next step: per step, (new tokens, earlier tokens) per chunk."""
    steps, step, room = [], [], BUDGET
    for n in lengths:
        done = 0
        while done < n:
            take = min(n - done, room)
            step.append((take, done))
            done, room = done + take, room - take
            if room == 0:
                steps.append(step)
                step, room = [], BUDGET
    return steps + ([step] if step else [])


def step_inputs(chunks: list[tuple[int, int]], gen: torch.Generator):
    """q, k, v as views of one qkv product, a cache holding every chunk's context, and the
    metadata `ModelRunner.layout` builds for those chunks."""
    t = sum(n for n, _ in chunks)
    qkv = torch.randn(t, HQ + 2 * HKV, D, generator=gen)
    slots_total = sum(n + past for n, past in chunks)
    cache = torch.randn(2, slots_total, HKV, D, generator=gen)
    meta = AttentionMetadata(slot_mapping=torch.empty(t, dtype=torch.long))
    row = slot = 0
    for n, past in chunks:
        ctx = torch.arange(slot, slot + past + n)
        meta.slot_mapping[row : row + n] = ctx[past:]
        chunk = PrefillChunk(row, row + n, None, None)
        if past:
            chunk.ctx_slots = ctx
            chunk.mask = torch.arange(past + n)[None] <= torch.arange(past, past + n)[:, None]
        meta.prefills.append(chunk)
        row, slot = row + n, slot + past + n
    return qkv, cache, meta


def timed(fn, rounds: int) -> list[float]:
    fn()
    out = []
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def pair(torch_fn, native_fn, rounds: int) -> dict:
    a, b = [], []
    for r in range(rounds):
        first, second = (torch_fn, native_fn) if r % 2 == 0 else (native_fn, torch_fn)
        x, y = timed(first, 1)[0], timed(second, 1)[0]
        a.append(x if r % 2 == 0 else y)
        b.append(y if r % 2 == 0 else x)
    ta, tb = statistics.median(a), statistics.median(b)
    return {"torch_ms": ta * 1e3, "native_ms": tb * 1e3, "speedup": ta / tb}


def bench_step(chunks, rounds: int, gen: torch.Generator) -> dict:
    qkv, cache, meta = step_inputs(chunks, gen)
    t = qkv.shape[0]
    q, k, v = qkv.split([HQ, HKV, HKV], dim=1)
    out = torch.empty(t, HQ * D)
    sdpa, native = PagedSDPABackend(), NativeBackend()
    res = {"tokens": t, "chunks": len(chunks)}
    res["attention"] = pair(lambda: sdpa.prefill_all(q, k, v, cache, meta, out),
                            lambda: native.prefill_all(q, k, v, cache, meta, out), rounds)  # fmt: skip
    flops = sum(4 * D * HQ * (n * past + n * (n + 1) / 2) for n, past in chunks)
    res["attention"]["native_gflops"] = flops / res["attention"]["native_ms"] / 1e6
    res["attention"]["torch_gflops"] = flops / res["attention"]["torch_ms"] / 1e6
    x, w = torch.randn(t, HIDDEN, generator=gen), torch.randn(HIDDEN, generator=gen)
    res["rms_norm"] = pair(lambda: F.rms_norm(x, (HIDDEN,), w, 1e-5),
                           lambda: layer_ops.rms_norm(x, w, 1e-5), rounds)  # fmt: skip
    angles = torch.rand(t, D // 2, generator=gen) * 100
    cos, sin = angles.cos()[:, None], angles.sin()[:, None]
    work = qkv.clone()
    res["rope"] = pair(lambda: RotaryEmbedding.apply(qkv[:, : HQ + HKV], cos, sin),
                       lambda: layer_ops.rope_(work, HQ + HKV, cos, sin), rounds)  # fmt: skip
    gate_up = torch.randn(min(t, MLP_CHUNK), 2 * INTER, generator=gen)
    gate, up = gate_up.chunk(2, dim=-1)
    res["silu_mul"] = pair(lambda: F.silu(gate).mul_(up),
                           lambda: layer_ops.silu_mul(gate_up), rounds)  # fmt: skip
    # per step: attention and rope once per layer, two norms, the MLP chunks' activations
    per_layer = {"attention": 1, "rms_norm": 2, "rope": 1, "silu_mul": -(-t // MLP_CHUNK)}
    for kind in ("torch_ms", "native_ms"):
        res[f"step_{kind}"] = LAYERS * sum(res[op][kind] * n for op, n in per_layer.items())
    return res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--output", type=Path)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    specs = make_specs(WorkloadConfig(**WORKLOAD), read_trace(TRACE))
    gen = torch.Generator().manual_seed(0)
    results = []
    for i, chunks in enumerate(prefill_steps([s.input_len for s in specs])):
        r = bench_step(chunks, args.rounds, gen)
        results.append(r)
        print(f"step {i + 1}: {r['tokens']} tokens in {r['chunks']} chunks (ms per call, median "
              f"of {args.rounds}; torch -> native)")  # fmt: skip
        for op in ("attention", "rms_norm", "rope", "silu_mul"):
            m = r[op]
            extra = (f"  ({m['torch_gflops']:.0f} -> {m['native_gflops']:.0f} GFLOP/s)"
                     if op == "attention" else "")  # fmt: skip
            print(f"  {op:<10} {m['torch_ms']:8.3f} -> {m['native_ms']:8.3f}  "
                  f"x{m['speedup']:.2f}{extra}")  # fmt: skip
        print(f"  the step's {LAYERS} layers: {r['step_torch_ms']:.0f} -> "
              f"{r['step_native_ms']:.0f} ms")  # fmt: skip
    if args.output:
        args.output.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
