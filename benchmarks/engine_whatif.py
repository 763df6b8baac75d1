"""What-if measurements for proposed engine changes, by patching a loaded engine in-process.

Nothing here changes pdserve's code: each variant swaps a function or a module's forward on one
`LLM` instance, then measures batch-1/8/32 decode and a 512-token prefill as `engine_bench.py`
does. Variants:

- `baseline`: the engine as it is;
- `onednn`: every projection and the lm_head through oneDNN with weights prepacked once
  (`torch.ops.mkldnn._reorder_linear_weight` / `_linear_pointwise`, as Inductor's CPU freezing
  pass does) instead of `F.linear` (MKL);
- `wt_layout`: weights stored transposed ([in, out], contiguous) and multiplied as `x @ w_t`;
- `kv_index_select`: decode attention gathers the KV cache with `index_select` on flat slots
  instead of advanced indexing;
- `onednn+kv_index_select`: both.

    python benchmarks/engine_whatif.py [--variants baseline,onednn] [--output whatif.json]
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

sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine_bench import (  # noqa: E402
    NUM_THREADS,
    Quiet,
    greedy,
    make_llm,
    make_model,
    model_shape,
    random_prompts,
    run_decode,
)

import pdserve.models.llama as llama_module  # noqa: E402
from pdserve.runner import attention as attention_module  # noqa: E402

VARIANTS = ("baseline", "onednn", "wt_layout", "kv_index_select", "onednn+kv_index_select")


# ---- patches ---------------------------------------------------------------------------------
def _onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None):
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [None], "")


def patch_onednn(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, nn.Linear):
            packed = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach(), None)
            bias = None if module.bias is None else module.bias.detach()
            module.forward = lambda x, p=packed, b=bias: _onednn_linear(x, p, b)
    head = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    packed_head = torch.ops.mkldnn._reorder_linear_weight(head.detach(), None)
    model.compute_logits = lambda h: _onednn_linear(h, packed_head, None).float()


def patch_wt_layout(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, nn.Linear):
            w_t = module.weight.detach().t().contiguous()  # [in, out]
            bias = None if module.bias is None else module.bias.detach()
            module.forward = lambda x, w=w_t, b=bias: x @ w if b is None else torch.addmm(b, x, w)
    head = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    head_t = head.detach().t().contiguous()
    model.compute_logits = lambda h: (h @ head_t).float()


def paged_attention_index_select(q, k, v, kv_cache, meta):
    """`paged_attention` with the decode gathers done by `index_select` on flat slots."""
    nd = meta.num_decodes
    if not nd:
        return attention_module.paged_attention(q, k, v, kv_cache, meta)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    k_cache.index_copy_(0, meta.slot_mapping, k)
    v_cache.index_copy_(0, meta.slot_mapping, v)
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=q.dtype, device=q.device)
    slots = meta.decode_slots  # [nd, L]
    flat = slots.reshape(-1)
    qd = q[:nd].view(nd, num_kv_heads, num_heads // num_kv_heads, head_dim)
    kd = k_cache.index_select(0, flat).view(nd, slots.shape[1], num_kv_heads, head_dim)
    vd = v_cache.index_select(0, flat).view(nd, slots.shape[1], num_kv_heads, head_dim)
    od = F.scaled_dot_product_attention(
        qd, kd.transpose(1, 2), vd.transpose(1, 2), attn_mask=meta.decode_mask
    )
    out[:nd] = od.reshape(nd, num_heads, head_dim)
    if meta.prefills:  # the prefill chunks as the engine does them (writes already done)
        rest = attention_module.AttentionMetadata(
            slot_mapping=meta.slot_mapping[:0], num_decodes=0, prefills=meta.prefills
        )
        tail = attention_module.paged_attention(q, k, v, kv_cache, rest)
        out_flat = out.view(num_tokens, num_heads * head_dim)
        for chunk in meta.prefills:
            out_flat[chunk.q_start : chunk.q_end] = tail[chunk.q_start : chunk.q_end]
        return out_flat
    return out.view(num_tokens, num_heads * head_dim)


def apply(variant: str, llm) -> None:
    model = llm.engine.core.runner.model
    parts = variant.split("+")
    if "onednn" in parts:
        patch_onednn(model)
    if "wt_layout" in parts:
        patch_wt_layout(model)
    llama_module.paged_attention = (
        paged_attention_index_select
        if "kv_index_select" in parts
        else attention_module.paged_attention
    )


# ---- measurement -----------------------------------------------------------------------------
def measure(variant: str, model_dir: Path, quiet: Quiet, output_len: int) -> dict[str, Any]:
    shape = model_shape(model_dir)
    llm = make_llm(model_dir, enable_prefix_caching=False, max_num_batched_tokens=4096)
    apply(variant, llm)
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
        out = llm.generate(random_prompts(rng, [512], shape.vocab_size), greedy(1))[0]
        return out.metrics.prefill_time

    prefill_s()
    times = [quiet.run(f"{variant} prefill 512", prefill_s) for _ in range(3)]
    result["prefill_512_tokens_s"] = 512 / min(m.value for m in times)
    apply("baseline", llm)  # the module-level attention function back
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--output", type=Path)
    parser.add_argument("--model-dir", type=Path)
    args = parser.parse_args(argv)
    torch.set_num_threads(NUM_THREADS)
    quiet = Quiet(tries=3, quiet_wait_s=20.0, patience_s=180.0)
    results = {}
    with tempfile.TemporaryDirectory(prefix="pdwhatif-") as tmp:
        model_dir = make_model(args.model_dir or Path(tmp))
        for variant in args.variants.split(","):
            print(f"-- {variant}", flush=True)
            results[variant] = measure(variant, model_dir, quiet, args.output_len)
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
