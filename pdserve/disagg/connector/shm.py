"""The `shm` KV transport (one host): prefill workers write into the decode worker's cache itself.

On the CPU the decode worker allocates its KV cache in a file private to the user (0600, in the
deployment's 0700 directory); each prefill worker maps that file and copies rows straight into the
decode worker's blocks: one copy per stretch of slots that is contiguous on both sides, or a
gather and a scatter when the stretches are short (block tables scattered over the caches). A
tensor-parallel decode worker has one such file per rank, each with its share of the KV heads,
and the prefill worker writes each rank's heads into its file. On a GPU the cache stays in device
memory and its owner offers a CUDA IPC handle instead of a file (`cuda_ipc.py`); the prefill
worker opens it and the same copies run device to device.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

import numpy as np
import torch

from pdserve.disagg.connector.base import CacheFactory, LayerJob, Send
from pdserve.disagg.connector.cuda_ipc import map_cuda_cache
from pdserve.disagg.connector.device import to_device
from pdserve.disagg.protocol import KVLayout, PeerEndpoint
from pdserve.ipc.channel import private_file
from pdserve.types import KVTransportKind


def host_identity() -> str:
    """This host, as workers compare it before mapping each other's files: its name and the
    kernel's boot id (two containers of one name on different machines differ in the latter)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def reachable(endpoint: PeerEndpoint) -> bool:
    """Whether this process can map the decode worker's cache: same host, and its files there
    (or, for a cache on a GPU, CUDA here)."""
    if endpoint.host != host_identity():
        return False
    if endpoint.cuda_ipc:
        return torch.cuda.is_available()
    return bool(endpoint.shm_paths) and all(os.path.exists(p) for p in endpoint.shm_paths)


def shm_cache_factory(path_holder: list[str], directory: str | None = None) -> CacheFactory:
    """A KV cache allocator backed by a file private to this user, in `directory` or the
    deployment's shared-memory directory; on a GPU, plain device memory (its owner exports it
    through CUDA IPC)."""

    def make(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if device.type == "cuda":
            return torch.zeros(shape, dtype=dtype, device=device)
        if device.type != "cpu":
            raise ValueError(f"the shm KV transport cannot share a cache on {device}")
        numel = int(np.prod(shape))
        size = numel * torch.empty((), dtype=dtype).element_size()
        path = private_file(directory, "kv", size, reserve=True)
        path_holder.append(path)
        return torch.from_file(path, shared=True, size=numel, dtype=dtype).view(shape)

    return make


def map_shm_cache(path: str, layout: KVLayout, dtype: torch.dtype, num_heads: int) -> torch.Tensor:
    """Map a decode worker's cache file of `num_heads` KV heads (a tensor-parallel rank's share,
    or all of them). Its slot count is the decode worker's own (pools may size their caches
    differently), so it comes from the file's size, never from ours."""
    row = layout.num_layers * 2 * num_heads * layout.row_width
    itemsize = torch.empty((), dtype=dtype).element_size()
    size = os.path.getsize(path)
    if size == 0 or size % (row * itemsize):
        raise ValueError(f"{path}: {size} bytes is not a whole KV cache of {layout}")
    num_slots = size // (row * itemsize)
    shape = (layout.num_layers, 2, num_slots, num_heads, layout.row_width)
    return torch.from_file(path, shared=True, size=size // itemsize, dtype=dtype).view(shape)


@dataclass
class ShmPeer:
    path = "shm"  # what the rows travel through (the transfer metrics' label)
    # the decode worker's cache, mapped here: one part per rank, with the KV heads it holds
    parts: list[tuple[torch.Tensor, slice]]

    def write_layer(self, job: LayerJob, layer: int, own: torch.Tensor, send: Send) -> None:
        """`own` holds every KV head; each rank's file takes its heads. Any device to any
        (the transfer thread orders the copies after the layer and waits for them)."""
        if job.runs is not None:  # long stretches: copy them in place
            for cache, heads in self.parts:
                target = cache[layer]
                for s0, d0, n in job.runs:
                    target[:, d0 : d0 + n].copy_(own[:, s0 : s0 + n, heads])
        else:  # scattered slots: gather here, scatter there
            rows = own.index_select(1, to_device(job.src, own.device))
            for cache, heads in self.parts:
                dev = cache.device
                cache[layer].index_copy_(
                    1, to_device(job.dst, dev), to_device(rows[:, :, heads], dev)
                )


class ShmTransport:
    kind = KVTransportKind.SHM

    def cache_factory(self, paths: list[str]) -> CacheFactory:
        return shm_cache_factory(paths)

    def open_peer(self, endpoint: PeerEndpoint, own: list[torch.Tensor]) -> ShmPeer:
        parts, heads = endpoint.cuda_ipc or endpoint.shm_paths, endpoint.layout.num_kv_heads
        if not parts or heads % len(parts):
            raise ValueError(
                f"decode worker {endpoint.worker_id} offers {len(parts)} shared caches for "
                f"{heads} KV heads (one per rank, each an equal share)"
            )
        share = heads // len(parts)
        open_part = map_cuda_cache if endpoint.cuda_ipc else map_shm_cache
        return ShmPeer([
            (open_part(p, endpoint.layout, own[0].dtype, share),
             slice(r * share, (r + 1) * share))
            for r, p in enumerate(parts)
        ])  # fmt: skip
