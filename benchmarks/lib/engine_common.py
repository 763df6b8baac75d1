"""The engine benchmarks' model, settings and requests: a random-weight ~125M Llama in float32 on
two threads, random prompts, greedy sampling. Shared by engine_bench.py, engine_whatif.py and
profile_step.py."""

from __future__ import annotations

import json
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lib.paths import TRACE
from pdserve import LLM, SamplingParams
from pdserve.bench.traces import read_trace
from pdserve.perf.cost import ModelShape

PRESET = "llama-125m"
NUM_THREADS = 2
PAD_TOKEN_ID = 3  # the byte-level tokenizer written by pdserve.models.make
FIRST_TOKEN_ID = 4  # random prompts avoid the special tokens 0..3


@dataclass(frozen=True)
class BenchConfig:
    gemm_seconds: float = 6.0
    bandwidth_seconds: float = 3.0
    ceiling_repeats: int = 8
    prefill_lens: tuple[int, ...] = (512, 2047)  # 2047: the context is 2048, one output token
    prefill_repeats: int = 4
    decode_batches: tuple[int, ...] = (1, 8, 32)
    decode_prompt_len: int = 128
    decode_output_len: int = 128
    offline_num_requests: int = 64
    offline_scale: int = 8
    hf_batch_sizes: tuple[int, ...] = (8, 16)
    overhead_num_seqs: int = 32
    overhead_steps: int = 40
    tries: int = 3  # attempts per measurement when other processes disturb it
    quiet_wait_s: float = 20.0  # longest wait for a quiet CPU before one measurement
    patience_s: float = 180.0  # all waiting and discarded attempts together, at most
    seed: int = 0


QUICK = BenchConfig(
    gemm_seconds=0.5,
    bandwidth_seconds=0.5,
    ceiling_repeats=2,
    prefill_lens=(512,),
    prefill_repeats=1,
    decode_batches=(1, 8),
    decode_prompt_len=64,
    decode_output_len=16,
    offline_num_requests=8,
    offline_scale=16,
    hf_batch_sizes=(4, 8),
    overhead_num_seqs=8,
    overhead_steps=10,
    tries=1,
    quiet_wait_s=0.0,
    patience_s=0.0,
)


def make_model(model_dir: Path) -> Path:
    from pdserve.models.make import write_random_model

    if (model_dir / "config.json").is_file():
        return model_dir
    return write_random_model(model_dir, PRESET)


def model_shape(model_dir: Path) -> ModelShape:
    config = json.loads((model_dir / "config.json").read_text())
    return ModelShape.from_hf_config(config, dtype_bytes=4)


def random_prompts(rng: random.Random, lens: list[int], vocab: int) -> list[list[int]]:
    return [[rng.randrange(FIRST_TOKEN_ID, vocab) for _ in range(n)] for n in lens]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def trace_lengths(n: int, scale: int, max_len: int, seed: int) -> list[tuple[int, int]]:
    """`n` (prompt, output) lengths sampled from the Azure conversation trace, divided by `scale`
    and clamped so that prompt + output fits in `max_len`."""
    rows = [(r.input_len, r.output_len) for r in read_trace(TRACE)]
    picked = random.Random(seed).sample(rows, n)
    out = []
    for context, generated in picked:
        prompt = min(max(1, round(context / scale)), max_len - 1)
        output = min(max(1, round(generated / scale)), max_len - prompt)
        out.append((prompt, output))
    return out


def make_llm(model_dir: Path, **engine_args: Any) -> LLM:
    return LLM(str(model_dir), num_threads=NUM_THREADS, dtype="float32", **engine_args)


def run_decode(llm: LLM, prompts: list[list[int]], output_len: int) -> dict[str, Any]:
    """All prompts in one `generate`; decode tokens/s from the request metrics (first token to
    finish), and the first request's token ids."""
    outs = llm.generate(prompts, greedy(output_len))
    metrics = [o.metrics for o in outs]
    tokens = sum(len(o.outputs[0].token_ids) - 1 for o in outs)
    span = max(m.finished_time for m in metrics) - min(m.first_token_time for m in metrics)
    return {
        "batch": len(prompts),
        "decode_tokens": tokens,
        "decode_s": span,
        "tokens_s": tokens / span,
        "token_ids": outs[0].outputs[0].token_ids,
    }


def start_decoding(
    core, prompts: list[list[int]], max_tokens: int, id_prefix: str, warm_steps: int = 3
) -> None:
    """Leave `prompts` decoding in the engine core (stepped directly, no detokenizer): add them
    (ids `id_prefix` + index), step through their prefills, then `warm_steps` decode steps."""
    for i, prompt in enumerate(prompts):
        core.add_request(core.make_request(f"{id_prefix}{i}", prompt, greedy(max_tokens)))
    while any(r.num_output_tokens == 0 for r in core.scheduler.requests.values()):
        core.step()  # the prefills
    for _ in range(warm_steps):
        core.step()


def decode_rate(
    llm: LLM, prompts: list[list[int]], new_tokens: int | list[int]
) -> tuple[float, float]:
    """(decode tokens/s of the batch, mean bytes per decode step); `new_tokens` per prompt,
    or one count for all."""
    totals = llm.engine.core.stats.totals
    before = totals.get("decode")
    b0, s0 = (before.bytes, before.steps) if before else (0.0, 0)
    counts = new_tokens if isinstance(new_tokens, list) else [new_tokens] * len(prompts)
    outs = llm.generate(prompts, [greedy(n) for n in counts])
    m = [o.metrics for o in outs]
    tokens = sum(len(o.outputs[0].token_ids) - 1 for o in outs)
    span = max(x.finished_time for x in m) - min(x.first_token_time for x in m)
    after = totals["decode"]
    return tokens / span, (after.bytes - b0) / (after.steps - s0)


