"""Moves whole blocks between the model runner's KV cache tensors and the offload tiers.

A block's payload is its rows in every layer, `[layers, 2 (K, V), block_size * kv_heads * row]`
of the cache's dtype, as bytes. `sync` runs after scheduling and before the forward: first the
blocks the pool evicted are copied out (one `index_select` per layer, then one transpose copy
into per-block payloads; the store thread does the rest), then the blocks fetched from a tier are
copied into their new pool blocks (one `index_copy_` per layer). The only other offload work
on the step's path is reading the blocks that the tier's thread did not read ahead in time
(while scheduling, `KVCacheManager.get_computed_blocks`).
"""

from __future__ import annotations

import os
import time

import numpy as np
import torch

from pdserve.disagg.connector.base import layout_of
from pdserve.ipc.channel import SHM_DIR_ENV
from pdserve.kv.manager import KVCacheManager, KVTransfers
from pdserve.kv.offload.disk import DiskTier
from pdserve.kv.offload.entry import fingerprint, weights_digest
from pdserve.kv.offload.host import HostTier
from pdserve.kv.offload.spec import parse_tiers
from pdserve.kv.offload.stack import TierStack


def tier_fingerprint(core, weights: str = "") -> bytes:
    """Everything that decides a block's bytes apart from its tokens (see `kv/offload/entry`)."""
    a = core.args
    layout = layout_of(core)
    quant = f"quantization={a.quantization}/{a.quantization_group_size}"
    if a.quantization == "int4":  # the weights' rounding: calibrated (whole model) or nearest
        calibrated = a.quantization_calibration_tokens if a.tensor_parallel_size == 1 else 0
        quant += f"/minima/calibration={calibrated}"
    return fingerprint(
        "pdserve-kv-tier-1",
        repr(sorted((k, getattr(layout, k)) for k in layout.__struct_fields__)),
        f"row={core.runner.kv_row_width}",
        f"dtype={core.runner.dtype}",
        quant,
        # a split engine's payload is every rank's rows, rank by rank: another layout
        *([f"tp={a.tensor_parallel_size}"] if a.tensor_parallel_size > 1 else []),
        weights,
    )


def build_stack(core) -> TierStack | None:
    """The engine's tier stack from `--kv-offload`, or None."""
    specs = parse_tiers(core.args.kv_offload)
    if not specs:
        return None
    payload = core.runner.kv_bytes_per_block * core.args.tensor_parallel_size  # every rank's
    tiers = []
    for spec in specs:
        if spec.kind == "cpu":
            fp = tier_fingerprint(core)
            shared = os.environ.get(SHM_DIR_ENV)  # a server's workers share one arena
            path = os.path.join(shared, f"kvtier-{fp.hex()[:24]}") if shared else None
            tiers.append(HostTier(spec.capacity_bytes, payload, fp, path))
        else:
            os.makedirs(spec.path, mode=0o700, exist_ok=True)
            fp = tier_fingerprint(core, weights_digest(core.args.model, spec.path))
            tiers.append(DiskTier(spec.path, spec.capacity_bytes, payload, fp))
    return TierStack(
        tiers,
        payload,
        core.runner.block_size,
        always_reload=core.args.kv_offload_reload == "always",
    )


class BlockMover:
    """One rank's side of the copies; with tensor parallelism (`tp`, rank 0's group) a tier's
    payload is every rank's rows of the block, rank 0's first (`TensorParallel.save_blocks`),
    and the followers run the same mover on their caches."""

    def __init__(
        self, kv_caches: list[torch.Tensor], num_blocks: int, stack: TierStack | None, tp=None
    ) -> None:
        # per layer [2, num_blocks, block elements]: a block is one contiguous run per K and V
        self.layers = [c.view(2, num_blocks, -1) for c in kv_caches]
        self.stack = stack
        self.tp = tp
        self.dtype = kv_caches[0].dtype
        self.device = kv_caches[0].device
        self.payload_bytes = len(self.layers) * 2 * self.layers[0].shape[-1] * self.dtype.itemsize

    def sync(self, kv: KVCacheManager) -> None:
        transfers: KVTransfers = kv.take_transfers()
        if not transfers:
            return
        t0 = time.perf_counter()
        save = [(b, h) for b, h in transfers.save if not self.stack.holds(h)]
        if save:
            ids = torch.tensor([b for b, _ in save], device=self.device)
            rows = self.gather(ids)
            if self.tp is not None:
                rows = self.tp.save_blocks(ids, rows)
            self.stack.save([h for _, h in save], rows)
        if transfers.load:
            ids = torch.tensor([b for b, _ in transfers.load], device=self.device)
            rows = np.stack([p for _, p in transfers.load])
            if self.tp is not None:
                rows = self.tp.load_blocks(ids, rows)
            self.scatter(ids, rows)
        self.stack.copy_s += time.perf_counter() - t0

    def gather(self, ids: torch.Tensor) -> np.ndarray:
        """[n, payload bytes]: each row one block's payload (this rank's rows)."""
        n, width = ids.numel(), self.layers[0].shape[-1]
        stage = torch.empty((len(self.layers), 2, n, width), dtype=self.dtype, device=self.device)
        for layer, out in zip(self.layers, stage):
            torch.index_select(layer, 1, ids, out=out)
        blocks = stage.permute(2, 0, 1, 3).contiguous().cpu()  # [n, layers, 2, width]
        return blocks.view(torch.uint8).view(n, -1).numpy()

    def scatter(self, ids: torch.Tensor, rows: np.ndarray) -> None:
        """Writes the payloads `rows` [n, payload bytes] at blocks `ids`."""
        n, width = ids.numel(), self.layers[0].shape[-1]
        data = torch.from_numpy(np.ascontiguousarray(rows)).view(self.dtype)
        blocks = data.view(n, len(self.layers), 2, width).to(self.device)
        for i, layer in enumerate(self.layers):
            layer.index_copy_(1, ids, blocks[:, i].transpose(0, 1))
