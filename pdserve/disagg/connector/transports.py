"""The one place a `KVTransportKind` becomes its implementation."""

from __future__ import annotations

from pdserve.disagg.connector.base import KVTransport
from pdserve.disagg.connector.shm import ShmTransport
from pdserve.disagg.connector.tcp import AutoTransport, TcpTransport
from pdserve.types import KVTransportKind

TRANSPORTS: dict[KVTransportKind, type] = {
    KVTransportKind.SHM: ShmTransport,
    KVTransportKind.TCP: TcpTransport,
    KVTransportKind.AUTO: AutoTransport,
}


def transport_for(kind: KVTransportKind | str) -> KVTransport:
    return TRANSPORTS[KVTransportKind(kind)]()
