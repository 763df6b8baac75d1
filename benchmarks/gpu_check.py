"""The GPU check: pdserve on a CUDA device, colocated and split, in one short run.

    python benchmarks/gpu_check.py --output gpu.json            # on a machine with a GPU
    python benchmarks/gpu_check.py --device cpu --output x.json # the same checks on the CPU

Made to run once when a GPU machine is lent (`benchmarks/gpu_check.sh` prepares that machine and
calls this); on the CPU it runs the same steps, which is how the script itself is tested. Each
check is recorded (passed or not, its figures, its error) and the script goes on past a failure:

1. `pytest -m gpu`: the KV connector with its caches on the device (rows through pinned memory
   on the `tcp` stream; `shm` as CUDA IPC between two processes). Skipped with `--device cpu`.
2. Greedy tokens of pdserve's offline engine against transformers' `generate`, on the same
   device and weights, float32: every prompt's tokens must agree.
3. `pdserve serve --device D` colocated, then 1 prefill + 1 decode worker over `shm` (CUDA IPC
   on a GPU) and over `tcp` (rows staged through pinned memory): the same prompts at once,
   greedy; every deployment's texts must equal the colocated ones, and the split ones must
   have moved KV by the expected path (`pdserve_kv_transfer_bytes_total`). Wall time and output
   tokens/s are recorded for each (a first look, not a benchmark: one run, small model).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
import traceback
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lib.machine import code_info, machine_info  # noqa: E402
from lib.server import Server, metric_sums  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = [
    "Once upon a time, there was a little girl named",
    "The dog ran to the park and",
    "Tom and Sue wanted to play, but",
    "One day a big fish swam up to the",
    "The sun was hot, so the children",
    "Lily saw a red ball under the tree. She",
    "In a small town there lived a",
    "The cat did not like the rain because",
]


def run_check(results: dict, name: str, fn, *args) -> None:
    t0 = time.perf_counter()
    try:
        entry = fn(*args)
    except Exception as e:  # recorded; the other checks still run
        entry = {"passed": False, "error": f"{type(e).__name__}: {e}",
                 "traceback": traceback.format_exc()[-4000:]}  # fmt: skip
    entry["seconds"] = round(time.perf_counter() - t0, 1)
    results["checks"][name] = entry
    print(f"{name}: {'PASSED' if entry.get('passed') else 'FAILED'} "
          f"({entry['seconds']} s) {entry.get('error', '')}", flush=True)  # fmt: skip


def check_pytest() -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-m", "gpu", "-p", "no:cacheprovider",
         "tests/unit/test_kv_connector.py"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    tail = (proc.stdout + proc.stderr)[-3000:]
    # every gpu test must have run: a skip on a GPU machine is a failure here
    return {"passed": proc.returncode == 0 and "skipped" not in tail, "output": tail}


def token_prompts(model_dir: str) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    return [tok(p)["input_ids"] for p in PROMPTS]


def check_vs_transformers(model_dir: str, device: str, new_tokens: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from pdserve.engine.llm import LLM
    from pdserve.types import SamplingParams

    prompts = token_prompts(model_dir)
    llm = LLM(model_dir, device=device, dtype="float32")
    try:
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=new_tokens,
                                                    ignore_eos=True))  # fmt: skip
        ours = [list(o.outputs[0].token_ids) for o in outs]
    finally:
        llm.close()
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    theirs = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p], device=device)
            out = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                              pad_token_id=0)  # fmt: skip
            theirs.append(out[0, len(p) :].tolist())
    del hf
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    diverge = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None)
               for x, y in zip(ours, theirs)]  # fmt: skip
    return {"passed": ours == theirs, "prompts": len(prompts), "new_tokens": new_tokens,
            "first_divergence": diverge}  # fmt: skip


async def _complete_all(base_url: str, model: str, max_tokens: int) -> tuple[list[str], float, int]:
    async with httpx.AsyncClient(base_url=base_url, timeout=300, trust_env=False) as client:

        async def one(prompt: str) -> dict:
            r = await client.post("/v1/completions", json={
                "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                "ignore_eos": True})  # fmt: skip
            r.raise_for_status()
            return r.json()

        t0 = time.perf_counter()
        bodies = await asyncio.gather(*(one(p) for p in PROMPTS))
        wall = time.perf_counter() - t0
    texts = [b["choices"][0]["text"] for b in bodies]
    return texts, wall, sum(b["usage"]["completion_tokens"] for b in bodies)


DEPLOYMENTS = {
    "colocated": [],
    "1p1d-shm": ["--prefill-workers", "1", "--decode-workers", "1", "--kv-transport", "shm"],
    "1p1d-tcp": ["--prefill-workers", "1", "--decode-workers", "1", "--kv-transport", "tcp"],
}


def check_serving(model_dir: str, device: str, max_tokens: int, logs: Path) -> dict:
    runs, reference = {}, None
    for name, extra in DEPLOYMENTS.items():
        args = ["--model", model_dir, "--device", device, "--dtype", "float32", *extra]
        run: dict = {"command": "pdserve serve " + " ".join(args)}
        runs[name] = run
        try:
            with Server(args, logs / f"{name}.log", timeout_s=300) as server:
                model = httpx.get(server.base_url + "/v1/models", trust_env=False).json()
                texts, wall, tokens = asyncio.run(
                    _complete_all(server.base_url, model["data"][0]["id"], max_tokens)
                )
                moved = metric_sums(server.metrics(), "pdserve_kv_transfer_bytes_total")
        except Exception as e:
            run.update(passed=False, error=f"{type(e).__name__}: {e}")
            log = logs / f"{name}.log"
            run["log_tail"] = log.read_text()[-3000:] if log.exists() else ""
            continue
        reference = texts if name == "colocated" else reference
        path = name.rpartition("-")[2] if name != "colocated" else None
        by_path = {k: v for k, v in moved.items() if v}
        run.update(
            wall_s=round(wall, 3), output_tokens=tokens, output_tokens_s=round(tokens / wall, 1),
            kv_bytes_by_path=by_path, same_texts_as_colocated=texts == reference,
            passed=texts == reference and (path is None or any(path in k for k in by_path)),
        )  # fmt: skip
    return {"passed": all(r.get("passed") for r in runs.values()), "runs": runs,
            "texts": reference}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument(
        "--model",
        default=str(ROOT.parent / "shared/models/stories260K"),
        help="a small trained model folder (carried to a GPU machine)",
    )
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--output", required=True)
    a = p.parse_args()
    import torch

    results: dict = {"device": a.device, "machine": machine_info(), "code": code_info(),
                     "torch": torch.__version__, "checks": {}}  # fmt: skip
    if a.device.startswith("cuda"):
        results["gpu"] = torch.cuda.get_device_name() if torch.cuda.is_available() else None
        run_check(results, "pytest_gpu", check_pytest)
    run_check(results, "vs_transformers", check_vs_transformers, a.model, a.device, a.new_tokens)
    logs = Path(a.output).resolve().parent  # the servers' logs go beside the results
    run_check(results, "serving", check_serving, a.model, a.device, a.new_tokens, logs)
    results["passed"] = all(c.get("passed") for c in results["checks"].values())
    Path(a.output).write_text(json.dumps(results, indent=2))
    print(f"all passed: {results['passed']}; written to {a.output}")


if __name__ == "__main__":
    main()
