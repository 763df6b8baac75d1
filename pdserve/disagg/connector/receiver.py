"""The decode worker's half of a transfer: `KVReceiver`, and the connector around it.

The receiver owns the decode worker's KV channel: it applies `tcp` layer frames to the cache and
collects the `KVDone` / `KVAborted` signals for the step loop, which the connector turns into the
scheduler's `RemoteKV` transitions. The channel is a ZMQ PULL socket for `shm` (control messages
only: the rows are in shared memory already) and plain TCP streams read by receive threads for
`tcp` and `auto` (`stream.py`; with `auto` only peers on other hosts send rows on it). Rows travel with every KV head; a tensor-parallel receiver writes its own
heads and hands the followers theirs before the step loop goes on (`TensorParallel.write_rows`).
"""

from __future__ import annotations

import hmac
import logging
import os
from collections import Counter, OrderedDict
from collections.abc import Callable

import msgspec
import numpy as np
import torch
import zmq

from pdserve.disagg.connector.base import CacheFactory, ConnectorReport, KVConnector, layout_of
from pdserve.disagg.connector.cuda_ipc import export_cache
from pdserve.disagg.connector.device import host_buffer, to_device
from pdserve.disagg.connector.shm import host_identity
from pdserve.disagg.connector.stream import StreamReceiver, stretch_start
from pdserve.disagg.connector.transports import transport_for
from pdserve.disagg.protocol import (
    KVAborted,
    KVDone,
    KVEnvelope,
    KVLayerHeader,
    KVLayout,
    PeerEndpoint,
)
from pdserve.ipc.channel import MAC_BYTES, mac
from pdserve.ipc.messages import KVReceived, KVReservation
from pdserve.types import EngineCoreOutput, KVTransportKind

logger = logging.getLogger("pdserve.disagg")


