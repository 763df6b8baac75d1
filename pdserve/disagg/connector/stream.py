"""The `tcp` KV channel: length-prefixed messages on plain TCP streams, read by receive threads.

A ZMQ pair moves ~1.4 GB/s over loopback here and a plain socket 3.5-4.6 GB/s
(`benchmarks/kv_transfer_bench.py`), so the channel that carries KV rows between hosts is a
plain stream. A message is the `PREFIX` (the lengths of its three parts), then its header (a
sealed `KVEnvelope`), the destination slots and the rows; a control message (`KVDone`,
`KVAborted`) has no slots and no rows. Messages keep their order per sender, as the decode
worker's bookkeeping needs (a request's rows before its `KVDone`).

- `StreamReceiver` (decode worker): one thread accepts connections, one thread per connection
  reads whole messages into fresh buffers while the engine steps, and queues them; the step
  loop takes them (`take`) between steps, where the receiver checks and applies them as before,
  so nothing but this module's threads touches a socket and nothing but the step loop touches
  the cache. A message whose declared lengths exceed the limits ends its connection before
  anything is buffered (a stream cannot be resynchronised), as does a truncated one; queued
  bytes are bounded (`max_queued`), beyond which readers wait (TCP's flow control slows the
  sender); at most `MAX_CONNECTIONS` connections are open at once (each has a thread). A
  connection keeps its place by speaking: one that has sent no whole message within
  `SILENT_S` is closed, and at the limit a new connection takes the place of the oldest silent
  one, or is refused when every open connection has spoken. The receiver, which checks tags,
  `disown`s a connection whose message is not authentic (closed at once), so a stranger
  cannot keep the deployment's prefill workers out by holding connections open.
  `fileno()` is a wake-up descriptor the worker loop polls.
- `StreamChannel` (prefill worker): one connection, (re)opened on demand; a send that fails
  (the decode worker died or restarted) drops the message and is counted, never raised: the
  decode side gives up on the KV after its timeout and recomputes.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import struct
import threading
import time
from collections import Counter, deque
from collections.abc import Callable

import numpy as np

logger = logging.getLogger("pdserve.disagg")

PREFIX = struct.Struct("<IIQ")  # header, slots and rows lengths
MAX_HEADER = 1 << 16  # a sealed envelope is a few hundred bytes
RECONNECT_EVERY_S = 1.0
SOCKET_BUFFER = 4 << 20  # asked of the kernel per direction (it may cap it)
POOL_PER_SIZE = 32  # received buffers kept for reuse, per size
MAX_CONNECTIONS = 64  # prefill workers (and reconnects) one decode worker takes at once
SILENT_S = 10.0  # a connection's first whole message must come within this


def stretch_start(slots: np.ndarray) -> int | None:
    """The first slot when `slots` are consecutive (one stretch of the cache), else None."""
    n = len(slots)
    if n == 0:
        return None
    start = int(slots[0])
    if int(slots[-1]) - start + 1 != n or (n > 1 and not bool((slots[1:] > slots[:-1]).all())):
        return None
    return start


def parse_address(address: str) -> tuple[str, int]:
    """'tcp://HOST:PORT' -> (HOST, PORT)."""
    host, _, port = address.removeprefix("tcp://").rpartition(":")
    return host.strip("[]"), int(port)


class StreamReceiver:
    def __init__(self, address: str, max_slots_bytes: int, max_rows_bytes: int,
                 max_queued: int = 512 << 20, dropped: Counter | None = None,
                 rows_buffer: Callable[[int], np.ndarray] | None = None) -> None:  # fmt: skip
        host, port = parse_address(address)
        self.listener = socket.create_server((host, port))
        self.address = f"tcp://{host}:{self.listener.getsockname()[1]}"
        self.max_slots_bytes, self.max_rows_bytes = max_slots_bytes, max_rows_bytes
        self.max_queued = max_queued
        self.queue: deque[tuple[socket.socket, list[memoryview]]] = deque()
        self.taken: list[tuple[socket.socket, list[memoryview]]] = []  # by the last `take`
        self.free: dict[int, list[np.ndarray]] = {}  # buffers to reuse, by size
        # where a message's rows are read into (a GPU cache's receiver: pinned memory)
        self.rows_buffer = rows_buffer or (lambda n: np.empty(n, dtype=np.uint8))
        self.pooled_bytes, self.max_pooled = 0, max_queued // 2
        self.queued_bytes = 0
        self.cond = threading.Condition()
        # connections ended for a framing error, or refused beyond MAX_CONNECTIONS
        self.dropped: Counter[str] = Counter() if dropped is None else dropped
        self.closed = False
        # open connections -> when they opened while silent, None once they sent a message
        # (the accept thread adds, readers mark and remove: under `cond`)
        self.conns: dict[socket.socket, float | None] = {}
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        threading.Thread(target=self._accept, name="pdserve-kv-accept", daemon=True).start()

    def fileno(self) -> int:
        return self._wake_r.fileno()

    def take(self) -> list[tuple[socket.socket, list[memoryview]]]:
        """(connection, message parts) received since the last call, in arrival order per
        connection; valid until the next call (their buffers are then reused: fresh pages cost
        a fault each)."""
        with contextlib.suppress(BlockingIOError):
            while self._wake_r.recv(4096):
                pass
        with self.cond:
            for _, msg in self.taken:
                for part in msg[1:]:
                    pool = self.free.setdefault(len(part), [])
                    if (
                        len(pool) < POOL_PER_SIZE
                        and self.pooled_bytes + len(part) <= self.max_pooled
                    ):
                        pool.append(part.obj)
                        self.pooled_bytes += len(part)
            self.taken = list(self.queue)
            self.queue.clear()
            self.queued_bytes = 0
            self.cond.notify_all()
        return self.taken

    def disown(self, conn: socket.socket) -> None:
        """A message on `conn` is not from this deployment: close it."""
        self._drop_conn(conn)

    def _drop_conn(self, conn: socket.socket) -> None:
        """Close `conn` from any thread; it stops counting at once (its reader then ends)."""
        with self.cond:
            self.conns.pop(conn, None)
        _shut(conn)

    def _accept(self) -> None:
        self.listener.settimeout(1.0)  # wakes to close connections that stayed silent
        while not self.closed:
            self._close_silent(time.monotonic() - SILENT_S)
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            conn.settimeout(None)
            with self.cond:
                silent = min(
                    (c for c, t in self.conns.items() if t is not None),
                    key=self.conns.get,
                    default=None,
                )
                full = len(self.conns) >= MAX_CONNECTIONS  # one thread each: bounded
                if not full or silent is not None:
                    self.conns[conn] = time.monotonic()
            if full and silent is None:
                self._end("too_many_connections", f"{MAX_CONNECTIONS} open already")
                conn.close()
                continue
            if full:  # the newcomer takes the place of the oldest silent connection
                self._end("evicted", "the oldest silent connection, for a new one")
                self._drop_conn(silent)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER)
            threading.Thread(target=self._read, args=(conn,), name="pdserve-kv-recv",
                             daemon=True).start()  # fmt: skip

    def _close_silent(self, opened_before: float) -> None:
        with self.cond:
            stale = [c for c, t in self.conns.items() if t is not None and t < opened_before]
        for conn in stale:
            self._end("silent", f"no whole message within {SILENT_S:.0f} s")
            self._drop_conn(conn)

    def _read(self, conn: socket.socket) -> None:
        try:
            while not self.closed:
                prefix = _recv_exactly(conn, PREFIX.size)
                if prefix is None:
                    return  # the peer closed between messages
                n_head, n_slots, n_rows = PREFIX.unpack(prefix)
                if (n_head > MAX_HEADER or n_slots > self.max_slots_bytes
                        or n_rows > self.max_rows_bytes):  # fmt: skip
                    self._end("oversized", f"{n_head} + {n_slots} + {n_rows} bytes")
                    return
                parts = [_recv_exactly(conn, n, self._buffer(n, rows=i == 2))
                         for i, n in enumerate((n_head, n_slots, n_rows))]  # fmt: skip
                if any(p is None for p in parts):
                    self._end("truncated", "the connection ended inside a message")
                    return
                msg = parts[:1] if n_slots == n_rows == 0 else parts
                size = n_head + n_slots + n_rows
                with self.cond:
                    while self.queued_bytes and self.queued_bytes + size > self.max_queued:
                        self.cond.wait(0.1)
                        if self.closed:
                            return
                    self.queue.append((conn, msg))
                    self.queued_bytes += size
                    if conn in self.conns:  # it spoke (its message is checked by the receiver)
                        self.conns[conn] = None
                with contextlib.suppress(BlockingIOError):  # else a wake-up is pending
                    self._wake_w.send(b"\0")
        except OSError:
            return
        finally:
            with self.cond:
                self.conns.pop(conn, None)
            conn.close()

    def _buffer(self, n: int, rows: bool = False) -> np.ndarray:
        with self.cond:
            pool = self.free.get(n)
            if pool:
                self.pooled_bytes -= n
                return pool.pop()
        # not zeroed: every byte is received
        return self.rows_buffer(n) if rows else np.empty(n, dtype=np.uint8)

    def _end(self, reason: str, detail: str) -> None:
        self.dropped[reason] += 1
        logger.warning("KV channel: closed a connection (%s: %s)", reason, detail)
        with contextlib.suppress(OSError):  # the step loop reports the count (else pending)
            self._wake_w.send(b"\0")

    def close(self) -> None:
        self.closed = True
        with self.cond:
            self.cond.notify_all()
        with contextlib.suppress(OSError):  # wakes the accepting thread (Linux)
            self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()
        with self.cond:
            conns = list(self.conns)
        for conn in conns:
            _shut(conn)
        self._wake_r.close()
        self._wake_w.close()


def _shut(conn: socket.socket) -> None:
    """End a connection from any thread: its reader sees the end and closes it."""
    with contextlib.suppress(OSError):
        conn.shutdown(socket.SHUT_RDWR)


def _recv_exactly(conn: socket.socket, n: int, buf: np.ndarray | None = None) -> memoryview | None:
    view = memoryview(np.empty(n, dtype=np.uint8) if buf is None else buf)
    got = 0
    while got < n:
        k = conn.recv_into(view[got:], n - got)
        if k == 0:
            return None
        got += k
    return view


class StreamChannel:
    """The prefill side of one decode worker's channel (used only by the sender's thread)."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.sock: socket.socket | None = None
        self.next_try = 0.0
        self.num_lost = 0  # messages dropped because the channel was down

    def send(self, header: bytes) -> None:
        self.send_multipart([header])

    def send_multipart(self, frames, copy: bool = False) -> None:
        """One message: [header] or [header, slots, rows...] (any buffers; the rows may come
        in parts, sent one after the other from where they lie)."""
        views = [memoryview(f).cast("B") for f in frames]
        rows = views[2:]
        lengths = (len(views[0]), len(views[1]) if len(views) > 1 else 0, sum(map(len, rows)))
        sock = self._connected()
        if sock is None:
            self.num_lost += 1
            return
        head = PREFIX.pack(*lengths) + b"".join(v.tobytes() for v in views[:2])
        try:
            sock.sendall(head)
            for part in rows:
                sock.sendall(part)
        except OSError as e:
            self.num_lost += 1
            logger.warning("KV channel to %s lost (%s): messages dropped", self.address, e)
            self.close()
            self.next_try = time.monotonic() + RECONNECT_EVERY_S

    def _connected(self) -> socket.socket | None:
        if self.sock is None and time.monotonic() >= self.next_try:
            try:
                self.sock = socket.create_connection(parse_address(self.address), timeout=5)
                self.sock.settimeout(None)
                self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER)
            except OSError as e:
                logger.warning("KV channel to %s: cannot connect (%s)", self.address, e)
                self.next_try = time.monotonic() + RECONNECT_EVERY_S
        return self.sock

    def close(self, linger: int = 0) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None
