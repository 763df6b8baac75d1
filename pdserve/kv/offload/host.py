"""The host-memory tier: an arena of fixed-size slots in a shared-memory file.

Every worker of a deployment on one host maps the same file (in the deployment's private
shared-memory directory, 0600), so a block one worker stored is a hit for the others. Layout:

    superblock (4 KiB)   magic, version, slot size, slot count, layout fingerprint, LRU clock
    slot table           per slot: state, CRC-32, sequence number, key, length, last use
    slots                num_slots x slot_bytes of payload

Writers take the table's lock (a thread lock and `flock` on the file) only to claim a slot and to
publish it: a slot is claimed as WRITING with a new sequence number, its payload copied without
the lock, then published VALID with the payload's CRC if its sequence number is still the one
claimed. A reader copies a VALID slot's payload out and keeps it only if the CRC matches and the
sequence number did not move meanwhile; anything else is a miss, never a wrong block. A slot
left WRITING by a worker that died ages like any other and is reclaimed by the LRU.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import struct
import threading
import time
from contextlib import contextmanager

import numpy as np

from pdserve.kv.offload.base import Demoted, TierStats
from pdserve.kv.offload.entry import checksum

MAGIC = b"PDKVHOS1"
SUPER_BYTES = 4096
_SUPER = struct.Struct("<8sQQ16s")  # magic, slot_bytes, num_slots, fingerprint
_CLOCK_AT = 64  # a u64 in the superblock: the LRU clock
EMPTY, WRITING, VALID = 0, 1, 2
TABLE = np.dtype(
    [
        ("state", "<u4"),
        ("crc", "<u4"),
        ("seq", "<u8"),
        ("k0", "<u8"),
        ("k1", "<u8"),
        ("length", "<u8"),
        ("last_use", "<u8"),
        ("pad", "V16"),
    ]
)
assert TABLE.itemsize == 64


def _align(n: int, to: int) -> int:
    return -(-n // to) * to


def _key_words(key: bytes) -> tuple[int, int]:
    return int.from_bytes(key[:8], "little"), int.from_bytes(key[8:16], "little")


class HostTier:
    name = "cpu"

    def __init__(
        self, capacity_bytes: int, payload_bytes: int, fp: bytes, path: str | None = None
    ) -> None:
        """An arena of `capacity_bytes` for payloads of `payload_bytes`. With `path`, the file
        every worker of the deployment shares (created by the first, checked by the others);
        without, a private arena whose file is unlinked as soon as it is mapped."""
        self.payload_bytes = payload_bytes
        self.slot_bytes = _align(payload_bytes, 64)
        self.num_slots = capacity_bytes // self.slot_bytes
        if self.num_slots < 1:
            raise ValueError(
                f"invalid kv_offload cpu size {capacity_bytes}: one block needs "
                f"{payload_bytes} bytes"
            )
        self.capacity_bytes = self.num_slots * self.slot_bytes
        self.stats = TierStats()
        table_bytes = _align(self.num_slots * TABLE.itemsize, 4096)
        size = SUPER_BYTES + table_bytes + self.num_slots * self.slot_bytes
        private = path is None
        if private:
            from pdserve.ipc.channel import private_file

            path = private_file(None, "kvtier", 0)
        self.path = path
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        os.fchmod(self.fd, 0o600)
        self._thread_lock = threading.Lock()
        with self._lock():
            if os.fstat(self.fd).st_size == 0:
                os.ftruncate(self.fd, size)
                os.pwrite(self.fd, _SUPER.pack(MAGIC, self.slot_bytes, self.num_slots, fp), 0)
                ok = True
            else:
                head = os.pread(self.fd, _SUPER.size, 0)
                want = (MAGIC, self.slot_bytes, self.num_slots, fp)
                ok = os.fstat(self.fd).st_size == size and _SUPER.unpack(head) == want
        if not ok:
            os.close(self.fd)
            raise ValueError(f"{path}: a host KV tier of another layout or size is already there")
        self.map = mmap.mmap(self.fd, size)
        if private:
            os.unlink(path)
        buf = np.frombuffer(self.map, dtype=np.uint8)
        self.clock = buf[_CLOCK_AT : _CLOCK_AT + 8].view("<u8")
        self.table = buf[SUPER_BYTES : SUPER_BYTES + self.num_slots * TABLE.itemsize].view(TABLE)
        start = SUPER_BYTES + table_bytes
        self.slots = buf[start:].reshape(self.num_slots, self.slot_bytes)

    @contextmanager
    def _lock(self):
        with self._thread_lock:
            fcntl.flock(self.fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(self.fd, fcntl.LOCK_UN)

    def _tick(self) -> int:
        self.clock[0] += 1
        return int(self.clock[0])

    def _find(self, key: bytes, state: int = VALID) -> int | None:
        k0, k1 = _key_words(key)
        t = self.table
        hit = np.flatnonzero((t["k0"] == k0) & (t["k1"] == k1) & (t["state"] == state))
        return int(hit[0]) if hit.size else None

    def used_bytes(self) -> int:
        return int(np.count_nonzero(self.table["state"] == VALID)) * self.slot_bytes

    def contains(self, key: bytes) -> bool:
        return self._find(key) is not None

    def get(self, key: bytes) -> np.ndarray | None:
        t0 = time.perf_counter()
        i = self._find(key)
        if i is None:
            self.stats.misses["absent"] += 1
            return None
        row = self.table[i]
        seq, crc, length = int(row["seq"]), int(row["crc"]), int(row["length"])
        if length != self.payload_bytes:
            self.stats.misses["corrupt"] += 1
            return None
        out = self.slots[i, :length].copy()
        if self.table["seq"][i] != seq or self.table["state"][i] != VALID:
            self.stats.misses["raced"] += 1  # rewritten while we read: not ours any more
            return None
        if checksum(out) != crc:
            self.stats.misses["corrupt"] += 1
            return None
        with self._lock():
            if self.table["seq"][i] == seq:
                self.table["last_use"][i] = self._tick()
        self.stats.hits += 1
        self.stats.loaded_bytes += length
        self.stats.load_s += time.perf_counter() - t0
        return out

    def put(self, key: bytes, payload: np.ndarray, crc: int) -> Demoted:
        if payload.nbytes != self.payload_bytes:
            raise ValueError(
                f"payload of {payload.nbytes} bytes, this tier holds {self.payload_bytes}"
            )
        t0 = time.perf_counter()
        demoted: Demoted = []
        k0, k1 = _key_words(key)
        with self._lock():
            i = self._find(key)
            if i is not None:  # already here (another worker stored it): a use
                self.table["last_use"][i] = self._tick()
                return demoted
            if self._find(key, WRITING) is not None:
                return demoted  # another worker is storing it right now
            t = self.table
            empty = np.flatnonzero(t["state"] == EMPTY)
            i = int(empty[0]) if empty.size else int(np.argmin(t["last_use"]))
            if t["state"][i] == VALID:
                victim = self._victim(i)
                if victim is not None:
                    demoted.append(victim)
                self.stats.evicted += 1
            seq = int(t["seq"][i]) + 1
            t["state"][i], t["seq"][i] = WRITING, seq
            t["k0"][i], t["k1"][i] = k0, k1
            t["length"][i], t["last_use"][i] = payload.nbytes, self._tick()
        self.slots[i, : payload.nbytes] = payload.reshape(-1)
        with self._lock():
            if self.table["seq"][i] != seq:
                return demoted  # the slot was reclaimed meanwhile: this entry is dropped
            self.table["crc"][i] = crc
            self.table["state"][i] = VALID
        self.stats.stored += 1
        self.stats.stored_bytes += payload.nbytes
        self.stats.store_s += time.perf_counter() - t0
        return demoted

    def _victim(self, i: int) -> tuple[bytes, np.ndarray, int] | None:
        """The payload of a slot about to be reused, if it is intact (for the next tier)."""
        row = self.table[i]
        data = self.slots[i, : int(row["length"])].copy()
        crc = int(row["crc"])
        if int(row["length"]) != self.payload_bytes or checksum(data) != crc:
            return None
        key = int(row["k0"]).to_bytes(8, "little") + int(row["k1"]).to_bytes(8, "little")
        return key, data, crc

    def close(self) -> None:
        self.slots = self.table = self.clock = None
        # a payload view still exported: the mapping goes when the view does
        with contextlib.suppress(BufferError):
            self.map.close()
        os.close(self.fd)