class KVReceiver:
    """Owns the decode worker's KV channel: applies TCP layer frames to the cache and collects
    the `KVDone` / `KVAborted` signals for the step loop.

    A message is used only if its tag verifies under the deployment key, its sequence number is
    new for its sender, it is well formed, and (for layer frames) every destination slot lies in
    a block that `reservation(request_id)` says the request holds for remote KV. Anything else is
    dropped and counted in `dropped` by reason; nothing a peer sends can stop the worker.
    """

    MAX_EPOCHS = 64  # senders remembered for replay checks

    def __init__(
        self,
        worker_id: int,
        kv_caches: list[torch.Tensor],
        transport: str,
        address: str,
        shm_paths: list[str],
        layout: KVLayout,
        reservation: Callable[[str], list[int] | None],
        key: bytes,
        max_tokens: int,
        tp=None,
    ) -> None:
        self.worker_id = worker_id
        self.kv_caches = kv_caches
        self.transport = transport
        self.shm_paths = shm_paths
        self.layout = layout
        # tensor parallel (rank 0's group): rows arrive with every KV head; this rank keeps the
        # first `own_heads`, the rest wait in `pending` for the followers until `poll` ends
        self.tp = tp
        self.own_heads = kv_caches[0].shape[2]
        self.pending: list[tuple[int, np.ndarray, torch.Tensor]] = []
        self.reservation = reservation  # the block ids a request holds for remote KV, or None
        self.key = key
        self.num_slots = kv_caches[0].shape[1]
        self.row_bytes = 2 * layout.num_kv_heads * layout.row_width * kv_caches[0].element_size()
        self.dropped: Counter[str] = Counter()
        self.decoder = msgspec.msgpack.Decoder(KVEnvelope)
        self.last_seq: OrderedDict[int, int] = OrderedDict()  # sender epoch -> last seq
        # A message larger than any transfer can need (one layer's rows of a whole context)
        # is refused before it is buffered.
        max_rows = max_tokens * self.row_bytes
        self.sock: zmq.Socket | None = None
        self.stream: StreamReceiver | None = None
        self.device = kv_caches[0].device
        # on a GPU, peers on this host open the cache's memory as they would map its file
        share = self.device.type == "cuda" and KVTransportKind(transport) != KVTransportKind.TCP
        self.cuda_ipc = [export_cache(kv_caches[0])] if share else []
        if KVTransportKind(transport).streams:
            self.stream = StreamReceiver(address, 8 * max_tokens, max_rows, dropped=self.dropped,
                                         rows_buffer=lambda n: host_buffer(n, self.device))  # fmt: skip
            self.address = self.stream.address
        else:
            self.sock = zmq.Context.instance().socket(zmq.PULL)
            self.sock.setsockopt(zmq.RCVHWM, 0)
            self.sock.setsockopt(zmq.LINGER, 0)
            self.sock.setsockopt(zmq.MAXMSGSIZE, max_rows + 4096)
            self.sock.bind(address)
            if address.startswith("ipc://"):
                os.chmod(address.removeprefix("ipc://"), 0o600)
            self.address = address

    def endpoint(self) -> PeerEndpoint:
        return PeerEndpoint(
            self.worker_id, self.address, self.transport, self.shm_paths, self.layout,
            host_identity(), self.cuda_ipc,
        )  # fmt: skip

    @property
    def waker(self):
        """What the worker loop polls to wake up for this channel (a ZMQ socket or a file)."""
        return self.sock if self.sock is not None else self.stream

    def _messages(self):
        """(connection or None, frames) of each message received since the last call."""
        if self.stream is not None:
            yield from self.stream.take()
            return
        while self.sock.poll(0):
            yield None, [f.buffer for f in self.sock.recv_multipart(copy=False)]

    def poll(self) -> tuple[list[KVDone], list[KVAborted]]:
        done, aborted = [], []
        for conn, frames in self._messages():
            try:
                try:
                    msg = self._open(frames)
                except _Dropped:
                    if conn is not None:  # not this deployment's: that connection ends
                        self.stream.disown(conn)
                    raise
                if isinstance(msg, KVLayerHeader):
                    self._apply(msg, frames)
                elif isinstance(msg, KVDone):
                    done.append(msg)
                else:
                    aborted.append(msg)
            except _Dropped as e:
                self._drop(e.reason, str(e))
        if self.pending:  # the followers' heads, before any step can read them
            self.tp.write_rows(self.pending)
            self.pending = []
        return done, aborted

    def _open(self, frames) -> KVDone | KVAborted | KVLayerHeader:
        """Check a message's tag, shape and freshness; returns what it carries."""
        if len(frames) not in (1, 3) or len(frames[0]) < MAC_BYTES:
            raise _Dropped("malformed", f"{len(frames)} frame(s)")
        head = frames[0]
        slots = frames[1] if len(frames) == 3 else b""
        data_len = len(frames[2]) if len(frames) == 3 else 0
        tag = mac(self.key, head[MAC_BYTES:], slots, data_len.to_bytes(8, "little"))
        if not hmac.compare_digest(tag, head[:MAC_BYTES]):
            raise _Dropped("bad_tag", "not signed by this deployment")
        try:
            env = self.decoder.decode(head[MAC_BYTES:])
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise _Dropped("malformed", str(e)) from None
        if env.seq <= self.last_seq.get(env.epoch, -1):
            raise _Dropped("replayed", f"sequence number {env.seq} seen before")
        self.last_seq[env.epoch] = env.seq
        self.last_seq.move_to_end(env.epoch)
        while len(self.last_seq) > self.MAX_EPOCHS:
            self.last_seq.popitem(last=False)
        if isinstance(env.msg, KVLayerHeader) != (len(frames) == 3):
            raise _Dropped("malformed", "frames do not match the message")
        return env.msg

    def _apply(self, header: KVLayerHeader, frames) -> None:
        block_ids = self.reservation(header.request_id)
        if block_ids is None:  # ended, and its blocks may be reused: drop
            raise _Dropped("unknown_request", header.request_id)
        n = header.num_tokens
        slots_buf, rows_buf = frames[1], frames[2]
        if not (0 <= header.layer < len(self.kv_caches)) or n < 1:
            raise _Dropped("out_of_bounds", f"layer {header.layer}, {n} tokens")
        if len(slots_buf) != 8 * n or len(rows_buf) != n * self.row_bytes:
            raise _Dropped("malformed", f"frame sizes do not match {n} tokens")
        dst = np.frombuffer(slots_buf, dtype=np.int64)
        bs = self.layout.block_size
        if (
            (dst < 0).any()
            or (dst >= self.num_slots).any()
            or not np.isin(dst // bs, block_ids).all()
        ):
            raise _Dropped("out_of_bounds", f"slots outside the blocks of {header.request_id}")
        cache = self.kv_caches[header.layer]
        rows = torch.frombuffer(rows_buf, dtype=cache.dtype).view(
            2, n, self.layout.num_kv_heads, cache.shape[3]
        )
        if self.tp is not None:  # copied now: the receive buffer is reused
            self.pending.append((header.layer, dst.copy(), rows[:, :, self.own_heads :].clone()))
            rows = rows[:, :, : self.own_heads]
        start = stretch_start(dst)
        if start is not None:  # one stretch: a plain copy, 2x faster (from a GPU's pinned
            cache[:, start : start + n].copy_(rows)  # buffer: one DMA, done on return)
        else:
            index = to_device(torch.from_numpy(dst), cache.device)
            cache.index_copy_(1, index, to_device(rows, cache.device))

    def _drop(self, reason: str, detail: str) -> None:
        self.dropped[reason] += 1
        total = sum(self.dropped.values())
        if total <= 10 or total % 1000 == 0:
            logger.warning(
                "KV channel: dropped a message (%s: %s; %d so far)", reason, detail, total
            )

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close(linger=0)
        if self.stream is not None:
            self.stream.close()
        for path in self.shm_paths:
            if os.path.exists(path):
                os.unlink(path)


class _Dropped(Exception):
    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


class ReceivingConnector(KVConnector):
    """Decode role: the cache where prefill workers can reach it, their signals applied to the
    scheduler's `RemoteKV`."""

    moves_kv = True

    def __init__(self, worker_id: int, kind: KVTransportKind, address: str, key: bytes) -> None:
        self.worker_id, self.kind, self.address, self.key = worker_id, kind, address, key
        self.shm_paths: list[str] = []
        self.receiver: KVReceiver | None = None
        self.num_dropped_seen = 0  # the drops the worker has reported
        self.vocab_size = 0
        self.kv_received: list[KVReceived] = []

    def kv_cache_factory(self) -> CacheFactory | None:
        return transport_for(self.kind).cache_factory(self.shm_paths)

    def attach(self, core) -> None:
        self.vocab_size = core.model_config.vocab_size
        self.receiver = KVReceiver(
            self.worker_id,
            core.runner.kv_caches,
            self.kind,
            self.address,
            self.shm_paths,  # one file per rank (the cache factory made them in rank order)
            layout_of(core),
            reservation=core.scheduler.remote.block_ids,
            key=self.key,
            max_tokens=core.max_model_len,
            tp=core.runner.tp,
        )

    def endpoint(self) -> PeerEndpoint:
        return self.receiver.endpoint()

    @property
    def sockets(self) -> tuple:
        return (self.receiver.waker,)

    def poll(self, remote) -> tuple[list[EngineCoreOutput], bool]:
        done, aborted = self.receiver.poll()
        outputs, received = remote.on_sender_done(
            [(m.request_id, m.first_token) for m in done],
            [m.request_id for m in aborted],
            valid_token=lambda t: 0 <= t < self.vocab_size,
        )
        self.kv_received += [KVReceived(rid, tok) for rid, tok in received]
        # drops counted by the receive threads between polls count as a change too
        num_dropped = self.receiver.dropped.total()
        changed = bool(done or aborted) or num_dropped != self.num_dropped_seen
        self.num_dropped_seen = num_dropped
        return outputs, changed

    def report(self, remote) -> ConnectorReport:
        reservations = [
            KVReservation(
                r.request_id, list(remote.kv.block_ids(r.request_id)), r.num_cached_tokens
            )
            for r in remote.take_reservations()
        ]
        out = ConnectorReport(reservations=reservations, kv_received=self.kv_received)
        self.kv_received = []
        return out

    def dropped(self) -> dict[str, int]:
        return dict(self.receiver.dropped)

    def close(self) -> None:
        if self.receiver is not None:
            self.receiver.close()
