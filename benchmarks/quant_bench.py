"""Weight-only quantization on the CPU: decode and prefill per precision, side by side in one run.

    python benchmarks/quant_bench.py [--threads 2] [--output quant.json]     # ~5 min

On the random llama-125m (the engine benchmarks' model), for float32 (the default kernels),
int8 and int4 (groups of 32) weights: batch-1 decode tokens/s (128-token prompt, 128 new
tokens), decode at batch 8 and 32, and one 512-token prefill; the bytes one decode step reads
(the engine's accounting: weights as stored, KV) and the bandwidth roofline they allow at this
machine's measured read bandwidth; and Hugging Face `generate` at batch 1 (float32) as the
outside reference. Every measurement waits for a quiet CPU and is retried when disturbed.

Kernels (`--kernels`, a minute): each matrix product alone at the llama-125m shapes (a 3072x768
projection, the 32000x768 output head) for 1, 16 and 256 activation rows: float32 (pdserve's
native panels), int8 and int4 (pdserve's kernels, AVX-512 VNNI where present), each weight hot in
the cache (the same matrix again) and cold (a different copy each call, so the bytes come from
memory as in a decode step: copies of 96 MB in all), ms per call and GB/s of the weight's
stored bytes.

Quality (`--quality`, seconds): on the trained stories260K, the perplexity of its reference story
(../shared/models/README.md) and of three held-out stories under each precision (int4 at group
sizes 32 and 128, calibrated at load as by default, and at 32 rounded to nearest; the int8 KV
cache alone and with int8 weights) against float32; the perplexity of 32 stories of 256 tokens
the float model samples (seeds 10000-10031, pooled: a steadier measure than four short texts,
where one valid rounding and another differ by several points); and where 128 greedy tokens
first leave float32's.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lib.engine_common import (  # noqa: E402
    BenchConfig,
    decode_rate,
    greedy,
    make_model,
    prefill_rate,
    random_prompts,
)
from lib.hf_baseline import bench_hf_decode, load_hf  # noqa: E402
from lib.machine import code_info, machine_info  # noqa: E402
from lib.quiet import Quiet  # noqa: E402

from pdserve import LLM  # noqa: E402
from pdserve.perf.hardware import measure_bandwidth  # noqa: E402

PRECISIONS = ("none", "int8", "int4")
STORIES = Path(__file__).resolve().parents[2] / "shared" / "models" / "stories260K"
HELD_OUT = [  # the held-out stories of tests/conftest.py (written for this check, not training data)
    "Tom had a small dog named Max. Every morning they walked to the river. One day Max found "
    "a shiny stone and gave it to Tom. Tom was very happy and said thank you.",
    "Sue liked to bake cakes with her mom. They put sugar, eggs and milk in a big bowl. The "
    "cake was warm and sweet, and Sue shared it with her friends.",
    "A little bird could not fly. It sat in a tree and felt sad. A kind boy came and helped "
    "the bird. Soon the bird was strong and flew up high in the sky.",
]


def quality() -> dict:
    import math
    import re

    from pdserve import SamplingParams

    readme = (STORIES.parent / "README.md").read_text()
    texts = [re.search(r"```\n(.*?)\n```", readme, re.S).group(1), *HELD_OUT]

    def ppl(llm, text):
        out = llm.generate([text], SamplingParams(max_tokens=0, prompt_logprobs=0))[0]
        lps = [lp.logprob for lp in out.prompt_logprobs[1:]]
        return math.exp(-sum(lps) / len(lps))

    def pooled_ppl(llm, stories):
        outs = llm.generate(stories, SamplingParams(max_tokens=0, prompt_logprobs=0))
        lps = [lp.logprob for o in outs for lp in o.prompt_logprobs[1:]]
        return math.exp(-sum(lps) / len(lps))

    sampler = LLM(str(STORIES))
    bos = sampler.engine.core.model_config.bos_token_id
    outs = sampler.generate(
        [[bos]] * 32,
        [SamplingParams(max_tokens=255, temperature=1.0, seed=s, ignore_eos=True)
         for s in range(10000, 10032)],
    )  # fmt: skip
    sampled = [[bos, *o.outputs[0].token_ids] for o in outs]
    params = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)
    prompt = "Once upon a time, there was a little"
    results = {}
    for name, kw in [("float32", {}), ("int8", {"quantization": "int8"}),
                     ("int4 g32", {"quantization": "int4", "quantization_group_size": 32}),
                     ("int4 g128", {"quantization": "int4", "quantization_group_size": 128}),
                     ("int4 g32, nearest", {"quantization": "int4",
                                            "quantization_calibration_tokens": 0}),
                     ("int8 KV", {"kv_cache_dtype": "int8"}),
                     ("int8 + int8 KV", {"quantization": "int8", "kv_cache_dtype": "int8"})]:  # fmt: skip
        llm = LLM(str(STORIES), **kw)
        tokens = llm.generate([prompt], params)[0].outputs[0].token_ids
        results[name] = {
            "ppl": [ppl(llm, t) for t in texts] + [pooled_ppl(llm, sampled)],
            "greedy": tokens,
        }
    base = results["float32"]
    print(
        "| weights | reference story | held-out 1 | held-out 2 | held-out 3 | sampled 32 x 256 "
        "| greedy: first difference |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, r in results.items():
        cells = [f"{p:.3f} ({p / b - 1:+.1%})" for p, b in zip(r["ppl"], base["ppl"])]
        diff = next(
            (i for i, (a, b) in enumerate(zip(r["greedy"], base["greedy"])) if a != b), None
        )
        print(
            f"| {name} | {' | '.join(cells)} | {'none in 128' if diff is None else f'token {diff}'} |"
        )
    return results


def kernels(threads: int) -> dict:
    import time

    from pdserve.kernels import linear as native
    from pdserve.models.packed_linear import NativeLinear
    from pdserve.models.quant_linear import Int4Linear, Int8Linear

    torch.set_num_threads(threads)
    print(f"VNNI: {native.vnni()}; {threads} threads; read bandwidth "
          f"{measure_bandwidth(1.0)[0] / 1e9:.1f} GB/s")  # fmt: skip
    print("| kernel | shape | rows | hot ms | hot GB/s | cold ms | cold GB/s |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    makers = {"float32 (native)": lambda w: NativeLinear(w, None), "int8": Int8Linear,
              "int4 g32": lambda w: Int4Linear(w, group_size=32)}  # fmt: skip
    out = {}
    for n, k in ((3072, 768), (32000, 768)):
        for name, make in makers.items():

            def weight(seed, n=n, k=k):
                return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05

            first = make(weight(0))
            nbytes = first.w.numel() * 4 if name.startswith("float32") else first.nbytes
            # copies of 96 MB in all, three times the L3 cache of the machines seen
            copies = [first, *(make(weight(i)) for i in range(1, max(2, 96_000_000 // nbytes)))]
            for rows in (1, 16, 256):
                x = torch.randn(rows, k)
                reps = max(3, min(200, int(3e8 / (n * k * rows))))
                first(x)
                t0 = time.perf_counter()
                for _ in range(reps):
                    first(x)
                hot = (time.perf_counter() - t0) / reps
                for layer in copies:  # the first call after a pause wakes the threads
                    layer(x)
                t0 = time.perf_counter()
                for layer in copies:
                    layer(x)
                cold = (time.perf_counter() - t0) / len(copies)
                out[f"{name} {n}x{k} {rows}"] = {"hot_s": hot, "cold_s": cold, "bytes": nbytes}
                print(f"| {name} | {n}x{k} | {rows} | {hot * 1e3:.3f} | {nbytes / hot / 1e9:.1f} "
                      f"| {cold * 1e3:.3f} | {nbytes / cold / 1e9:.1f} |", flush=True)  # fmt: skip
            del copies
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--model-dir", type=Path, help="reuse (or create) the model folder here")
    p.add_argument("--output", type=Path)
    p.add_argument("--quality", action="store_true", help="only the quality check on stories260K")
    p.add_argument("--kernels", action="store_true", help="only the matrix products, one by one")
    args = p.parse_args()
    if args.quality:
        quality()
        return 0
    if args.kernels:
        kernels(args.threads)
        return 0
    torch.set_num_threads(args.threads)
    model_dir = make_model(args.model_dir or Path("/tmp/pdbench/llama-125m"))
    quiet = Quiet(tries=3, quiet_wait_s=20.0, patience_s=180.0)
    rng = random.Random(0)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    short = random_prompts(rng, [128] * 32, vocab)
    long = random_prompts(rng, [512], vocab)[0]

    read_bw, _ = quiet.run("read bandwidth", lambda: measure_bandwidth(3.0)).value
    print(f"read bandwidth {read_bw / 1e9:.1f} GB/s ({args.threads} threads)")
    rows = {}
    for q in PRECISIONS:
        llm = LLM(
            str(model_dir), num_threads=args.threads, quantization=q, enable_prefix_caching=False
        )
        llm.generate(short[:2], greedy(8))  # warm: kernels built, caches touched
        row = {}
        for batch in (1, 8, 32):
            m = quiet.run(
                f"{q} decode batch {batch}",
                lambda b=batch, llm=llm: decode_rate(llm, short[:b], 128),
            )
            row[f"decode_b{batch}_tokens_s"], nbytes = m.value
            if batch == 1:
                row["bytes_per_step"] = nbytes
                row["roofline_tokens_s"] = read_bw / nbytes
                row["roofline_fraction"] = row["decode_b1_tokens_s"] / row["roofline_tokens_s"]
        row["prefill_512_tokens_s"] = quiet.run(
            f"{q} prefill", lambda llm=llm: prefill_rate(llm, long)
        ).value
        rows[q] = row
        print(
            f"{q:5s} batch-1 decode {row['decode_b1_tokens_s']:6.1f} tok/s "
            f"({row['roofline_fraction']:.0%} of {row['roofline_tokens_s']:.1f}, "
            f"{row['bytes_per_step'] / 2**20:.0f} MiB/step) | b8 {row['decode_b8_tokens_s']:.1f} "
            f"| b32 {row['decode_b32_tokens_s']:.1f} | prefill 512: {row['prefill_512_tokens_s']:.0f} tok/s",
            flush=True,
        )
    cfg = BenchConfig(decode_prompt_len=128, decode_output_len=128)
    hf = bench_hf_decode(cfg, quiet, load_hf(model_dir), short[0])["tokens_s"]
    print(f"HF generate batch-1 decode (float32): {hf:.1f} tok/s")
    base = rows["none"]
    print(
        "\n| weights | batch-1 decode tok/s | x float32 | of roofline | MiB / step | batch 8 | batch 32 | prefill 512 tok/s |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for q, r in rows.items():
        name = {"none": "float32 (native)", "int8": "int8", "int4": "int4 (g32)"}[q]
        print(
            f"| {name} | {r['decode_b1_tokens_s']:.1f} | {r['decode_b1_tokens_s'] / base['decode_b1_tokens_s']:.2f}x "
            f"| {r['roofline_fraction']:.0%} | {r['bytes_per_step'] / 2**20:.0f} | {r['decode_b8_tokens_s']:.1f} "
            f"| {r['decode_b32_tokens_s']:.1f} | {r['prefill_512_tokens_s']:.0f} |"
        )
    print(f"| HF generate, float32 | {hf:.1f} | {hf / base['decode_b1_tokens_s']:.2f}x | | | | | |")
    if args.output:
        out = {"machine": machine_info(), "code": code_info(), "threads": args.threads,
               "read_bandwidth": read_bw, "precisions": rows, "hf_decode_b1_tokens_s": hf,
               "quiet_log": quiet.log}  # fmt: skip
        args.output.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
