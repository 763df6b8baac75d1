"""Decode and prefill per kernel and precision, against the roofline, HF and llama.cpp, in one run.

    python benchmarks/decode_bench.py [--llama-cpp DIR] [--output decode.json]     # ~10 min
    python benchmarks/decode_bench.py --head-to-head 6 [--llama-cpp DIR]          # ~3 min
    python benchmarks/decode_bench.py --burst-pairs 12 [--num-scheduler-steps 8]  # ~4 min

On the random llama-125m of the engine benchmarks (2 threads), for each engine configuration
(matmul kernels x attention kernels x weight precision x KV dtype): batch-1 decode tokens/s
(128-token prompt, 128 new tokens), its fraction of the read-bandwidth roofline (bytes one step
reads, as the engine counts them, over this machine's read bandwidth measured in the same
minute: the faster of a sample just before and one just after, as this machine's bandwidth moves
by up to 1.7x from one minute to the next),
decode at batch 8 and 32, and one 512-token prefill. References in the same run: Hugging Face
`generate` at batch 1 and, with `--llama-cpp DIR` (a llama.cpp source tree with `build/bin/
llama-bench` and `llama-quantize` built), llama.cpp on the same weights converted to F32, Q8_0,
Q4_0 and Q4_1 GGUF files (`lib/gguf_convert.py`, which runs llama.cpp's `convert_hf_to_gguf.py`, then
`llama-quantize`): `llama-bench` token generation of 128 tokens after a 128-token context and
prompt processing of 512 tokens, on the same threads.
Every in-process measurement waits for a quiet CPU and is retried when disturbed.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lib.engine_common import (  # noqa: E402
    BenchConfig,
    decode_rate,
    greedy,
    make_model,
    paired_decode,
    prefill_rate,
    random_prompts,
)
from lib.hf_baseline import bench_hf_decode, load_hf  # noqa: E402
from lib.machine import code_info, machine_info  # noqa: E402
from lib.quiet import Quiet  # noqa: E402

from pdserve import LLM  # noqa: E402
from pdserve.perf.hardware import measure_bandwidth  # noqa: E402

# label: engine arguments
CONFIGS = {
    "float32, F.linear + SDPA": dict(linear_backend="torch", attention_backend="sdpa"),
    "float32, oneDNN + SDPA": dict(linear_backend="onednn", attention_backend="sdpa"),
    "float32, native + SDPA": dict(linear_backend="native", attention_backend="sdpa"),
    "float32, native + native attention, eager": dict(
        linear_backend="native", attention_backend="native", enforce_eager=True
    ),
    "float32, fused decode (default)": {},
    "float32, fused decode, bursts of 8": dict(num_scheduler_steps=8),
    "int8 weights": dict(quantization="int8"),
    "int4 weights (g32)": dict(quantization="int4"),
    "int8 weights + int8 KV": dict(quantization="int8", kv_cache_dtype="int8"),
}
# Q4_1 stores what pdserve's int4 stores (a float16 scale and minimum per 32 weights); Q4_0
# (a scale only) is 10% smaller
GGUF_TYPES = {"F32": "float32, fused decode (default)", "Q8_0": "int8 weights",
              "Q4_0": "int4 weights (g32)", "Q4_1": "int4 weights (g32)"}  # fmt: skip


def measure_engine(model_dir: Path, threads: int, quiet: Quiet) -> dict:
    rng = random.Random(0)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    short = random_prompts(rng, [128] * 32, vocab)
    long = random_prompts(rng, [512], vocab)[0]
    rows = {}
    for label, kw in CONFIGS.items():
        llm = LLM(str(model_dir), num_threads=threads, enable_prefix_caching=False, **kw)
        llm.generate(short[:2], greedy(8))  # warm: kernels built, caches touched
        row: dict = {"engine_args": kw}
        for batch in (1, 8, 32):
            if batch == 1:
                before = measure_bandwidth(1.5)[0]
            m = quiet.run(
                f"{label}: decode batch {batch}",
                lambda b=batch, llm=llm: decode_rate(llm, short[:b], 128),
            )
            row[f"decode_b{batch}_tokens_s"], nbytes = m.value
            if batch == 1:  # against the bandwidth of the same minute: the faster side of it
                row["read_bandwidth"] = max(before, measure_bandwidth(1.5)[0])
                row["bytes_per_step"] = nbytes
                row["roofline_fraction"] = (
                    row["decode_b1_tokens_s"] * nbytes / row["read_bandwidth"]
                )
        row["prefill_512_tokens_s"] = quiet.run(
            f"{label}: prefill", lambda llm=llm: prefill_rate(llm, long)
        ).value
        rows[label] = row
        print(
            f"{label:44s} b1 {row['decode_b1_tokens_s']:6.1f} tok/s "
            f"({row['roofline_fraction']:.0%} of roofline, {row['bytes_per_step'] / 2**20:.0f} MiB/step) "
            f"b8 {row['decode_b8_tokens_s']:6.1f} b32 {row['decode_b32_tokens_s']:6.1f} "
            f"prefill 512 {row['prefill_512_tokens_s']:5.0f}",
            flush=True,
        )
        del llm
    return rows


def gguf_files(llama_cpp: Path, model_dir: Path) -> dict[str, Path]:
    """The model as F32, Q8_0, Q4_0 and Q4_1 GGUF files (converted once, kept next to the
    model)."""
    out = {t: model_dir.parent / f"{model_dir.name}-{t.lower()}.gguf" for t in GGUF_TYPES}
    if not out["F32"].exists():
        subprocess.run(
            [sys.executable, str(Path(__file__).parent / "lib" / "gguf_convert.py"),
             str(llama_cpp), str(model_dir), str(out["F32"])],
            check=True,
        )  # fmt: skip
    for t in (t for t in GGUF_TYPES if t != "F32"):
        if not out[t].exists():
            quantize = llama_cpp / "build" / "bin" / "llama-quantize"
            subprocess.run([str(quantize), str(out["F32"]), str(out[t]), t], check=True)
    return out


def llama_bench(llama_cpp: Path, gguf: Path, threads: int) -> dict:
    """llama-bench's tokens/s: pp512 (prompt processing from an empty context) and tg128 (token
    generation after a 128-token context, as pdserve's batch-1 decode), 3 repetitions each, and
    the read bandwidth of the same minute (the faster of a sample before and one after)."""
    exe = str(llama_cpp / "build" / "bin" / "llama-bench")
    out = {"read_bandwidth": measure_bandwidth(1.5)[0]}
    for key, test in (("prefill_512", ["-p", "512", "-n", "0"]),
                      ("decode_b1", ["-p", "0", "-n", "128", "-d", "128"])):  # fmt: skip
        cmd = [exe, "-m", str(gguf), "-t", str(threads), *test, "-r", "3", "-o", "json"]
        done = subprocess.run(cmd, capture_output=True, text=True, check=True)
        row = json.loads(done.stdout)[0]
        out[f"{key}_tokens_s"] = row["avg_ts"]
        out[f"{key}_samples"] = row.get("samples_ts")
        out[f"{key}_command"] = " ".join(cmd)
    out["read_bandwidth"] = max(out["read_bandwidth"], measure_bandwidth(1.5)[0])
    return out


def split_text(sp: dict) -> str:
    """`paired_decode`'s split in words: the native call(s) against reads of their bytes, and
    the host's time."""
    if "forward_of_read" in sp:
        calls = f"the forward (layers and head in one call) {sp['forward_of_read']:.0%}"
    else:
        calls = f"layers {sp['layers_of_read']:.0%} and head {sp['head_of_read']:.0%}"
    return f"{calls} of a read of their bytes, host {sp['host_s'] * 1e3:.2f} ms a step"