def prefill_rate(llm: LLM, prompt: list[int]) -> float:
    llm.generate([prompt], greedy(1))  # warm
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        llm.generate([prompt], greedy(1))
        best = min(best, time.perf_counter() - t0)
    return len(prompt) / best


def paired_decode(
    llm: LLM, prompt: list[int], new_tokens: int, split: bool = False
) -> dict[str, Any]:
    """Batch-1 decode with each step paired with a read of the step's own bytes, one right
    after the other: the fraction of the read-bandwidth roofline step by step.

    This machine's read bandwidth moves by up to 2x within seconds, so a roofline sampled a
    minute away from the steps says little about them; a read of the same number of bytes
    taken a millisecond after each step sees the same state of the memory system. The read is
    the best of two of the native streaming sum (`kernels/cpu_memory.c`, the fastest read this
    machine has; on huge pages where the weights are) over a buffer of the step's bytes, so the
    fraction is read time / step time, a stricter roofline than one sample of the minute.
    Returns the median step, the median fraction and its deciles.

    `split` also times the step's forward, the fused step's one native call over the layers, the
    final norm and the output head, paired with a read of the step's bytes, and the host's
    share: the step's time outside it (scheduling, inputs, sampling, bookkeeping). Where the
    head runs apart (a head on no native kernel), the layers' call and the head are each
    paired with a read of their own bytes (the head's weight; the layers' are the rest). Needs
    the fused decode step."""
    from pdserve.kernels import huge_pages, memory

    engine, totals = llm.engine, llm.engine.core.stats.totals
    llm.generate([prompt], greedy(8))  # warm, and the bytes a step reads
    before = totals["decode"]
    b0, s0 = before.bytes, before.steps
    llm.generate([prompt], greedy(8))
    nbytes = (totals["decode"].bytes - b0) / (totals["decode"].steps - s0)
    read = memory.read_sum if memory.available()[0] else torch.Tensor.sum

    def buffer(n: float) -> torch.Tensor:
        buf = torch.ones(int(n) // 4)
        return huge_pages.arena([buf])[0] if huge_pages.available() else buf

    def timed(fn, *args) -> float:
        t0 = time.perf_counter()
        fn(*args)
        return time.perf_counter() - t0

    buf = buffer(nbytes)
    model = engine.core.runner.model
    parts: dict[str, float] = {}
    if split:
        if model.fused_decode is None:
            raise ValueError("paired_decode(split=True) needs the fused decode step")
        fused_head = model.fused_decode.head is not None
        if fused_head:  # one call: the layers and the head, paired with the step's own read
            bufs = {"forward": None}
        else:  # the head's share of the step's bytes, as the step's statistics count it
            runner, cfg = engine.core.runner, model.config
            per_param = runner.matmul_bytes_per_param or model.norm.weight.element_size()
            head_bytes = cfg.vocab_size * cfg.hidden_size * per_param
            bufs = {"layers": buffer(nbytes - head_bytes), "head": buffer(head_bytes)}

        def timing(name: str, fn):
            def call(*args):
                t0 = time.perf_counter()
                out = fn(*args)
                parts[name] = time.perf_counter() - t0
                return out

            return call

        fused, logits = model.fused_decode, model.compute_logits
        bursts = engine.core.max_steps > 1
        if bursts:  # the runner calls the burst on the fused step itself (it needs its head)
            fused.burst = timing("forward", fused.burst)
        else:
            model.fused_decode = timing("forward" if fused_head else "layers", fused)
        if not fused_head:
            model.compute_logits = timing("head", logits)
    steps, fractions = [], []
    split_rows: list[dict[str, float]] = []  # host s, and each call's fraction of its read
    try:
        engine.add_request("paired", prompt, greedy(new_tokens))
        engine.step()  # the prompt
        while engine.has_unfinished:
            parts.clear()
            done = totals["decode"].steps
            step_s = timed(engine.step)
            # a burst (--num-scheduler-steps) ran k steps: against k reads of a step's bytes
            k = totals["decode"].steps - done
            read_s = min(timed(read, buf), timed(read, buf)) * k
            steps.extend([step_s / k] * k)
            fractions.extend([read_s / step_s] * k)
            if split and len(parts) == len(bufs):
                if fused_head:  # the forward reads the step's bytes: the step's own read
                    reads = {"forward": read_s}
                else:
                    # in turn, so that the head's buffer (a quantized head's fits in a large
                    # L3) comes from memory as the head's weights do, not from the cache
                    times = [(k, timed(read, b)) for _ in range(2) for k, b in bufs.items()]
                    reads = {k: min(t for name, t in times if name == k) for k in bufs}
                split_rows.append({"host_s": (step_s - sum(parts.values())) / k,
                                   **{f"{n}_of_read": reads[n] / parts[n] for n in bufs}})  # fmt: skip
    finally:
        if split:
            model.fused_decode = fused
            if bursts:
                del fused.burst  # the class's method again
            if not fused_head:
                del model.compute_logits  # the class's method again
    q = statistics.quantiles(fractions, n=10)
    out = {"step_s": statistics.median(steps), "tokens_s": 1 / statistics.median(steps),
           "bytes_per_step": nbytes, "roofline_fraction": statistics.median(fractions),
           "roofline_fraction_p10_p90": [q[0], q[-1]], "steps": len(steps)}  # fmt: skip
    if split_rows:
        out["split"] = {k: statistics.median(row[k] for row in split_rows) for k in split_rows[0]}
        out["split"]["steps"] = len(split_rows)
    return out
