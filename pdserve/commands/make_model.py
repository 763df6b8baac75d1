"""`pdserve make-model`: write a random-weight Hugging Face model folder from a preset."""

from __future__ import annotations

import argparse
import time

from pdserve.models.presets import ARCHITECTURES, PRESETS

HELP = "write a random-weight Hugging Face model folder (for tests and benchmarks)"

# CLI flag dest -> HF config field
_OVERRIDES = {
    "layers": "num_hidden_layers",
    "hidden_size": "hidden_size",
    "intermediate_size": "intermediate_size",
    "vocab_size": "vocab_size",
    "max_position_embeddings": "max_position_embeddings",
    "tie": "tie_word_embeddings",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("out_dir", metavar="OUT", help="folder to write (created if missing)")
    parser.add_argument(
        "--arch", choices=list(ARCHITECTURES), help="alone: that arch's tiny preset"
    )
    parser.add_argument("--preset", choices=list(PRESETS), help="model shape (implies the arch)")
    parser.add_argument("--layers", type=int, help="num_hidden_layers")
    parser.add_argument("--hidden-size", type=int)
    parser.add_argument("--intermediate-size", type=int)
    parser.add_argument("--vocab-size", type=int, help="also the tokenizer's size (>= 260)")
    parser.add_argument("--max-position-embeddings", type=int)
    parser.add_argument(
        "--tie",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="tie lm_head to the input embedding (default: the preset's)",
    )
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--max-shard-size", help="split the weights into shards of at most this size, e.g. 2GB"
    )


def run(args: argparse.Namespace) -> int:
    from pdserve.models.make import build_config, tensor_specs, write_random_model

    overrides = {
        field: getattr(args, dest)
        for dest, field in _OVERRIDES.items()
        if getattr(args, dest) is not None
    }
    start = time.perf_counter()
    out = write_random_model(
        args.out_dir,
        args.preset,
        arch=args.arch,
        dtype=args.dtype,
        seed=args.seed,
        max_shard_size=args.max_shard_size,
        **overrides,
    )
    config = build_config(args.preset, arch=args.arch, dtype=args.dtype, **overrides)
    num_params = sum(spec.numel for spec in tensor_specs(config))
    elapsed_s = time.perf_counter() - start
    print(
        f"wrote {config['architectures'][0]} ({num_params / 1e6:.1f}M params, "
        f"{config['torch_dtype']}) to {out} in {elapsed_s:.1f} s"
    )
    return 0
