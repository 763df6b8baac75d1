"""TierStack: the tiers in order (host memory, then disk), as the KV cache manager sees them.

- `save(keys, payloads)`: blocks evicted from the pool, copied out already; a background thread
  checksums them and writes them to the first tier, and whatever a tier evicts for room goes to
  the next one (the last one drops it). The step never waits on a write: while more than
  `max_pending_bytes` wait to be written, new saves are dropped (counted).
- `leading(keys)`: how many of a prompt's next blocks some tier holds (an index lookup).
- `prefetch(keys)`: a request has just arrived; the background thread reads the blocks of its
  prompt that the tiers hold (ahead of the stores it has queued) while the request waits for
  its turn, so its admission finds them read and verified.
- `fetch(keys)`: the blocks a request is admitted with, verified, from the ready set (what
  prefetches read), the save queue (blocks not written yet) or the first tier that has each,
  stopping at the first miss. Fetched payloads stay in the ready set until a request takes
  them, so a request that waits for room does not read them twice.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque

import numpy as np

from pdserve.ipc.messages import KVOffloadState, KVTierState
from pdserve.kv.offload.base import Tier
from pdserve.kv.offload.cost import ReloadCost
from pdserve.kv.offload.entry import checksum


class TierStack:
    def __init__(
        self,
        tiers: list[Tier],
        payload_bytes: int,
        block_size: int,
        always_reload: bool = False,
        max_pending_bytes: int = 256 << 20,
        max_ready_bytes: int = 256 << 20,
    ) -> None:
        if not tiers:
            raise ValueError("a tier stack needs at least one tier")
        self.tiers = tiers
        self.payload_bytes = payload_bytes
        self.cost = ReloadCost(payload_bytes, block_size, always_reload)
        self._locks = [threading.Lock() for _ in tiers]
        self.ready: OrderedDict[bytes, np.ndarray] = OrderedDict()
        self.max_ready = max(1, max_ready_bytes // payload_bytes)
        self.max_pending = max(1, max_pending_bytes // payload_bytes)
        self._queue: deque[tuple[bytes, np.ndarray]] = deque()
        self._prefetches: deque[list[bytes]] = deque()  # served before the stores
        self._ready_lock = threading.Lock()  # `ready` is filled by the thread too
        self._in_flight: dict[bytes, np.ndarray] = {}  # queued or being stored: served from here
        self._cv = threading.Condition()
        self._busy = False
        self._closed = False
        # counters of the stack as a whole
        self.saved_blocks = 0  # handed to the store thread
        self.dropped_blocks = 0  # not saved: the store thread was behind
        self.loaded_blocks = 0  # loaded back into the pool
        self.prefetched_blocks = 0  # read ahead by the thread
        self.read_on_step = 0  # read while scheduling (not prefetched in time)
        self.swap_ins = 0  # preempted requests that resumed from a tier
        self.copy_s = 0.0  # the step's own time copying blocks out of and into the pool
        self._thread = threading.Thread(target=self._run, name="kv-offload", daemon=True)
        self._thread.start()

    # ---- the step's side -----------------------------------------------------------------
    def holds(self, key: bytes) -> bool:
        if key in self.ready or key in self._in_flight:  # (a dict lookup: safe unlocked)
            return True
        for tier, lock in zip(self.tiers, self._locks):
            with lock:
                if tier.contains(key):
                    return True
        return False

    def leading(self, keys: list[bytes]) -> int:
        n = 0
        for key in keys:
            if not self.holds(key):
                break
            n += 1
        return n

    def fetch(self, keys: list[bytes]) -> list[np.ndarray]:
        out: list[np.ndarray] = []
        read_bytes, t0 = 0, time.perf_counter()
        for key in keys:
            with self._ready_lock:
                payload = self.ready.get(key)
            if payload is None:
                payload = self._in_flight.get(key)
            if payload is None:
                payload, fresh = self._read(key)
                if payload is None:
                    break
                if fresh:
                    read_bytes += payload.nbytes
                    self.read_on_step += 1
            out.append(payload)
        if read_bytes:
            self.cost.observe_load(read_bytes, time.perf_counter() - t0)
        return out

    def _keep(self, key: bytes, payload: np.ndarray) -> None:
        with self._ready_lock:
            self.ready[key] = payload
            while len(self.ready) > self.max_ready:
                self.ready.popitem(last=False)

    def prefetch(self, keys: list[bytes]) -> None:
        """Read these blocks ahead, in the background, up to the first one no tier holds (and
        no more than half the ready set, so a long history does not push out its own start)."""
        if keys:
            with self._cv:
                self._prefetches.append(keys[: max(1, self.max_ready // 2)])
                self._cv.notify()

    def _read(self, key: bytes) -> tuple[np.ndarray | None, bool]:
        """The block from the first tier that has it, kept in the ready set; and whether this
        call read it (False: the other reader, step or read-ahead, had just read it: the tier
        lock orders the two, and the ready set is checked under it)."""
        for tier, lock in zip(self.tiers, self._locks):
            with lock:
                with self._ready_lock:
                    payload = self.ready.get(key)
                if payload is not None:
                    return payload, False
                if not tier.contains(key):
                    continue
                payload = tier.get(key)
                if payload is not None:
                    self._keep(key, payload)
                    return payload, True
        return None, False

    def taken(self, keys: list[bytes]) -> None:
        """A request took these fetched blocks (they are in the pool now)."""
        with self._ready_lock:
            for key in keys:
                self.ready.pop(key, None)
        self.loaded_blocks += len(keys)

    def save(self, keys: list[bytes], payloads: np.ndarray) -> None:
        """Queue blocks for the tiers: `payloads[i]` is block `keys[i]`'s bytes (a copy the
        caller no longer touches)."""
        with self._cv:
            for key, payload in zip(keys, payloads):
                if len(self._queue) >= self.max_pending:
                    self.dropped_blocks += 1
                    continue
                self._queue.append((key, payload))
                self._in_flight[key] = payload
                self.saved_blocks += 1
            self._cv.notify()

    def state(self) -> KVOffloadState:
        """The counters as the worker reports them."""
        tiers = []
        for tier, lock in zip(self.tiers, self._locks):
            with lock:
                st, used = tier.stats, tier.used_bytes()
            tiers.append(
                KVTierState(
                    tier.name,
                    tier.capacity_bytes,
                    used,
                    st.hits,
                    dict(st.misses),
                    st.loaded_bytes,
                    st.load_s,
                    st.stored,
                    st.stored_bytes,
                    st.store_s,
                    st.store_errors,
                    st.evicted,
                )  # fmt: skip
            )
        return KVOffloadState(
            self.saved_blocks, self.dropped_blocks, self.loaded_blocks, self.swap_ins,
            self.copy_s, self.prefetched_blocks, self.read_on_step, tiers,
        )  # fmt: skip

    # ---- the store thread ----------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._prefetches and not self._closed:
                    self._busy = False
                    self._cv.notify_all()
                    self._cv.wait()
                if self._closed and not self._queue:
                    self._busy = False
                    self._cv.notify_all()
                    return
                self._busy = True
                if self._prefetches:
                    job = self._prefetches.popleft()
                else:
                    key, payload = self._queue.popleft()
                    job = None
            if job is not None:
                self._read_ahead(job)
                continue
            self._store(key, payload)
            with self._cv:
                if self._in_flight.get(key) is payload:
                    del self._in_flight[key]

    def _read_ahead(self, keys: list[bytes]) -> None:
        read_bytes, t0 = 0, time.perf_counter()
        for key in keys:
            if key in self.ready or key in self._in_flight:
                continue
            payload, fresh = self._read(key)
            if payload is None:
                break
            if fresh:
                read_bytes += payload.nbytes
                self.prefetched_blocks += 1
        if read_bytes:
            self.cost.observe_load(read_bytes, time.perf_counter() - t0)

    def _store(self, key: bytes, payload: np.ndarray) -> None:
        moving = [(key, payload, checksum(payload))]
        for tier, lock in zip(self.tiers, self._locks):
            demoted = []
            for k, p, crc in moving:
                with lock:
                    demoted += tier.put(k, p, crc)
            moving = demoted
            if not moving:
                break

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every queued save and prefetch is done; False if that took over
        `timeout`."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while self._queue or self._prefetches or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(left)
        return True

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join(timeout=30)
        for tier in self.tiers:
            tier.close()
