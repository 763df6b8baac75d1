"""The `tcp` KV transport (across hosts): each layer's rows travel as zero-copy ZMQ frames.

A message is a `KVLayerHeader` (sealed with the slot list and the data length), the destination
slots, and the rows; the decode worker's `KVReceiver` checks it and writes the rows into its cache
between its own steps. The rows themselves are not tagged (that would cost more than the
transfer): see docs/ARCHITECTURE.md, "Security".
"""

from __future__ import annotations

import torch

from pdserve.disagg.connector.base import LayerJob, Send
from pdserve.disagg.protocol import KVLayerHeader, PeerEndpoint
from pdserve.types import KVTransportKind


class TcpPeer:
    def write_layer(self, job: LayerJob, layer: int, own: torch.Tensor, send: Send) -> None:
        rows = own.index_select(1, job.src).numpy()
        send(KVLayerHeader(job.request_id, layer, len(job.dst)), job.dst.numpy(), rows)


class TcpTransport:
    kind = KVTransportKind.TCP

    def cache_factory(self, paths: list[str]) -> None:
        return None  # the receiver writes the rows itself: the cache can live anywhere

    def open_peer(self, endpoint: PeerEndpoint, own: list[torch.Tensor]) -> TcpPeer:
        return TcpPeer()
