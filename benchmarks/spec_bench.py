"""Speculative decoding (prompt lookup, self-speculation, a draft model) against plain decoding,
side by side in one run.

    python benchmarks/spec_bench.py [--output spec.json]      # ~12 min
    python benchmarks/spec_bench.py --workloads copy --batches 8 --methods plain,ngram
    python benchmarks/spec_bench.py --workloads stories --batches 1 --rounds 5 \
        --methods plain,self-draft,plain2       # a control: plain2 is a second plain engine

Workloads, each at batch 1, 8 and 32, greedy, outputs forced to their length, decode tokens/s
(first token to last, from the request metrics) of each method, alternated, best of three;
acceptance = accepted / proposed; each engine's forwards are timed too (plain ones and those
that verified proposals, drafting included). Methods (4 proposed tokens each, the adaptive rule
on; a trailing digit names a second engine of the same method, for controls):

- `plain`: one token per step;
- `ngram`: prompt lookup, n-grams of 2 to 4;
- `self-draft`: the model's own first layers as the draft (`--draft-layers`: 1 of 12 for the
  125m model, 2 of 5 for stories260K);
- `draft-model`: a folder holding those same first layers (written by the benchmark), run as
  a separate draft model with its own KV cache: the same proposals, so the difference to
  `self-draft` is what a draft's own cache costs.

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
import shutil
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lib.engine_common import make_model, random_prompts  # noqa: E402
from lib.machine import code_info, machine_info  # noqa: E402
from lib.paths import STORIES  # noqa: E402

from pdserve import LLM, SamplingParams  # noqa: E402

BATCHES = (1, 8, 32)
METHODS = ("plain", "ngram", "self-draft", "draft-model")


def first_layers(src: str, n: int) -> str:
    """A draft model folder with the first `n` layers of `src` (embeddings, norm and head too)."""
    dst = Path(f"/tmp/pdbench/draft-{Path(src).name}-{n}")
    if not (dst / "config.json").exists():
        shutil.copytree(
            src, dst, ignore=shutil.ignore_patterns("*.safetensors"), dirs_exist_ok=True
        )
        cfg = json.loads((dst / "config.json").read_text())
        (dst / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": n}))
        for f in Path(src).glob("*.safetensors"):
            kept = {k: v for k, v in load_file(f).items()
                    if not k.startswith("model.layers.") or int(k.split(".")[2]) < n}  # fmt: skip
            save_file(kept, dst / f.name)
    return str(dst)


def settings(method: str, model: str) -> dict:
    method = method.rstrip("0123456789")
    layers = 1 if "125m" in model else 2
    return {
        "plain": {},
        "ngram": {"speculative_method": "ngram"},
        "self-draft": {"speculative_method": "draft", "draft_layers": layers},
        "draft-model": {"speculative_method": "draft", "draft_model": first_layers(model, layers)},
    }[method]


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


class ForwardTimer:
    """Times an engine's forwards (`ModelRunner.execute`), plain and verifying apart."""

    def __init__(self, llm: LLM) -> None:
        self.plain = self.spec = 0.0
        self.num_plain = self.num_spec = 0
        runner = llm.engine.core.runner
        execute = runner.execute

        def timed(plan, block_tables):
            t0 = time.perf_counter()
            out = execute(plan, block_tables)
            dt = time.perf_counter() - t0
            if any(s.spec_tokens for s in plan.scheduled):
                self.spec, self.num_spec = self.spec + dt, self.num_spec + 1
            else:
                self.plain, self.num_plain = self.plain + dt, self.num_plain + 1
            return out

        runner.execute = timed


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
    p.add_argument("--workloads", default="stories,copy,random-125m")
    p.add_argument("--batches", default=",".join(map(str, BATCHES)))
    p.add_argument("--methods", default=",".join(METHODS), help="plain first")
    p.add_argument("--rounds", type=int, default=3, help="alternated rounds (best counts)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model_125m = make_model(args.model_dir or Path("/tmp/pdbench/llama-125m"))
    methods = args.methods.split(",")
    batches = [int(b) for b in args.batches.split(",")]
    results = {}
    others = [m for m in methods if m != "plain"]
    print("| workload | batch | plain tok/s | " + " | ".join(
        f"{m} tok/s (speedup, acceptance)" for m in others) + " | same tokens |")  # fmt: skip
    print("| --- " * (3 + len(others) + 1) + "|")
    for name, (model, prompts, new) in workloads(model_125m).items():
        if name not in args.workloads.split(","):
            continue
        engines = {m: LLM(model, num_threads=args.threads, enable_prefix_caching=False,
                          num_speculative_tokens=4, **settings(m, model)) for m in methods}  # fmt: skip
        for e in engines.values():
            e.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=8))  # warm
        timers = {m: ForwardTimer(e) for m, e in engines.items()}
        for batch in batches:
            best: dict[str, dict] = {}
            for _ in range(args.rounds):  # alternated, the best counts
                for key, llm in engines.items():
                    r = run(llm, prompts[:batch], new)
                    if key not in best or r["tokens_s"] > best[key]["tokens_s"]:
                        best[key] = r
            plain = best["plain"]
            row = {"plain_tokens_s": plain["tokens_s"]}
            cells = []
            for m in others:
                b = best[m]
                acc = b["accepted"] / b["proposed"] if b["proposed"] else 0.0
                row[m] = {"tokens_s": b["tokens_s"], "speedup": b["tokens_s"] / plain["tokens_s"],
                          "proposed": b["proposed"], "accepted": b["accepted"],
                          "acceptance": acc}  # fmt: skip
                cells.append(f"{b['tokens_s']:.1f} ({row[m]['speedup']:.2f}x, {acc:.0%} of "
                             f"{b['proposed']})")  # fmt: skip
            row["same_tokens"] = all(best[m]["token_ids"] == plain["token_ids"] for m in others)
            row["forwards"] = {m: {"plain_s": t.plain, "plain": t.num_plain, "verify_s": t.spec,
                                   "verify": t.num_spec} for m, t in timers.items()}  # fmt: skip
            for t in timers.values():
                t.plain = t.spec = 0.0
                t.num_plain = t.num_spec = 0
            results[f"{name} b{batch}"] = row
            print(f"| {name} | {batch} | {plain['tokens_s']:.1f} | " + " | ".join(cells)
                  + f" | {row['same_tokens']} |", flush=True)  # fmt: skip
            for m, f in row["forwards"].items():
                print(f"    {m}: {f['plain']} plain forwards in {f['plain_s']:.3f} s, "
                      f"{f['verify']} verifying in {f['verify_s']:.3f} s", flush=True)  # fmt: skip
    if args.output:
        args.output.write_text(json.dumps({"machine": machine_info(), "code": code_info(),
                                           "results": results}, indent=2))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
