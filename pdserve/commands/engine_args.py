"""Engine options shared by every command that builds an engine (`generate`, `serve`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from pdserve.config import EngineArgs


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("model")
    g.add_argument(
        "--model",
        required=True,
        help="Hugging Face model folder (config.json, safetensors, tokenizer)",
    )
    g.add_argument("--tokenizer", help="tokenizer folder (default: the model folder)")
    g.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default: cpu)")
    g.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="weights and KV cache dtype (auto: float32 on CPU, bfloat16 on CUDA)",
    )
    g.add_argument(
        "--max-model-len", type=int, help="cap the context length (default: the model's)"
    )
    g.add_argument("--seed", type=int, default=0, help="seed for unseeded sampling (default: 0)")
    g.add_argument(
        "--num-threads",
        type=int,
        help="torch CPU threads (default: one per allowed CPU that other processes leave free, "
        "measured at start and again when the load changes; see docs/ARCHITECTURE.md)",
    )
    g.add_argument(
        "--linear-backend",
        default="auto",
        choices=["auto", "onednn", "torch"],
        help="matmul kernels: oneDNN with weights prepacked at load (CPU float32; auto uses it "
        "where available) or torch's F.linear",
    )
    g.add_argument(
        "--hardware-profile",
        metavar="FILE",
        help="peak FLOP/s and bandwidth for MFU/MBU (see `pdserve profile-hardware`)",
    )

    c = parser.add_argument_group("KV cache")
    c.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default: 16)")
    c.add_argument("--kv-cache-memory", help="KV cache size, e.g. 2GiB (default: 1GiB)")
    c.add_argument(
        "--num-kv-blocks", type=int, help="KV cache size in blocks (overrides --kv-cache-memory)"
    )
    c.add_argument(
        "--no-prefix-caching",
        dest="enable_prefix_caching",
        action="store_false",
        help="turn prefix caching off",
    )

    s = parser.add_argument_group("scheduler")
    s.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=2048,
        help="token budget of one step (default: 2048)",
    )
    s.add_argument(
        "--max-num-seqs", type=int, default=64, help="most requests running at once (default: 64)"
    )
    s.add_argument(
        "--no-chunked-prefill",
        dest="enable_chunked_prefill",
        action="store_false",
        help="prefill each prompt in one step",
    )
    s.add_argument(
        "--long-prefill-token-threshold",
        type=int,
        default=0,
        help="largest prefill chunk of one request per step (0: the whole budget)",
    )


def engine_args_from(args: argparse.Namespace) -> EngineArgs:
    if not Path(args.model).is_dir():  # before anything slow is imported
        raise ValueError(f"invalid --model {args.model!r}: no such folder")
    return EngineArgs(
        model=args.model,
        tokenizer=args.tokenizer,
        device=args.device,
        dtype=args.dtype,
        seed=args.seed,
        max_model_len=args.max_model_len,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        kv_cache_memory=args.kv_cache_memory,
        enable_prefix_caching=args.enable_prefix_caching,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        enable_chunked_prefill=args.enable_chunked_prefill,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        num_threads=args.num_threads,
        hardware_profile=args.hardware_profile,
        linear_backend=args.linear_backend,
    )
