"""The `tcp` KV transport (across hosts): each layer's rows travel as one message on a TCP stream.

A message is a `KVLayerHeader` (sealed with the slot list and the data length), the destination
slots, and the rows (`stream.py` frames them); receive threads read it while the decode worker
steps, and its `KVReceiver` checks it and writes the rows into its cache between its own steps. The rows themselves are not tagged (that would cost more than the
transfer): see docs/ARCHITECTURE.md, "Security". `auto` (`AutoTransport`) is this channel with
the rows written in shared memory where the two workers share a host.
"""

from __future__ import annotations

import torch

from pdserve.disagg.connector.base import CacheFactory, LayerJob, Send
from pdserve.disagg.connector.device import to_device, to_host
from pdserve.disagg.connector.shm import ShmPeer, ShmTransport, reachable, shm_cache_factory
from pdserve.disagg.connector.stream import stretch_start
from pdserve.disagg.protocol import KVLayerHeader, PeerEndpoint
from pdserve.types import KVTransportKind


class TcpPeer:
    path = "tcp"  # what the rows travel through (the transfer metrics' label)

    def write_layer(self, job: LayerJob, layer: int, own: torch.Tensor, send: Send) -> None:
        """The rows go out from where they lie when the request's slots are one stretch (the
        K half, then the V half), else gathered first; from a GPU, through pinned memory."""
        n = len(job.src)
        start = stretch_start(job.src.numpy())
        if own.device.type != "cpu":
            src = own[:, start : start + n] if start is not None else own.index_select(
                1, to_device(job.src, own.device))  # fmt: skip
            rows = [to_host(src).numpy()]
        elif start is not None:
            rows = [own[0, start : start + n].numpy(), own[1, start : start + n].numpy()]
        else:
            rows = [own.index_select(1, job.src).numpy()]
        send(KVLayerHeader(job.request_id, layer, n), job.dst.numpy(), rows)


class TcpTransport:
    kind = KVTransportKind.TCP

    def cache_factory(self, paths: list[str]) -> None:
        return None  # the receiver writes the rows itself: the cache can live anywhere

    def open_peer(self, endpoint: PeerEndpoint, own: list[torch.Tensor]) -> TcpPeer:
        return TcpPeer()


class AutoTransport:
    """`auto`: the decode worker's cache in shared memory (on a GPU: offered through CUDA IPC)
    and its channel on TCP streams; a prefill worker on its host writes the rows in place (as
    `shm`), one elsewhere sends them on the stream (as `tcp`). The signals take the stream
    either way."""

    kind = KVTransportKind.AUTO

    def cache_factory(self, paths: list[str]) -> CacheFactory:
        return shm_cache_factory(paths)

    def open_peer(self, endpoint: PeerEndpoint, own: list[torch.Tensor]) -> ShmPeer | TcpPeer:
        if reachable(endpoint):
            return ShmTransport().open_peer(endpoint, own)
        return TcpPeer()