def head_to_head(
    model_dir: Path,
    llama_cpp: Path | None,
    threads: int,
    rounds: int,
    precision: str = "F32",
    split: bool = False,
    steps: int = 1,
) -> dict:
    """Batch-1 decode of the engine at `precision` (F32: the default float32 engine; Q8_0:
    int8 weights; Q4_0 and Q4_1: int4 weights) and llama.cpp's GGUF of that type, where given, alternated
    `rounds` times, a bandwidth sample before and after each, so that every figure has the
    roofline of its own minute: this machine's read bandwidth moves by up to 2x between minutes,
    more than the kernels differ. The engine's decode is also measured step by step, each step
    paired with a read of its own bytes (`paired_decode`): bandwidth that moves within seconds
    cancels there. `split` also pairs the step's native forward (the fused layers and head) with
    a read of its bytes and reports the host's time per step. `steps` > 1 also measures an
    engine with `--num-scheduler-steps steps` in every round (which goes first alternates), the
    same way, and its ratio to the engine of one step per schedule."""
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    prompt = random_prompts(random.Random(0), [128], vocab)
    engine_args = CONFIGS[GGUF_TYPES[precision]]
    llm = LLM(str(model_dir), num_threads=threads, enable_prefix_caching=False, **engine_args)
    llm.generate(prompt, greedy(8))
    base = None  # a quantized precision is also measured against float32, round by round
    if precision != "F32":
        base = LLM(str(model_dir), num_threads=threads, enable_prefix_caching=False)
        base.generate(prompt, greedy(8))
    gguf = gguf_files(llama_cpp, model_dir)[precision] if llama_cpp else None
    engines = {"pdserve": llm}
    if steps > 1:
        engines["bursts"] = LLM(str(model_dir), num_threads=threads, enable_prefix_caching=False,
                                num_scheduler_steps=steps, **engine_args)  # fmt: skip
        engines["bursts"].generate(prompt, greedy(8))
    out: dict = {"pdserve": [], "bursts": [], "llama_cpp": [], "float32": [],
                 "precision": precision, "num_scheduler_steps": steps}  # fmt: skip
    for r in range(rounds):
        line = f"round {r}:"
        for key in list(engines) if r % 2 == 0 else list(engines)[::-1]:
            bw0 = measure_bandwidth(1.5)[0]
            tok_s, nbytes = decode_rate(engines[key], prompt, 128)
            bw1 = measure_bandwidth(1.5)[0]
            paired = paired_decode(engines[key], prompt[0], 128, split=split)
            out[key].append({"tokens_s": tok_s, "bytes_per_step": nbytes,
                             "read_bandwidth": max(bw0, bw1),
                             "roofline_fraction": tok_s * nbytes / max(bw0, bw1),
                             "paired": paired})  # fmt: skip
            name = "pdserve" if key == "pdserve" else f"bursts of {steps}"
            line += (f" {name} {tok_s:.1f} tok/s ({out[key][-1]['roofline_fraction']:.0%}; paired"
                     f" step by step {paired['tokens_s']:.1f} tok/s at "
                     f"{paired['roofline_fraction']:.0%})")  # fmt: skip
            if sp := paired.get("split"):
                line += f"; {split_text(sp)}"
            line += ";"
        tok_s = out["pdserve"][-1]["tokens_s"]
        if base is not None:
            f32 = decode_rate(base, prompt, 128)[0]
            out["float32"].append({"tokens_s": f32})
            line += f", pdserve float32 {f32:.1f} ({tok_s / f32:.2f}x)"
        if gguf:
            exe = str(llama_cpp / "build" / "bin" / "llama-bench")
            cmd = [exe, "-m", str(gguf), "-t", str(threads), "-p", "0", "-n", "128", "-d", "128",
                   "-r", "2", "-o", "json"]  # fmt: skip
            ts = json.loads(subprocess.run(cmd, capture_output=True, text=True,
                                           check=True).stdout)[0]["avg_ts"]  # fmt: skip
            bw2 = measure_bandwidth(1.5)[0]
            out["llama_cpp"].append({"tokens_s": ts, "read_bandwidth": max(bw1, bw2),
                                     "roofline_fraction": ts * nbytes / max(bw1, bw2)})  # fmt: skip
            line += f", llama.cpp {ts:.1f} ({out['llama_cpp'][-1]['roofline_fraction']:.0%})"
        print(line, flush=True)
    for key in ("pdserve", "bursts", "llama_cpp"):
        if runs := out[key]:
            fr = [x["roofline_fraction"] for x in runs]
            print(f"{key}: median {statistics.median(x['tokens_s'] for x in runs):.1f} tok/s, "
                  f"median {statistics.median(fr):.0%} of the roofline (range "
                  f"{min(fr):.0%}-{max(fr):.0%})")  # fmt: skip
    for key in ("pdserve", "bursts"):
        if not (runs := out[key]):
            continue
        fr = [x["paired"]["roofline_fraction"] for x in runs]
        print(f"{key}, each step paired with a read of its bytes: median "
              f"{statistics.median(x['paired']['tokens_s'] for x in runs):.1f} tok/s, median "
              f"{statistics.median(fr):.0%} of the roofline (rounds {min(fr):.0%}-{max(fr):.0%})")  # fmt: skip
        if splits := [x["paired"]["split"] for x in runs if "split" in x["paired"]]:
            med = {k: statistics.median(sp[k] for sp in splits) for k in splits[0]}
            print(f"{key} split, median of the rounds: {split_text(med)}")
    for key, name in (("llama_cpp", "llama.cpp"), ("float32", "pdserve float32")):
        if out[key]:
            ratios = [a["tokens_s"] / b["tokens_s"] for a, b in zip(out["pdserve"], out[key])]
            print(f"pdserve {precision} / {name} per round: "
                  f"{', '.join(f'{x:.2f}x' for x in ratios)} "
                  f"(median {statistics.median(ratios):.2f}x)")  # fmt: skip
    if out["bursts"]:
        for what in ("tokens_s", "paired"):
            ratios = [(b[what]["tokens_s"] if what == "paired" else b[what])
                      / (a[what]["tokens_s"] if what == "paired" else a[what])
                      for a, b in zip(out["pdserve"], out["bursts"])]  # fmt: skip
            print(f"bursts of {steps} / one step per schedule per round ({what}): "
                  f"{', '.join(f'{x:.2f}x' for x in ratios)} "
                  f"(median {statistics.median(ratios):.2f}x)")  # fmt: skip
    return out


