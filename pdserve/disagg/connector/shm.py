"""The `shm` KV transport (one host): the decode worker's cache lives in a shared-memory file.

The decode worker allocates its KV cache in a file private to the user (0600, in the deployment's
0700 directory); each prefill worker maps that file and copies rows straight into the decode
worker's blocks: one copy per stretch of slots that is contiguous on both sides, or a gather and a
scatter when the stretches are short (block tables scattered over the caches).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch

from pdserve.disagg.connector.base import CacheFactory, LayerJob, Send
from pdserve.disagg.protocol import KVLayout, PeerEndpoint
from pdserve.ipc.channel import private_file
from pdserve.types import KVTransportKind


def shm_cache_factory(path_holder: list[str], directory: str | None = None) -> CacheFactory:
    """A KV cache allocator backed by a file private to this user, in `directory` or the
    deployment's shared-memory directory."""

    def make(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        numel = int(np.prod(shape))
        size = numel * torch.empty((), dtype=dtype).element_size()
        path = private_file(directory, "kv", size)
        path_holder.append(path)
        return torch.from_file(path, shared=True, size=numel, dtype=dtype).view(shape)

    return make


def map_shm_cache(path: str, layout: KVLayout, dtype: torch.dtype) -> torch.Tensor:
    """Map a decode worker's whole cache file. Its slot count is the decode worker's own (pools
    may size their caches differently), so it comes from the file's size, never from ours."""
    row = layout.num_layers * 2 * layout.num_kv_heads * layout.row_width
    itemsize = torch.empty((), dtype=dtype).element_size()
    size = os.path.getsize(path)
    if size == 0 or size % (row * itemsize):
        raise ValueError(f"{path}: {size} bytes is not a whole KV cache of {layout}")
    num_slots = size // (row * itemsize)
    shape = (layout.num_layers, 2, num_slots, layout.num_kv_heads, layout.row_width)
    return torch.from_file(path, shared=True, size=size // itemsize, dtype=dtype).view(shape)


@dataclass
class ShmPeer:
    cache: torch.Tensor  # the decode worker's whole cache, mapped here

    def write_layer(self, job: LayerJob, layer: int, own: torch.Tensor, send: Send) -> None:
        target = self.cache[layer]
        if job.runs is not None:  # long stretches: copy them in place
            for s0, d0, n in job.runs:
                target[:, d0 : d0 + n].copy_(own[:, s0 : s0 + n])
        else:  # scattered slots: gather here, scatter there
            target.index_copy_(1, job.dst, own.index_select(1, job.src))


class ShmTransport:
    kind = KVTransportKind.SHM

    def cache_factory(self, paths: list[str]) -> CacheFactory:
        return shm_cache_factory(paths)

    def open_peer(self, endpoint: PeerEndpoint, own: list[torch.Tensor]) -> ShmPeer:
        if not endpoint.shm_path:
            raise ValueError(f"decode worker {endpoint.worker_id} offers no shared-memory cache")
        return ShmPeer(map_shm_cache(endpoint.shm_path, endpoint.layout, own[0].dtype))
