"""KV connectors: the prefill worker's sender and the decode worker's receiver.

The sender hooks every decoder layer of the model: as soon as a layer has written the step's new
keys and values into the local cache, the slots of every request being prefilled for a decode
worker are queued for transfer, and a background thread moves them while the next layers
compute (torch releases the GIL), so transfer overlaps compute. When a request's prefill ends,
the sender waits for its queued transfers (the *exposed* transfer time) and then tells the decode
worker, on the same ordered channel, that the KV is complete, with the first token.

Two transports sit behind one interface:
- `shm` (one host): the decode worker's cache lives in a shared-memory file that the prefill worker
  maps; a transfer copies the rows straight into the decode worker's blocks: one copy per stretch
  of slots that is contiguous on both sides, or a gather and a scatter when the stretches are
  short (block tables scattered over the caches).
- `tcp` (across hosts): each layer's rows go as zero-copy ZMQ frames; the decode worker writes them
  into its cache between its own steps.
A GPU transport (CUDA IPC, NCCL, NIXL) would implement `_Peer.write_layer` the same way.

Trust: every message on the KV channel carries a keyed tag (the deployment secret) over its
envelope, its slot list and its data length, and a sequence number; the receiver drops and counts
anything else, and writes rows only into the blocks it reserved for that request. The rows
themselves are not tagged (that would cost more than the transfer): a peer that can alter traffic
in flight on the network could corrupt a request's KV, nothing else. The shm file is private to
the user (0600, in a 0700 directory).
"""

from __future__ import annotations

import hmac
import logging
import os
import queue
import secrets
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import numpy as np
import torch
import zmq

from pdserve.disagg.protocol import (
    KVAborted,
    KVDest,
    KVDone,
    KVEnvelope,
    KVLayerHeader,
    KVLayout,
    PeerEndpoint,
)
from pdserve.ipc.channel import MAC_BYTES, mac, private_file

logger = logging.getLogger("pdserve.disagg")


def shm_cache_factory(
    path_holder: list[str], directory: str | None = None
) -> Callable[[tuple[int, ...], torch.dtype], torch.Tensor]:
    """A KV cache allocator backed by a file private to this user (the decode side of the shm
    transport), in `directory` or the deployment's shared-memory directory."""

    def make(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        numel = int(np.prod(shape))
        size = numel * torch.empty((), dtype=dtype).element_size()
        path = private_file(directory, "kv", size)
        path_holder.append(path)
        return torch.from_file(path, shared=True, size=numel, dtype=dtype).view(shape)

    return make


def seal(key: bytes, envelope: KVEnvelope, slots: bytes = b"", data_len: int = 0) -> bytes:
    """The first frame of a KV channel message: tag + envelope."""
    body = msgspec.msgpack.encode(envelope)
    return mac(key, body, slots, data_len.to_bytes(8, "little")) + body


def map_shm_cache(path: str, layout: KVLayout, num_slots: int, dtype: torch.dtype) -> torch.Tensor:
    shape = (layout.num_layers, 2, num_slots, layout.num_kv_heads, layout.head_dim)
    numel = int(np.prod(shape))
    return torch.from_file(path, shared=True, size=numel, dtype=dtype).view(shape)


# ---- prefill side ---------------------------------------------------------------------------

# Copy stretch by stretch when there is one or they average at least this many tokens; below
# it, one gather + one scatter (two passes over the bytes, but two calls) beats many small copies.
MIN_MEAN_RUN_TOKENS = 64


def contiguous_runs(src: np.ndarray, dst: np.ndarray) -> list[tuple[int, int, int]]:
    """(source slot, destination slot, length) of each stretch where both slot lists advance by
    one: the pieces a transfer can copy without gathering."""
    if len(src) == 0:
        return []
    breaks = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [len(src)]))
    return [(int(src[a]), int(dst[a]), int(b - a)) for a, b in zip(starts, ends)]


@dataclass
class _Peer:
    endpoint: PeerEndpoint
    sock: zmq.Socket
    cache: torch.Tensor | None  # shm: the decode worker's whole cache, mapped here

    def write_layer(self, job: _StepJob, layer: int, own: torch.Tensor, sealer) -> None:
        """Ship one layer's new K and V rows of a request (`own`: [2, slots, H, D])."""
        if self.cache is None:  # tcp: the rows and their destination slots as frames
            rows = own.index_select(1, job.src).numpy()
            dst = job.dst.numpy()
            msg = KVLayerHeader(job.request_id, layer, len(job.dst))
            header = sealer(msg, dst.tobytes(), rows.nbytes)
            self.sock.send_multipart([header, dst, rows], copy=False)
        elif job.runs is not None:  # shm, long stretches: copy them in place
            target = self.cache[layer]
            for s0, d0, n in job.runs:
                target[:, d0 : d0 + n].copy_(own[:, s0 : s0 + n])
        else:  # shm, scattered slots: gather here, scatter there
            self.cache[layer].index_copy_(1, job.dst, own.index_select(1, job.src))


