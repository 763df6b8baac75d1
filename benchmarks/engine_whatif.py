"""What-if measurements for proposed engine changes, made through the model's seams in-process.

Nothing here changes pdserve's code: each variant builds one `LLM` with a linear backend, may
swap its linear layers (`replace_linears`) or give the model another attention backend
(`model.attn_backend`), then measures batch-1/8/32 decode and a 512-token prefill as
`engine_bench.py` does. Variants:

- `baseline`: the engine with `linear_backend="torch"` (`F.linear`, MKL), the reference of the
  table in docs/PERFORMANCE.md;
- `onednn`: every projection and the lm_head through oneDNN with weights prepacked once
  (`linear_backend="onednn"`, now the engine's default on CPU float32);
- `wt_layout`: weights stored transposed ([in, out], contiguous) and multiplied as `x @ w_t`;
- `kv_index_select`: decode attention gathers the KV cache with `index_select` on flat slots
  instead of advanced indexing;
- `onednn+kv_index_select`: both.

    python benchmarks/engine_whatif.py [--variants baseline,onednn] [--output whatif.json]
    python benchmarks/engine_whatif.py --quick --model-dir ../shared/models/stories260K
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's pdserve

from lib.engine_common import (  # noqa: E402
    NUM_THREADS,
    greedy,
    make_llm,
    make_model,
    model_shape,
    random_prompts,
    run_decode,
)
from lib.quiet import Quiet  # noqa: E402

from pdserve.models.attention import AttentionMetadata, PagedSDPABackend  # noqa: E402
from pdserve.models.packed_linear import replace_linears  # noqa: E402

VARIANTS = ("baseline", "onednn", "wt_layout", "kv_index_select", "onednn+kv_index_select")


# ---- variants --------------------------------------------------------------------------------
class TransposedLinear(nn.Module):
    """y = x @ W^T + b with W stored as [in, out], contiguous."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.w_t = weight.detach().t().contiguous()
        self.bias = None if bias is None else bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.w_t if self.bias is None else torch.addmm(self.bias, x, self.w_t)


class IndexSelectDecodeBackend(PagedSDPABackend):
    """The default backend with the decode gathers done by `index_select` on flat slots."""

    name = "paged_sdpa_index_select"

    def decode(
        self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        nd, num_heads, head_dim = q.shape
        num_kv_heads = kv_cache.shape[2]
        slots = meta.decode_slots  # [nd, L]
        flat = slots.reshape(-1)
        qd = q.view(nd, num_kv_heads, num_heads // num_kv_heads, head_dim)
        kd = kv_cache[0].index_select(0, flat).view(nd, slots.shape[1], num_kv_heads, head_dim)
        vd = kv_cache[1].index_select(0, flat).view(nd, slots.shape[1], num_kv_heads, head_dim)
        od = F.scaled_dot_product_attention(
            qd, kd.transpose(1, 2), vd.transpose(1, 2), attn_mask=meta.decode_mask
        )
        return od.reshape(nd, num_heads, head_dim)


def build(variant: str, model_dir: Path):
    """The variant's engine: its linear backend at load, then its layer or attention choice."""
    parts = variant.split("+")
    llm = make_llm(
        model_dir,
        enable_prefix_caching=False,
        max_num_batched_tokens=4096,
        linear_backend="onednn" if "onednn" in parts else "torch",
    )
    model = llm.engine.core.runner.model
    if "wt_layout" in parts:
        replace_linears(model, TransposedLinear)
    if "kv_index_select" in parts:
        model.attn_backend = IndexSelectDecodeBackend()
    return llm


# ---- measurement -----------------------------------------------------------------------------
def measure(
    variant: str, model_dir: Path, quiet: Quiet, output_len: int, prefill_len: int
) -> dict[str, Any]:
    shape = model_shape(model_dir)
    llm = build(variant, model_dir)
    rng = random.Random(0)
    result: dict[str, Any] = {}
    run_decode(llm, random_prompts(rng, [128], shape.vocab_size), 8)  # warm-up
    for batch in (1, 8, 32):
        prompts = random_prompts(rng, [128] * batch, shape.vocab_size)
        m = quiet.run(f"{variant} decode {batch}", lambda p=prompts: run_decode(llm, p, output_len))
        result[f"decode_b{batch}_tokens_s"] = m.value["tokens_s"]
        result[f"decode_b{batch}_token_ids"] = m.value["token_ids"]
        result[f"decode_b{batch}_foreign_cores"] = m.foreign_cores

    def prefill_s() -> float:
        out = llm.generate(random_prompts(rng, [prefill_len], shape.vocab_size), greedy(1))[0]
        return out.metrics.prefill_time

    prefill_s()
    times = [quiet.run(f"{variant} prefill {prefill_len}", prefill_s) for _ in range(3)]
    result[f"prefill_{prefill_len}_tokens_s"] = prefill_len / min(m.value for m in times)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--output-len", type=int, help="decode tokens (default 64, quick 4)")
    parser.add_argument("--output", type=Path)
    parser.add_argument("--model-dir", type=Path)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a smoke run: one try each, a 128-token prefill, no waiting for a quiet CPU",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(NUM_THREADS)
    if args.quick:
        quiet, prefill_len = Quiet(tries=1, quiet_wait_s=0, patience_s=0), 128
    else:
        quiet, prefill_len = Quiet(tries=3, quiet_wait_s=20.0, patience_s=180.0), 512
    output_len = args.output_len or (4 if args.quick else 64)
    results = {}
    with tempfile.TemporaryDirectory(prefix="pdwhatif-") as tmp:
        model_dir = make_model(args.model_dir or Path(tmp))
        for variant in args.variants.split(","):
            print(f"-- {variant}", flush=True)
            results[variant] = measure(variant, model_dir, quiet, output_len, prefill_len)
    base = results.get("baseline")
    for variant, r in results.items():
        same = ""
        if base is not None:
            same = (
                "same greedy tokens"
                if all(
                    r[f"decode_b{b}_token_ids"] == base[f"decode_b{b}_token_ids"]
                    for b in (1, 8, 32)
                )
                else "greedy tokens differ"
            )
        cells = "  ".join(
            f"{k.removesuffix('_tokens_s')} {v:7.1f}"
            + (f" ({v / base[k]:.2f}x)" if base is not None else "")
            for k, v in r.items()
            if k.endswith("_tokens_s")
        )
        print(f"{variant:<24} {cells}  {same}")
    if args.output:
        args.output.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
