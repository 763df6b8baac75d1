"""engine_bench.py's Hugging Face baseline: `transformers` `generate` on the same checkpoint,
greedy, left-padded, at batch 1 (decode tokens/s) and in static batches (offline throughput)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from lib.engine_common import PAD_TOKEN_ID, BenchConfig
from lib.quiet import Quiet


class TokenTimes:
    """A `generate` streamer that stamps each put(): the prompt first, then one per new token."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def load_hf(model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


def hf_generate(model, prompts: list[list[int]], new_tokens: int, streamer=None) -> torch.Tensor:
    """Greedy, left-padded, exactly `new_tokens` new tokens per row: [rows, new_tokens]."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), PAD_TOKEN_ID, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, width - len(p) :] = torch.tensor(p)
        mask[r, width - len(p) :] = 1
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=PAD_TOKEN_ID,
            streamer=streamer,
        )
    return out[:, width:]


def bench_hf_decode(cfg: BenchConfig, quiet: Quiet, hf, prompt: list[int]) -> dict[str, Any]:
    n = cfg.decode_output_len
    hf_generate(hf, [prompt], 8)  # warm-up

    def run() -> tuple[float, list[int]]:
        stamps = TokenTimes()
        out = hf_generate(hf, [prompt], n, stamps)
        # times[0]: the prompt, times[1]: the first new token, times[-1]: the last one.
        return (n - 1) / (stamps.times[-1] - stamps.times[1]), out[0].tolist()

    m = quiet.run("hf decode batch 1", run)
    return {"tokens_s": m.value[0], "token_ids": m.value[1], "foreign_cores": m.foreign_cores}


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def bench_offline_hf(
    quiet: Quiet, hf, lens: list[tuple[int, int]], prompts: list[list[int]], batch: int
) -> dict[str, Any]:
    """`generate` on static batches in trace order; each runs to its longest output, and only
    the requested tokens count."""
    hf_generate(hf, prompts[:2], 4)  # warm-up
    useful = sum(o for _, o in lens)

    def run() -> dict[str, Any]:
        t0 = time.perf_counter()
        generated = 0
        for i in range(0, len(prompts), batch):
            new = max(o for _, o in lens[i : i + batch])
            generated += hf_generate(hf, prompts[i : i + batch], new).numel()
        wall = time.perf_counter() - t0
        return {
            "wall_s": wall,
            "output_tokens_s": useful / wall,
            "requests_s": len(lens) / wall,
            "generated_tokens": generated,
        }

    m = quiet.run(f"offline hf batch {batch}", run)
    return m.value | {"foreign_cores": m.foreign_cores}