def burst_pairs(model_dir: Path, threads: int, steps: int, rounds: int) -> dict:
    """Decode tokens/s of the one-step engine and of one with bursts of `steps`, alternated
    back to back `rounds` times (which goes first alternates), nothing between them: batch 1
    (128 new tokens), a batch of 8 whose requests want 32-128 tokens (its bursts end where
    the shortest request ends), and an offline queue: 16 requests of 48 new tokens through 4
    sequence slots (bursts run while the others wait for a slot; each new prompt is a step of
    its own). The ratio is taken per pair."""
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    rng = random.Random(0)
    batch = random_prompts(rng, [128] * 8, vocab)
    queue = random_prompts(rng, [32, 48, 64, 80] * 4, vocab)
    lengths = [128, 32, 96, 64, 128, 48, 112, 80]
    loads = {  # name: (prompts, new tokens, max_num_seqs)
        "batch 1": (batch[:1], [128], 8),
        "batch 8": (batch, lengths, 8),
        "16 queued, 4 slots": (queue, [48] * 16, 4),
    }
    engines: dict[tuple[int, int], LLM] = {}
    out: dict = {"num_scheduler_steps": steps, "rounds": rounds}
    for name, (prompts, new, seqs) in loads.items():
        pair = {}
        for n in (1, steps):
            if (n, seqs) not in engines:
                engines[n, seqs] = LLM(str(model_dir), num_threads=threads, max_num_seqs=seqs,
                                       enable_prefix_caching=False, num_scheduler_steps=n)  # fmt: skip
            pair[n] = engines[n, seqs]
            pair[n].generate(prompts[:2], greedy(8))  # warm
        rates: dict[int, list[float]] = {n: [] for n in pair}
        for r in range(rounds):
            for n in list(pair) if r % 2 == 0 else list(pair)[::-1]:
                rates[n].append(decode_rate(pair[n], prompts, new)[0])
        ratios = [b / a for a, b in zip(rates[1], rates[steps])]
        q = statistics.quantiles(ratios, n=10) if len(ratios) > 1 else ratios * 2
        out[name] = {"one_step_tokens_s": rates[1], "bursts_tokens_s": rates[steps],
                     "ratios": ratios, "ratio_p10_p50_p90": [q[0], statistics.median(ratios),
                                                             q[-1]]}  # fmt: skip
        print(f"{name}: one step {statistics.median(rates[1]):.1f} tok/s, bursts of {steps} "
              f"{statistics.median(rates[steps]):.1f} tok/s (medians); per pair "
              f"{statistics.median(ratios):.3f}x (p10 {q[0]:.3f}, p90 {q[-1]:.3f})", flush=True)  # fmt: skip
    return out


