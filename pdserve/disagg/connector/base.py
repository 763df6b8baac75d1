"""The worker half of the KV connector, and the transport interface its halves share.

`EngineCore.step` calls the same hooks on every worker; what they do depends on the connector the
worker was built with (`pdserve.disagg.connector.make_connector`):

- `KVConnector` (this base): a colocated worker; every hook does nothing.
- `SendingConnector` (prefill role): ships the KV of each handed-off request, layer by layer while
  the step computes, then tells its decode worker the first token.
- `ReceivingConnector` (decode role): exposes the cache to prefill workers and turns their signals
  into the scheduler's `RemoteKV` transitions.

The bytes move through a `KVTransport` (`shm` on one host, `tcp` across hosts, `auto` either),
chosen in one place: `transport_for`. Each works on a GPU cache too (`device.py`: copies ordered
after their layer, rows staged through pinned memory; `cuda_ipc.py`: `shm` on a GPU).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import msgspec
import torch

from pdserve.disagg.protocol import KVEnvelope, KVLayout, PeerEndpoint, model_identity
from pdserve.ipc.channel import mac
from pdserve.ipc.messages import KVReceived, KVReservation, TransferStat
from pdserve.request import Request
from pdserve.types import EngineCoreOutput, KVTransportKind

# (shape, dtype, device) -> the KV cache, where a transport needs it to live
CacheFactory = Callable[[tuple[int, ...], torch.dtype, torch.device], torch.Tensor]


def seal(key: bytes, envelope: KVEnvelope, slots: bytes = b"", data_len: int = 0) -> bytes:
    """The first frame of a KV channel message: tag + envelope."""
    body = msgspec.msgpack.encode(envelope)
    return mac(key, body, slots, data_len.to_bytes(8, "little")) + body


def layout_of(core) -> KVLayout:
    """What two workers must agree on to exchange KV (checked in the handshake)."""
    runner, mc = core.runner, core.model_config
    dtype = str(runner.kv_dtype).removeprefix("torch.")
    return KVLayout(
        model_identity(mc), dtype, mc.num_layers, mc.num_kv_heads, mc.head_dim, runner.block_size
    )


@dataclass(slots=True)
class LayerJob:
    """One request's new rows of one step, to be written at its decode worker, layer by layer."""

    request_id: str
    peer_id: int
    src: torch.Tensor  # [n] slots here
    dst: torch.Tensor  # [n] slots at the decode worker
    transfer: object  # the sender's record of the whole transfer
    runs: list[tuple[int, int, int]] | None = None  # contiguous stretches, when long enough


Send = Callable[..., None]  # send(msg, slots: np.ndarray | None, rows: np.ndarray | None)


class PeerWriter(Protocol):
    def write_layer(self, job: LayerJob, layer: int, own: torch.Tensor, send: Send) -> None:
        """Ship one layer's new K and V rows of a request (`own`: this layer's [2, slots, H, D]
        cache here), either in place or as a message through `send`."""


class KVTransport(Protocol):
    kind: KVTransportKind

    def cache_factory(self, paths: list[str]) -> CacheFactory | None:
        """Decode side: where the KV cache must live for peers to reach it (None: anywhere).
        Files it creates are appended to `paths`."""

    def open_peer(self, endpoint: PeerEndpoint, own: list[torch.Tensor]) -> PeerWriter:
        """Prefill side: a writer into the decode worker behind `endpoint`."""


@dataclass
class ConnectorReport:
    """What a worker tells the frontend about the handoffs it took part in since the last one."""

    reservations: list[KVReservation] = field(default_factory=list)
    kv_received: list[KVReceived] = field(default_factory=list)
    transfers: list[TransferStat] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reservations or self.kv_received or self.transfers)


class KVConnector:
    """The colocated worker's connector: no KV crosses workers."""

    exposed_s = 0.0  # cumulative time the step loop waited for transfers
    # whether this worker's requests decode here (a draft model is worth loading)
    decodes = True
    moves_kv = False  # whether KV crosses to or from other workers (the subclasses)

    def kv_cache_factory(self) -> CacheFactory | None:
        return None

    def attach(self, core) -> None:
        """Bind to the engine once it is built (its cache, scheduler and layer hooks)."""

    def endpoint(self) -> PeerEndpoint | None:
        """Where prefill workers reach this worker's cache (decode role only)."""
        return None

    @property
    def sockets(self) -> tuple:
        """Sockets the worker loop should wake up for besides its control channel."""
        return ()

    def add_peer(self, endpoint: PeerEndpoint) -> None:
        """A decode worker this worker may ship KV to (prefill role)."""

    def add_request(self, request: Request) -> None:
        """A request whose KV this worker must ship (`request.kv_dest` says where)."""
        raise ValueError("this worker does not send KV (it is not a prefill worker)")

    def begin_step(self, plan, block_tables: dict[str, list[int]]) -> None:
        """Before the forward: which rows this step's layers will produce for peers."""

    def end_step(self, handed_off: list[Request], outputs: list[EngineCoreOutput]) -> None:
        """After the forward: flush the KV of requests handed off this step."""

    def forget(self, request_ids: list[str]) -> None:
        """These requests ended here: stop shipping their KV."""

    def poll(self, remote) -> tuple[list[EngineCoreOutput], bool]:
        """Apply what peers sent (KV rows, completion signals) to the scheduler's `RemoteKV`;
        returns outputs of requests that ended at once, and whether anything changed."""
        return [], False

    def report(self, remote) -> ConnectorReport:
        return ConnectorReport()

    def dropped(self) -> dict[str, int]:
        """Messages refused on the KV channel, by reason."""
        return {}

    def close(self) -> None:
        pass
