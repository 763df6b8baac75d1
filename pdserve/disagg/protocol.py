"""What prefill and decode workers agree on, and what travels between them (no torch here).

- `KVLayout`: the shape of one worker's KV cache. Workers exchange it before the first transfer
  (through the frontend at startup, and again in `PeerInfo`); any difference is a startup error.
- `KVDest`: where a prefill worker writes one request's KV (the decode worker's reserved blocks).
- On the KV channel (prefill -> decode, ordered): `KVLayerHeader` (+ slot and data frames, TCP
  transport only), then exactly one `KVDone` (with the first token) or `KVAborted` per request.
  Each message travels in a `KVEnvelope` (sender epoch, sequence number) whose first frame starts
  with a keyed tag over the envelope, the slot frame and the data frame's length
  (`pdserve.disagg.connector`): the receiver drops what is not from this deployment, replays, and
  writes outside the request's own reservation.
"""

from __future__ import annotations

import msgspec

from pdserve.kv.rows import row_width
from pdserve.types import KVTransportKind


class KVLayout(msgspec.Struct, frozen=True):
    model: str  # the model's identity: architecture and shapes (see `model_identity`)
    dtype: str  # of the KV cache's elements: the model's dtype, or "int8" (rows carry scales)
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int

    @property
    def row_width(self) -> int:
        """Elements of one cache row (one token, one KV head): an int8 row ends in its scale."""
        return row_width(self.head_dim, self.dtype == "int8")

    def mismatch(self, other: KVLayout) -> str | None:
        """A sentence naming every field that differs, or None when the layouts agree."""
        diffs = [
            f"{name} {getattr(self, name)!r} != {getattr(other, name)!r}"
            for name in self.__struct_fields__
            if getattr(self, name) != getattr(other, name)
        ]
        return "; ".join(diffs) if diffs else None


def model_identity(model_config) -> str:
    c = model_config
    return (
        f"{c.architecture}(vocab={c.vocab_size},hidden={c.hidden_size},layers={c.num_layers},"
        f"heads={c.num_heads},kv_heads={c.num_kv_heads},inter={c.intermediate_size})"
    )


class KVDest(msgspec.Struct, frozen=True):
    worker_id: int  # the decode worker
    block_ids: list[int]  # its blocks for the request, in order
    num_cached_tokens: int  # leading tokens it already holds: send only the rest


class CudaIpcHandle(msgspec.Struct, frozen=True):
    """One CUDA allocation of a decode worker's cache, as torch's `_share_cuda_` describes it."""

    device: int
    handle: bytes  # cudaIpcMemHandle of the allocation
    size_bytes: int  # of the storage
    offset_bytes: int  # of the storage within the allocation
    ref_counter_handle: bytes  # shared memory holding the allocation's count of users
    ref_counter_offset: int
    event_handle: bytes  # the producer's event, for the consumer to wait on once
    event_sync_required: bool


class PeerEndpoint(msgspec.Struct, frozen=True):
    """How a prefill worker reaches one decode worker's KV cache."""

    worker_id: int
    kv_address: str  # ZMQ address of the decode worker's KV channel
    transport: KVTransportKind
    # shm: the files that hold the decode worker's cache, one per tensor-parallel rank in rank
    # order, each with an equal share of the KV heads (one file: every head)
    shm_paths: list[str]
    layout: KVLayout
    host: str = ""  # the decode worker's host (`host_identity`): shm files map only there
    # shm on a GPU: the CUDA allocation of the decode worker's cache instead of files
    # (`connector/cuda_ipc.py`), one per rank like `shm_paths`
    cuda_ipc: list[CudaIpcHandle] = []


class KVLayerHeader(msgspec.Struct, tag=True):
    request_id: str
    layer: int
    num_tokens: int


class KVDone(msgspec.Struct, tag=True):
    request_id: str
    first_token: int
    sender_id: int
    num_bytes: int
    transfer_s: float


class KVAborted(msgspec.Struct, tag=True):
    request_id: str
    sender_id: int


KVControl = KVLayerHeader | KVDone | KVAborted


class KVEnvelope(msgspec.Struct, array_like=True):
    """One KV channel message with what makes it unique: the sender's epoch (random per sender
    process) and a sequence number that grows with every message the sender sends."""

    epoch: int
    seq: int
    msg: KVControl
