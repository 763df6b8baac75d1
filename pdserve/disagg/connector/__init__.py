"""KV connectors: how a worker's KV cache meets the other workers of a P/D split.

The scheduler half lives in `pdserve.sched.remote_kv` (torch-free bookkeeping); this package is
the worker half (moving bytes): `base` (the interface, the colocated no-op), `sender` (prefill),
`receiver` (decode), and the transports `shm` and `tcp` behind one `KVTransport` protocol
(`device` and `cuda_ipc`: what changes when the caches are on a GPU).
"""

from __future__ import annotations

from pdserve.disagg.connector.base import (
    ConnectorReport,
    KVConnector,
    KVTransport,
    layout_of,
    seal,
)
from pdserve.disagg.connector.dual import DualConnector
from pdserve.disagg.connector.receiver import KVReceiver, ReceivingConnector
from pdserve.disagg.connector.sender import KVSender, SendingConnector, contiguous_runs
from pdserve.disagg.connector.shm import map_shm_cache, shm_cache_factory
from pdserve.disagg.connector.transports import transport_for
from pdserve.types import KVTransportKind, Role

__all__ = [
    "ConnectorReport",
    "DualConnector",
    "KVConnector",
    "KVReceiver",
    "KVSender",
    "KVTransport",
    "ReceivingConnector",
    "SendingConnector",
    "contiguous_runs",
    "layout_of",
    "make_connector",
    "map_shm_cache",
    "seal",
    "shm_cache_factory",
    "transport_for",
]


def make_connector(
    role: Role,
    worker_id: int,
    key: bytes,
    kind: KVTransportKind = KVTransportKind.SHM,
    address: str | None = None,
    switchable: bool = False,
) -> KVConnector:
    """The connector for a worker of `role` (`address`: where it takes KV from peers). A
    `switchable` worker can send and receive whatever its role, so its role can change."""
    if role == Role.PREFILL and not switchable:
        return SendingConnector(worker_id, key)
    if role == Role.BOTH and not switchable:
        return KVConnector()
    if address is None:
        raise ValueError("a worker that receives KV needs an address for its KV channel")
    receiver = ReceivingConnector(worker_id, kind, address, key)
    if not switchable:
        return receiver
    return DualConnector(SendingConnector(worker_id, key), receiver)
