"""The prefill worker's half of a transfer: `KVSender`, and the connector that drives it.

The sender hooks every decoder layer of the model: as soon as a layer has written the step's new
keys and values into the local cache, the slots of every request being prefilled for a decode
worker are queued for transfer, and a background thread moves them (through the peer's
`KVTransport` writer) while the next layers compute (torch releases the GIL), so transfer overlaps
compute. When a request's prefill ends, the sender waits for its queued transfers (the *exposed*
transfer time) and then tells the decode worker, on the same ordered channel, that the KV is
complete, with the first token. Every message is sealed with the deployment key and a sequence
number (`seal`). A tensor-parallel prefill worker ships every KV head: its followers' rows of
the step come to rank 0 after the forward (`ship_step`), and leave from there.
"""

from __future__ import annotations

import functools
import logging
import queue
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import zmq

from pdserve.disagg.connector.base import (
    ConnectorReport,
    KVConnector,
    LayerJob,
    PeerWriter,
    layout_of,
    seal,
)
from pdserve.disagg.connector.device import LayerOrder
from pdserve.disagg.connector.stream import StreamChannel
from pdserve.disagg.connector.transports import transport_for
from pdserve.disagg.protocol import KVAborted, KVDest, KVDone, KVEnvelope, KVLayout, PeerEndpoint
from pdserve.ipc.messages import TransferStat
from pdserve.request import Request
from pdserve.types import EngineCoreOutput, KVTransportKind

logger = logging.getLogger("pdserve.disagg")

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


def _copy_runs(src: np.ndarray, dst: np.ndarray) -> list[tuple[int, int, int]] | None:
    """The stretches to copy one by one, or None when they are too short to pay."""
    runs = contiguous_runs(src, dst)
    if len(runs) > 1 and len(runs) * MIN_MEAN_RUN_TOKENS > len(src):
        return None
    return runs


@dataclass
class _Transfer:
    dest: KVDest
    sent_upto: int  # tokens before this position are at the destination already
    num_bytes: int = 0
    started: float | None = None  # when its first layer was queued
    busy_s: float = 0.0  # time the transfer thread spent moving its rows