def print_tables(rows: dict, hf: float, llama: dict, read_bw: float) -> None:
    base = rows["float32, oneDNN + SDPA"]["decode_b1_tokens_s"]
    print(f"\nread bandwidth at the start {read_bw / 1e9:.1f} GB/s")
    print("| engine | batch-1 decode tok/s | x oneDNN + SDPA | of roofline (GB/s) | MiB / step "
          "| batch 8 | batch 32 | prefill 512 tok/s |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for label, r in rows.items():
        print(f"| {label} | {r['decode_b1_tokens_s']:.1f} | {r['decode_b1_tokens_s'] / base:.2f}x "
              f"| {r['roofline_fraction']:.0%} ({r['read_bandwidth'] / 1e9:.0f}) "
              f"| {r['bytes_per_step'] / 2**20:.0f} "
              f"| {r['decode_b8_tokens_s']:.1f} | {r['decode_b32_tokens_s']:.1f} "
              f"| {r['prefill_512_tokens_s']:.0f} |")  # fmt: skip
    print(f"| HF generate, float32 | {hf:.1f} | {hf / base:.2f}x | | | | | |")
    if not llama:
        return
    print("\n| precision | llama.cpp decode (of roofline) | pdserve decode (of roofline) "
          "| pdserve / llama.cpp | llama.cpp prefill 512 | pdserve prefill 512 "
          "| pdserve / llama.cpp |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for t, lr in llama.items():
        pr = rows[GGUF_TYPES[t]]
        d, p = pr["decode_b1_tokens_s"], pr["prefill_512_tokens_s"]
        lf = lr["decode_b1_tokens_s"] * pr["bytes_per_step"] / lr["read_bandwidth"]
        print(f"| {t} | {lr['decode_b1_tokens_s']:.1f} ({lf:.0%}) | {d:.1f} "
              f"({pr['roofline_fraction']:.0%}) | {d / lr['decode_b1_tokens_s']:.2f}x "
              f"| {lr['prefill_512_tokens_s']:.0f} | {p:.0f} | {p / lr['prefill_512_tokens_s']:.2f}x |")  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--model-dir", type=Path, help="reuse (or create) the model folder here")
    p.add_argument("--llama-cpp", type=Path, help="a llama.cpp source tree with build/bin built")
    p.add_argument("--output", type=Path)
    p.add_argument("--head-to-head", type=int, metavar="ROUNDS",
                   help="only alternate batch-1 decode with llama.cpp's, ROUNDS times")  # fmt: skip
    p.add_argument("--precision", choices=tuple(GGUF_TYPES), default="F32",
                   help="the head to head's precision: F32 (float32), Q8_0 (pdserve int8), "
                   "Q4_0 or Q4_1 (pdserve int4, groups of 32; Q4_1 is its format)")  # fmt: skip
    p.add_argument("--split", action="store_true",
                   help="with --head-to-head: also pair the step's fused forward (layers and "
                   "head) with a read of its bytes, and report the host's time per step")  # fmt: skip
    p.add_argument("--num-scheduler-steps", type=int, default=1, metavar="N",
                   help="with --head-to-head: also measure an engine that runs bursts of N "
                   "decode steps per schedule, alternated with the one-step engine")  # fmt: skip
    p.add_argument("--burst-pairs", type=int, metavar="ROUNDS",
                   help="only alternate the one-step engine with bursts of "
                   "--num-scheduler-steps (default 8 here), back to back, ROUNDS times")  # fmt: skip
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = make_model(args.model_dir or Path("/tmp/pdbench/llama-125m"))
    if args.burst_pairs:
        steps = args.num_scheduler_steps if args.num_scheduler_steps > 1 else 8
        out = burst_pairs(model_dir, args.threads, steps, args.burst_pairs)
        if args.output:
            out.update(machine=machine_info(), code=code_info(), threads=args.threads)
            args.output.write_text(json.dumps(out, indent=2))
        return 0
    if args.head_to_head:
        out = head_to_head(
            model_dir,
            args.llama_cpp,
            args.threads,
            args.head_to_head,
            args.precision,
            args.split,
            args.num_scheduler_steps,
        )
        if args.output:
            out.update(machine=machine_info(), code=code_info(), threads=args.threads)
            args.output.write_text(json.dumps(out, indent=2))
        return 0
    quiet = Quiet(tries=3, quiet_wait_s=20.0, patience_s=240.0)
    samples = [quiet.run("read bandwidth", lambda: measure_bandwidth(3.0)).value[0]
               for _ in range(3)]  # fmt: skip
    read_bw = statistics.median(samples)
    print(f"read bandwidth {read_bw / 1e9:.1f} GB/s (samples "
          f"{', '.join(f'{s / 1e9:.1f}' for s in samples)}; {args.threads} threads)")  # fmt: skip
    llama = {}
    if args.llama_cpp:
        files = gguf_files(args.llama_cpp, model_dir)
        for t, f in files.items():
            llama[t] = llama_bench(args.llama_cpp, f, args.threads)
            print(f"llama.cpp {t}: decode {llama[t]['decode_b1_tokens_s']:.1f} tok/s, "
                  f"prefill 512 {llama[t]['prefill_512_tokens_s']:.0f} tok/s", flush=True)  # fmt: skip
    rows = measure_engine(model_dir, args.threads, quiet)
    cfg = BenchConfig(decode_prompt_len=128, decode_output_len=128)
    hf = bench_hf_decode(
        cfg,
        quiet,
        load_hf(model_dir),
        random_prompts(
            random.Random(0),
            [128],
            json.loads((model_dir / "config.json").read_text())["vocab_size"],
        )[0],
    )
    print_tables(rows, hf["tokens_s"], llama, read_bw)
    if args.output:
        out = {"machine": machine_info(), "code": code_info(), "threads": args.threads,
               "read_bandwidth": read_bw, "read_bandwidth_samples": samples, "engine": rows,
               "hf_decode_b1_tokens_s": hf["tokens_s"], "llama_cpp": llama,
               "quiet_log": quiet.log}  # fmt: skip
        args.output.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