@dataclass
class _Transfer:
    dest: KVDest
    sent_upto: int  # tokens before this position are at the destination already
    num_bytes: int = 0
    started: float | None = None  # when its first layer was queued
    busy_s: float = 0.0  # time the transfer thread spent moving its rows


@dataclass
class _StepJob:
    request_id: str
    peer_id: int
    src: torch.Tensor  # [n] slots here
    dst: torch.Tensor  # [n] slots at the decode worker
    transfer: _Transfer
    runs: list[tuple[int, int, int]] | None = None  # contiguous stretches, when long enough


class KVSender:
    def __init__(
        self,
        worker_id: int,
        kv_caches: list[torch.Tensor],
        block_size: int,
        layout: KVLayout,
        key: bytes,
    ) -> None:
        self.worker_id = worker_id
        self.key = key
        self.epoch = secrets.randbits(63)
        self.seq = 0  # only the transfer thread sends
        self.own = kv_caches  # per layer [2, slots, H, D]
        self.block_size = block_size
        self.layout = layout
        self.bytes_per_token_layer = (
            2 * layout.num_kv_heads * layout.head_dim * kv_caches[0].element_size()
        )
        self.ctx = zmq.Context.instance()
        self.peers: dict[int, _Peer] = {}
        self.transfers: dict[str, _Transfer] = {}
        self.step_jobs: list[_StepJob] = []
        self.jobs: queue.Queue = queue.Queue()
        self.exposed_s = 0.0  # cumulative time the step loop waited for transfers
        self.error: str | None = None
        self.thread = threading.Thread(target=self._run, name="pdserve-kv-sender", daemon=True)
        self.thread.start()

    # -- peers --
    def add_peer(self, endpoint: PeerEndpoint) -> None:
        diff = self.layout.mismatch(endpoint.layout)
        if diff:
            raise ValueError(
                f"decode worker {endpoint.worker_id} has a different KV layout: {diff}"
            )
        self.jobs.put(("peer", endpoint))
        self.flush()

    def _connect(self, endpoint: PeerEndpoint) -> None:
        old = self.peers.pop(endpoint.worker_id, None)
        if old is not None:
            old.sock.close(linger=0)
        sock = self.ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.LINGER, 2000)
        sock.connect(endpoint.kv_address)
        cache = None
        if endpoint.transport == "shm":
            num_slots = self.own[0].shape[1]
            cache = map_shm_cache(endpoint.shm_path, endpoint.layout, num_slots, self.own[0].dtype)
        self.peers[endpoint.worker_id] = _Peer(endpoint, sock, cache)

    # -- requests --
    def add_request(self, request_id: str, dest: KVDest) -> None:
        self.transfers[request_id] = _Transfer(dest, dest.num_cached_tokens)

    def begin_step(self, plan, block_tables: dict[str, list[int]]) -> None:
        """Work out, per destination, which slots this step's layers will ship."""
        self.step_jobs = []
        bs = self.block_size
        for item in plan.scheduled:
            req = item.request
            t = self.transfers.get(req.request_id)
            if t is None:
                continue
            end = req.num_computed_tokens + item.num_new_tokens
            start = t.sent_upto
            if end <= start:
                continue
            pos = np.arange(start, end)
            src_table = np.asarray(block_tables[req.request_id], dtype=np.int64)
            dst_table = np.asarray(t.dest.block_ids, dtype=np.int64)
            src = src_table[pos // bs] * bs + pos % bs
            dst = dst_table[pos // bs] * bs + pos % bs
            runs = contiguous_runs(src, dst)
            if len(runs) > 1 and len(runs) * MIN_MEAN_RUN_TOKENS > len(pos):
                runs = None
            job = _StepJob(
                req.request_id,
                t.dest.worker_id,
                torch.from_numpy(src),
                torch.from_numpy(dst),
                t,
                runs,
            )
            self.step_jobs.append(job)
            t.sent_upto = end
            t.num_bytes += (end - start) * self.bytes_per_token_layer * self.layout.num_layers
            if t.started is None:
                t.started = time.perf_counter()

    def on_layer(self, layer: int) -> None:
        for job in self.step_jobs:
            self.jobs.put(("layer", layer, job))

    def finish(self, request_id: str, first_token: int) -> tuple[int, float, float] | None:
        """The prefill of a request is complete: flush its KV, then signal the decode worker.
        Returns (bytes, busy seconds, span seconds) of the transfer: the time spent moving its
        rows, and the time from its first layer queued to now (which holds the prefill's compute
        as well, the transfer running behind it)."""
        t = self.transfers.pop(request_id, None)
        if t is None:
            return None
        self.flush()
        span_s = time.perf_counter() - (t.started or time.perf_counter())
        done = KVDone(request_id, first_token, self.worker_id, t.num_bytes, t.busy_s)
        self.jobs.put(("ctl", t.dest.worker_id, done))
        return t.num_bytes, t.busy_s, span_s

    def abort(self, request_id: str) -> None:
        t = self.transfers.pop(request_id, None)
        if t is not None:
            self.flush()
            self.jobs.put(("ctl", t.dest.worker_id, KVAborted(request_id, self.worker_id)))

    def flush(self) -> None:
        t0 = time.perf_counter()
        self.jobs.join()
        self.exposed_s += time.perf_counter() - t0
        if self.error:
            raise RuntimeError(self.error)

    # -- the transfer thread --
    def _seal(self, msg, slots: bytes = b"", data_len: int = 0) -> bytes:
        self.seq += 1
        return seal(self.key, KVEnvelope(self.epoch, self.seq, msg), slots, data_len)

    def _run(self) -> None:
        while True:
            item = self.jobs.get()
            try:
                kind = item[0]
                if kind == "layer":
                    _, layer, job = item
                    peer = self.peers.get(job.peer_id)
                    if peer is not None:
                        t0 = time.perf_counter()
                        peer.write_layer(job, layer, self.own[layer], self._seal)
                        job.transfer.busy_s += time.perf_counter() - t0
                elif kind == "ctl":
                    _, peer_id, msg = item
                    peer = self.peers.get(peer_id)
                    if peer is not None:
                        peer.sock.send(self._seal(msg))
                elif kind == "peer":
                    self._connect(item[1])
            except Exception as e:  # reported to the step loop at its next flush
                logger.exception("KV transfer failed")
                self.error = f"KV transfer failed: {type(e).__name__}: {e}"
            finally:
                self.jobs.task_done()


# ---- decode side ----------------------------------------------------------------------------


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
        shm_path: str | None,
        layout: KVLayout,
        reservation: Callable[[str], list[int] | None],
        key: bytes,
        max_tokens: int,
    ) -> None:
        self.worker_id = worker_id
        self.kv_caches = kv_caches
        self.transport = transport
        self.shm_path = shm_path
        self.layout = layout
        self.reservation = reservation  # the block ids a request holds for remote KV, or None
        self.key = key
        self.num_slots = kv_caches[0].shape[1]
        self.row_bytes = 2 * layout.num_kv_heads * layout.head_dim * kv_caches[0].element_size()
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.PULL)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.sock.setsockopt(zmq.LINGER, 0)
        # A peer that sends a larger frame than any transfer can need is disconnected by ZMQ
        # before it is buffered: one layer's rows of a whole context.
        self.sock.setsockopt(zmq.MAXMSGSIZE, max_tokens * self.row_bytes + 4096)
        if address.startswith("tcp://") and address.endswith(":0"):
            self.sock.bind(address[: -len(":0")] + ":*")
            address = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        else:
            self.sock.bind(address)
            if address.startswith("ipc://"):
                os.chmod(address.removeprefix("ipc://"), 0o600)
        self.address = address
        self.decoder = msgspec.msgpack.Decoder(KVEnvelope)
        self.last_seq: OrderedDict[int, int] = OrderedDict()  # sender epoch -> last seq
        self.dropped: Counter[str] = Counter()
        self.num_bytes_received = 0

    def endpoint(self) -> PeerEndpoint:
        return PeerEndpoint(
            self.worker_id, self.address, self.transport, self.shm_path, self.layout
        )

    def poll(self) -> tuple[list[KVDone], list[KVAborted]]:
        done, aborted = [], []
        while self.sock.poll(0):
            frames = self.sock.recv_multipart(copy=False)
            try:
                msg = self._open(frames)
                if isinstance(msg, KVLayerHeader):
                    self._apply(msg, frames)
                elif isinstance(msg, KVDone):
                    done.append(msg)
                else:
                    aborted.append(msg)
            except _Dropped as e:
                self._drop(e.reason, str(e))
        return done, aborted

    def _open(self, frames) -> KVDone | KVAborted | KVLayerHeader:
        """Check a message's tag, shape and freshness; returns what it carries."""
        if len(frames) not in (1, 3) or len(frames[0].buffer) < MAC_BYTES:
            raise _Dropped("malformed", f"{len(frames)} frame(s)")
        head = frames[0].buffer
        slots = frames[1].buffer if len(frames) == 3 else b""
        data_len = len(frames[2].buffer) if len(frames) == 3 else 0
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
        slots_buf, rows_buf = frames[1].buffer, frames[2].buffer
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
            2, n, cache.shape[2], cache.shape[3]
        )
        cache.index_copy_(1, torch.from_numpy(dst), rows)
        self.num_bytes_received += rows.numel() * rows.element_size()

    def _drop(self, reason: str, detail: str) -> None:
        self.dropped[reason] += 1
        total = sum(self.dropped.values())
        if total <= 10 or total % 1000 == 0:
            logger.warning(
                "KV channel: dropped a message (%s: %s; %d so far)", reason, detail, total
            )

    def close(self) -> None:
        self.sock.close(linger=0)
        if self.shm_path and os.path.exists(self.shm_path):
            os.unlink(self.shm_path)


class _Dropped(Exception):
    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
