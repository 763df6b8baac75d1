"""Speculative decoding (prompt lookup) against plain decoding, side by side in one run.

    python benchmarks/spec_bench.py [--output spec.json]      # ~5 min

Workloads, each at batch 1, 8 and 32, greedy, outputs forced to their length, decode tokens/s
(first token to last, from the request metrics) with and without `--speculative-method ngram`
(4 tokens, n-grams of 2 to 4), alternated, best of three; acceptance = accepted / proposed:

- `stories`: stories260K continuing the opening of its reference story (a model that writes
  new text: prompt lookup finds little);
- `copy`: stories260K asked to go on with a story it has just read twice (its reference story,
  repeated, then the opening again): an input-copying load, where prompt lookup shines;
- `random-125m`: the random llama-125m of the engine benchmarks (bandwidth-bound, float32) from
  random prompts: its greedy output falls into loops that prompt lookup predicts.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lib.engine_common import make_model, random_prompts  # noqa: E402
from lib.machine import code_info, machine_info  # noqa: E402
from lib.paths import STORIES  # noqa: E402

from pdserve import LLM, SamplingParams  # noqa: E402

SPEC = {"speculative_method": "ngram", "num_speculative_tokens": 4}
BATCHES = (1, 8, 32)


def workloads(model_125m: Path) -> dict[str, tuple[str, list, int]]:
    story = re.search(r"```\n(.*?)\n```", (STORIES.parent / "README.md").read_text(), re.S)
    story = story.group(1)
    opening = story[:60]
    copy = f"{story[:300]}\n\n{story[:300]}\n\n{opening}"
    vocab = json.loads((model_125m / "config.json").read_text())["vocab_size"]
    rand = random_prompts(random.Random(0), [64] * max(BATCHES), vocab)
    return {
        "stories": (str(STORIES), [opening] * max(BATCHES), 200),
        "copy": (str(STORIES), [copy] * max(BATCHES), 200),
        "random-125m": (str(model_125m), rand, 128),
    }


def run(llm: LLM, prompts: list, new_tokens: int) -> dict:
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    outs = llm.generate(prompts, params)
    m = [o.metrics for o in outs]
    tokens = sum(len(o.outputs[0].token_ids) - 1 for o in outs)
    span = max(x.finished_time for x in m) - min(x.first_token_time for x in m)
    proposed = sum(x.num_spec_proposed for x in m)
    accepted = sum(x.num_spec_accepted for x in m)
    return {"tokens_s": tokens / span, "proposed": proposed, "accepted": accepted,
            "token_ids": [o.outputs[0].token_ids for o in outs]}  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--model-dir", type=Path, help="the random llama-125m (made if missing)")
    p.add_argument("--output", type=Path)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model_125m = make_model(args.model_dir or Path("/tmp/pdbench/llama-125m"))
    results = {}
    print("| workload | batch | plain tok/s | ngram tok/s | speedup | acceptance | same tokens |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, (model, prompts, new) in workloads(model_125m).items():
        engines = {
            "plain": LLM(model, num_threads=args.threads, enable_prefix_caching=False),
            "ngram": LLM(model, num_threads=args.threads, enable_prefix_caching=False, **SPEC),
        }
        for e in engines.values():
            e.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=8))  # warm
        for batch in BATCHES:
            best: dict[str, dict] = {}
            for _ in range(3):  # alternated, best of three
                for key, llm in engines.items():
                    r = run(llm, prompts[:batch], new)
                    if key not in best or r["tokens_s"] > best[key]["tokens_s"]:
                        best[key] = r
            plain, spec = best["plain"], best["ngram"]
            acc = spec["accepted"] / spec["proposed"] if spec["proposed"] else 0.0
            same = plain["token_ids"] == spec["token_ids"]
            row = {"plain_tokens_s": plain["tokens_s"], "ngram_tokens_s": spec["tokens_s"],
                   "speedup": spec["tokens_s"] / plain["tokens_s"], "proposed": spec["proposed"],
                   "accepted": spec["accepted"], "acceptance": acc, "same_tokens": same}  # fmt: skip
            results[f"{name} b{batch}"] = row
            print(f"| {name} | {batch} | {plain['tokens_s']:.1f} | {spec['tokens_s']:.1f} "
                  f"| {row['speedup']:.2f}x | {acc:.0%} ({spec['accepted']}/{spec['proposed']}) "
                  f"| {same} |", flush=True)  # fmt: skip
    if args.output:
        args.output.write_text(json.dumps({"machine": machine_info(), "code": code_info(),
                                           "results": results}, indent=2))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
