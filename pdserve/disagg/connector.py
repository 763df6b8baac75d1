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
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import numpy as np
import torch
import zmq

from pdserve.disagg.protocol import (
    KVAborted,
    KVControl,
    KVDest,
    KVDone,
    KVLayerHeader,
    KVLayout,
    PeerEndpoint,
)

logger = logging.getLogger("pdserve.disagg")


def shm_cache_factory(
    path_holder: list[str],
) -> Callable[[tuple[int, ...], torch.dtype], torch.Tensor]:
    """A KV cache allocator backed by a file in /dev/shm (the decode side of the shm transport)."""

    def make(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        base = "/dev/shm" if os.path.isdir("/dev/shm") else None
        path = os.path.join(base or "/tmp", f"pdserve-kv-{uuid.uuid4().hex[:16]}")
        numel = int(np.prod(shape))
        with open(path, "wb") as f:
            f.truncate(numel * torch.empty((), dtype=dtype).element_size())
        path_holder.append(path)
        return torch.from_file(path, shared=True, size=numel, dtype=dtype).view(shape)

    return make


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

    def write_layer(self, job: _StepJob, layer: int, own: torch.Tensor) -> None:
        """Ship one layer's new K and V rows of a request (`own`: [2, slots, H, D])."""
        if self.cache is None:  # tcp: the rows and their destination slots as frames
            rows = own.index_select(1, job.src)
            header = msgspec.msgpack.encode(KVLayerHeader(job.request_id, layer, len(job.dst)))
            self.sock.send_multipart([header, job.dst.numpy(), rows.numpy()], copy=False)
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
    started: float | None = None


@dataclass
class _StepJob:
    request_id: str
    peer_id: int
    src: torch.Tensor  # [n] slots here
    dst: torch.Tensor  # [n] slots at the decode worker
    runs: list[tuple[int, int, int]] | None = None  # contiguous stretches, when long enough


class KVSender:
    def __init__(
        self, worker_id: int, kv_caches: list[torch.Tensor], block_size: int, layout: KVLayout
    ) -> None:
        self.worker_id = worker_id
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
                req.request_id, t.dest.worker_id, torch.from_numpy(src), torch.from_numpy(dst), runs
            )
            self.step_jobs.append(job)
            t.sent_upto = end
            t.num_bytes += (end - start) * self.bytes_per_token_layer * self.layout.num_layers
            if t.started is None:
                t.started = time.perf_counter()

    def on_layer(self, layer: int) -> None:
        for job in self.step_jobs:
            self.jobs.put(("layer", layer, job))

    def finish(self, request_id: str, first_token: int) -> tuple[int, float] | None:
        """The prefill of a request is complete: flush its KV, then signal the decode worker.
        Returns (bytes, seconds) of the transfer."""
        t = self.transfers.pop(request_id, None)
        if t is None:
            return None
        self.flush()
        seconds = time.perf_counter() - (t.started or time.perf_counter())
        self.jobs.put(
            (
                "ctl",
                t.dest.worker_id,
                KVDone(request_id, first_token, self.worker_id, t.num_bytes, seconds),
            )
        )
        return t.num_bytes, seconds

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
    def _run(self) -> None:
        while True:
            item = self.jobs.get()
            try:
                kind = item[0]
                if kind == "layer":
                    _, layer, job = item
                    peer = self.peers.get(job.peer_id)
                    if peer is not None:
                        peer.write_layer(job, layer, self.own[layer])
                elif kind == "ctl":
                    _, peer_id, msg = item
                    peer = self.peers.get(peer_id)
                    if peer is not None:
                        peer.sock.send(msgspec.msgpack.encode(msg))
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
    the `KVDone` / `KVAborted` signals for the step loop."""

    def __init__(
        self,
        worker_id: int,
        kv_caches: list[torch.Tensor],
        transport: str,
        address: str,
        shm_path: str | None,
        layout: KVLayout,
        accepting: Callable[[str], bool],
    ) -> None:
        self.worker_id = worker_id
        self.kv_caches = kv_caches
        self.transport = transport
        self.shm_path = shm_path
        self.layout = layout
        self.accepting = accepting  # is this request still waiting for its KV?
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.PULL)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.sock.setsockopt(zmq.LINGER, 0)
        if address.startswith("tcp://") and address.endswith(":0"):
            self.sock.bind(address[: -len(":0")] + ":*")
            address = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        else:
            self.sock.bind(address)
        self.address = address
        self.decoder = msgspec.msgpack.Decoder(KVControl)
        self.num_bytes_received = 0

    def endpoint(self) -> PeerEndpoint:
        return PeerEndpoint(
            self.worker_id, self.address, self.transport, self.shm_path, self.layout
        )

    def poll(self) -> tuple[list[KVDone], list[KVAborted]]:
        done, aborted = [], []
        while self.sock.poll(0):
            frames = self.sock.recv_multipart(copy=False)
            msg = self.decoder.decode(frames[0].buffer)
            if isinstance(msg, KVLayerHeader):
                self._apply(msg, frames)
            elif isinstance(msg, KVDone):
                done.append(msg)
            else:
                aborted.append(msg)
        return done, aborted

    def _apply(self, header: KVLayerHeader, frames) -> None:
        if not self.accepting(header.request_id):  # ended, and its blocks may be reused: drop
            return
        dst = torch.frombuffer(frames[1].buffer, dtype=torch.int64)
        cache = self.kv_caches[header.layer]
        rows = torch.frombuffer(frames[2].buffer, dtype=cache.dtype).view(
            2, header.num_tokens, cache.shape[2], cache.shape[3]
        )
        cache.index_copy_(1, dst, rows)
        self.num_bytes_received += rows.numel() * rows.element_size()

    def close(self) -> None:
        self.sock.close(linger=0)
        if self.shm_path and os.path.exists(self.shm_path):
            os.unlink(self.shm_path)
