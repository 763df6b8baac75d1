"""The disk tier: one file per block in a directory named by the layout fingerprint.

`PATH/<fingerprint>/<key>.kv` (directories 0700, files 0600) holds a header (magic, fingerprint,
key, payload length, CRC-32) and the payload. A file is written under a temporary name and
renamed into place, so a reader sees a whole entry or none; a torn, truncated or altered file
fails its checks and is a miss (and is removed). A full disk or a deleted directory makes a
store fail (counted) or a read miss (counted); the directory is made again on the next store.

The fingerprint includes a digest of the model's weights (`entry.weights_digest`), so a server
restarted with the same model and settings finds its entries again and any other model or
setting finds an empty directory of its own. Eviction is least recently used over the
directory: a hit refreshes the file's mtime, each worker indexes the files it finds (at start
and again every 256 stores, oldest mtime first) with those it stores and reads meanwhile, and
removes the oldest while the directory holds more than `SIZE` (workers sharing a directory may
overshoot it by what they stored since their last scan).
"""

from __future__ import annotations

import contextlib
import os
import struct
import time
import uuid
from collections import OrderedDict

import numpy as np

from pdserve.kv.offload.base import Demoted, TierStats
from pdserve.kv.offload.entry import checksum

MAGIC = b"PDKVDSK1"
_HEADER = struct.Struct("<8s16s16sQI")  # magic, fingerprint, key, payload length, CRC-32
SUFFIX = ".kv"
RESCAN_EVERY = 256  # stores between two scans of the directory (what other workers stored)
STALE_TMP_NS = 60 * 10**9  # a temporary file this old is a store that died


class DiskTier:
    name = "disk"

    def __init__(self, root: str, capacity_bytes: int, payload_bytes: int, fp: bytes) -> None:
        self.fp = fp
        self.payload_bytes = payload_bytes
        self.entry_bytes = _HEADER.size + payload_bytes
        if capacity_bytes < self.entry_bytes:
            raise ValueError(
                f"invalid kv_offload disk size {capacity_bytes}: one block needs "
                f"{self.entry_bytes} bytes"
            )
        self.capacity_bytes = capacity_bytes
        self.root = root
        self.dir = os.path.join(root, fp.hex())
        self.stats = TierStats()
        self.index: OrderedDict[bytes, None] = OrderedDict()  # least recently used first
        self._stores_since_scan = 0
        self._make_dir()
        self._scan()

    def _make_dir(self) -> None:
        os.makedirs(self.dir, mode=0o700, exist_ok=True)
        os.chmod(self.dir, 0o700)  # whatever the umask; PATH itself stays as the user made it

    def _scan(self) -> None:
        """Index the entries here (a restart, or what other workers stored), least recently
        used first: every hit refreshes its file's mtime."""
        found = []
        stale = time.time_ns() - STALE_TMP_NS
        try:
            with os.scandir(self.dir) as it:
                for e in it:
                    try:
                        if e.name.endswith(SUFFIX) and len(e.name) == 32 + len(SUFFIX):
                            found.append((e.stat().st_mtime_ns, bytes.fromhex(e.name[:32])))
                        elif ".tmp-" in e.name and e.stat().st_mtime_ns < stale:
                            _remove(e.path)  # a store that never finished
                    except (OSError, ValueError):
                        continue
        except OSError:
            return
        self.index.clear()
        for _, key in sorted(found):
            self.index[key] = None
        self._stores_since_scan = 0

    def _path(self, key: bytes) -> str:
        return os.path.join(self.dir, key.hex() + SUFFIX)

    def used_bytes(self) -> int:
        return len(self.index) * self.entry_bytes

    def contains(self, key: bytes) -> bool:
        if key in self.index:
            return True
        if os.path.exists(self._path(key)):  # stored by another worker
            self.index[key] = None
            return True
        return False

    def get(self, key: bytes) -> np.ndarray | None:
        t0 = time.perf_counter()
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                data = f.read(self.entry_bytes + 1)
        except FileNotFoundError:
            self.index.pop(key, None)
            self.stats.misses["absent"] += 1
            return None
        except OSError:
            self.stats.misses["error"] += 1
            return None
        if len(data) != self.entry_bytes:
            return self._corrupt(key, path)
        magic, fp, k, length, crc = _HEADER.unpack_from(data)
        if magic != MAGIC or fp != self.fp or k != key or length != self.payload_bytes:
            return self._corrupt(key, path)
        payload = np.frombuffer(data, dtype=np.uint8, offset=_HEADER.size).copy()
        if checksum(payload) != crc:
            return self._corrupt(key, path)
        with contextlib.suppress(OSError):
            os.utime(path)  # a use: the LRU of every worker reads mtimes at start
        self.index[key] = None
        self.index.move_to_end(key)
        self.stats.hits += 1
        self.stats.loaded_bytes += length
        self.stats.load_s += time.perf_counter() - t0
        return payload

    def _corrupt(self, key: bytes, path: str) -> None:
        self.stats.misses["corrupt"] += 1
        self.index.pop(key, None)
        _remove(path)
        return None

    def put(self, key: bytes, payload: np.ndarray, crc: int) -> Demoted:
        if payload.nbytes != self.payload_bytes:
            raise ValueError(
                f"payload of {payload.nbytes} bytes, this tier holds {self.payload_bytes}"
            )
        if key in self.index:
            self.index.move_to_end(key)
            return []
        t0 = time.perf_counter()
        path = self._path(key)
        tmp = f"{path}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        header = _HEADER.pack(MAGIC, self.fp, key, payload.nbytes, crc)
        try:
            if not os.path.isdir(self.dir):
                self._make_dir()  # deleted under us: start again, empty
                self.index.clear()
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                _write_all(fd, header)
                _write_all(fd, memoryview(payload.reshape(-1)))
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except OSError:
            self.stats.store_errors += 1
            _remove(tmp)
            return []
        self.index[key] = None
        self.stats.stored += 1
        self.stats.stored_bytes += payload.nbytes
        self._stores_since_scan += 1
        if self._stores_since_scan >= RESCAN_EVERY:
            self._scan()
        while self.used_bytes() > self.capacity_bytes:
            old, _ = self.index.popitem(last=False)
            _remove(self._path(old))
            self.stats.evicted += 1
        self.stats.store_s += time.perf_counter() - t0
        return []

    def close(self) -> None:
        pass


def _write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data).cast("B")
    while view:
        n = os.write(fd, view)
        view = view[n:]


def _remove(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)