@dataclass
class _Peer:
    endpoint: PeerEndpoint
    sock: zmq.Socket | StreamChannel  # the ordered channel (tcp: a plain stream)
    writer: PeerWriter
    seal: Callable[..., bytes]  # the sender's: tag and sequence number

    def send(self, msg, slots: np.ndarray | None = None, rows: list | None = None) -> None:
        """One sealed message on this peer's ordered channel (with a layer's slots and its rows,
        in one or more contiguous parts: a `StreamChannel` sends them one after the other)."""
        if slots is None:
            self.sock.send(self.seal(msg))
        else:
            header = self.seal(msg, slots.tobytes(), sum(r.nbytes for r in rows))
            self.sock.send_multipart([header, slots, *rows], copy=False)


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
        self.order = LayerOrder(kv_caches[0].device)  # a GPU's: copies after their layer
        self.block_size = block_size
        self.layout = layout
        self.bytes_per_token_layer = (
            2 * layout.num_kv_heads * layout.row_width * kv_caches[0].element_size()
        )
        self.ctx = zmq.Context.instance()
        self.peers: dict[int, _Peer] = {}
        self.transfers: dict[str, _Transfer] = {}
        self.step_jobs: list[LayerJob] = []
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
        if KVTransportKind(endpoint.transport).streams:
            sock = StreamChannel(endpoint.kv_address)
        else:
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.LINGER, 2000)
            sock.connect(endpoint.kv_address)
        writer = transport_for(endpoint.transport).open_peer(endpoint, self.own)
        self.peers[endpoint.worker_id] = _Peer(endpoint, sock, writer, self._seal)
        logger.info("KV for decode worker %d: %s, rows through %s", endpoint.worker_id,
                    endpoint.transport, writer.path)  # fmt: skip

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
            job = LayerJob(
                req.request_id,
                t.dest.worker_id,
                torch.from_numpy(src),
                torch.from_numpy(dst),
                t,
                _copy_runs(src, dst),
            )
            self.step_jobs.append(job)
            t.sent_upto = end
            t.num_bytes += (end - start) * self.bytes_per_token_layer * self.layout.num_layers
            if t.started is None:
                t.started = time.perf_counter()

    def on_layer(self, layer: int) -> None:
        mark = self.order.mark() if self.step_jobs else None
        for job in self.step_jobs:
            self.jobs.put(("layer", layer, job, self.own[layer], mark))

    def ship_step(self, gather: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """After the forward, instead of layer by layer: a tensor-parallel worker's rows of
        this step (`gather(slots)` -> [layers, 2, slots, every KV head, row]) are queued
        for the transfer thread."""
        if not self.step_jobs:
            return
        rows = gather(torch.cat([job.src for job in self.step_jobs]))
        at = 0
        for job in self.step_jobs:
            n = job.src.numel()
            src = np.arange(at, at + n)
            moved = LayerJob(job.request_id, job.peer_id, torch.from_numpy(src), job.dst,
                             job.transfer, _copy_runs(src, job.dst.numpy()))  # fmt: skip
            for layer in range(len(rows)):
                self.jobs.put(("layer", layer, moved, rows[layer], None))
            at += n
        self.step_jobs = []

    def finish(self, request_id: str, first_token: int) -> tuple[int, float, float, str] | None:
        """The prefill of a request is complete: flush its KV, then signal the decode worker.
        Returns (bytes, busy seconds, span seconds, path) of the transfer: the time spent moving
        its rows, the time from its first layer queued to now (which holds the prefill's compute
        as well, the transfer running behind it), and what the rows went through (shm, tcp)."""
        t = self.transfers.pop(request_id, None)
        if t is None:
            return None
        self.flush()
        span_s = time.perf_counter() - (t.started or time.perf_counter())
        done = KVDone(request_id, first_token, self.worker_id, t.num_bytes, t.busy_s)
        self.jobs.put(("ctl", t.dest.worker_id, done))
        peer = self.peers.get(t.dest.worker_id)
        return t.num_bytes, t.busy_s, span_s, peer.writer.path if peer is not None else "none"

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
                    _, layer, job, source, mark = item
                    peer = self.peers.get(job.peer_id)
                    if peer is not None:
                        t0 = time.perf_counter()
                        if mark is None:  # the CPU: done when it returns
                            peer.writer.write_layer(job, layer, source, peer.send)
                        else:
                            with self.order.ordered(mark):
                                peer.writer.write_layer(job, layer, source, peer.send)
                        job.transfer.busy_s += time.perf_counter() - t0
                elif kind == "ctl":
                    _, peer_id, msg = item
                    peer = self.peers.get(peer_id)
                    if peer is not None:
                        peer.send(msg)
                elif kind == "peer":
                    try:
                        self._connect(item[1])
                    except (OSError, ValueError) as e:  # gone, or not reachable from here
                        self.peers.pop(item[1].worker_id, None)
                        logger.warning("decode worker %d cannot be reached: %s (its "
                                       "requests recompute there)", item[1].worker_id, e)  # fmt: skip
            except Exception as e:  # reported to the step loop at its next flush
                logger.exception("KV transfer failed")
                self.error = f"KV transfer failed: {type(e).__name__}: {e}"
            finally:
                self.jobs.task_done()


class SendingConnector(KVConnector):
    """Prefill role: ships the KV of every `KVRole.SEND` request to its decode worker."""

    decodes = False  # its requests leave after their first token: nothing to speculate
    moves_kv = True

    def __init__(self, worker_id: int, key: bytes) -> None:
        self.worker_id, self.key = worker_id, key
        self.sender: KVSender | None = None
        self.gather = None  # tensor parallel: every rank's rows of the given slots
        self.transfers: list[TransferStat] = []

    def attach(self, core) -> None:
        runner = core.runner
        self.sender = KVSender(
            self.worker_id, runner.kv_caches, runner.block_size, layout_of(core), self.key
        )
        if runner.tp is None:
            # decode-only steps ship nothing (a sent request leaves at its first token), so
            # they keep the fused decode step; a step with rows to ship runs the layers
            runner.add_layer_hook(self.sender.on_layer, wanted=lambda: bool(self.sender.step_jobs))
        else:  # the followers' heads come to rank 0 after the forward (one collective a step)
            self.gather = functools.partial(runner.tp.gather_rows, runner.kv_caches)

    @property
    def exposed_s(self) -> float:
        return self.sender.exposed_s

    def add_peer(self, endpoint: PeerEndpoint) -> None:
        self.sender.add_peer(endpoint)

    def add_request(self, request: Request) -> None:
        self.sender.add_request(request.request_id, request.kv_dest)

    def begin_step(self, plan, block_tables: dict[str, list[int]]) -> None:
        self.sender.begin_step(plan, block_tables)

    def end_step(self, handed_off: list[Request], outputs: list[EngineCoreOutput]) -> None:
        if self.gather is not None:
            self.sender.ship_step(self.gather)
        for req in handed_off:  # flush their KV, then hand them to the decode worker
            res = self.sender.finish(req.request_id, req.output_token_ids[0])
            if res is not None:
                self.transfers.append(TransferStat(req.request_id, *res))
        for out in outputs:  # ended here (EOS, stop, length): no handoff
            if out.finish_reason is not None:
                self.sender.abort(out.request_id)

    def forget(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.sender.abort(rid)

    def report(self, remote) -> ConnectorReport:
        out = ConnectorReport(transfers=self.transfers)
        self.transfers = []
        return out
