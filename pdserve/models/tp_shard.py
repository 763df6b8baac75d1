"""One rank's shard of a tensor-parallel model: its shape and its part of each checkpoint tensor.

Megatron's split: q/k/v and gate/up by output rows (whole heads), o_proj and down_proj by input
columns (their outputs are partial sums, added over the ranks by an all-reduce); everything
else whole. The ranks and their collectives are `pdserve.runner.tensor_parallel`.
"""

from __future__ import annotations

import dataclasses

import torch

from pdserve.config import ModelConfig


def shard_config(cfg: ModelConfig, size: int) -> ModelConfig:
    """The shape of one rank's shard; ValueError when the model does not split `size` ways."""
    for name in ("num_heads", "num_kv_heads", "intermediate_size"):
        if getattr(cfg, name) % size:
            raise ValueError(
                f"invalid tensor_parallel_size={size}: the model's {name}={getattr(cfg, name)} "
                f"does not divide by it"
            )
    return dataclasses.replace(
        cfg,
        num_heads=cfg.num_heads // size,
        num_kv_heads=cfg.num_kv_heads // size,
        intermediate_size=cfg.intermediate_size // size,
    )


def shard_of(name: str, tensor: torch.Tensor, shard: ModelConfig, rank: int) -> torch.Tensor:
    """Rank `rank`'s part of checkpoint tensor `name`, for a model of shape `shard`."""
    d = shard.head_dim
    by_rows = {"q_proj": shard.num_heads * d, "k_proj": shard.num_kv_heads * d,
               "v_proj": shard.num_kv_heads * d, "gate_proj": shard.intermediate_size,
               "up_proj": shard.intermediate_size}  # fmt: skip
    by_columns = {"o_proj": shard.num_heads * d, "down_proj": shard.intermediate_size}
    for frag, n in by_rows.items():
        if f".{frag}." in name:
            return tensor.narrow(0, rank * n, n)
    for frag, n in by_columns.items():
        if f".{frag}." in name and name.endswith(".weight"):
            return tensor.narrow(1, rank * n, n)
    return tensor
