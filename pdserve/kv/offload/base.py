"""The interface every tier keeps, and the counters it keeps."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

Demoted = list[tuple[bytes, np.ndarray, int]]  # (key, payload, CRC) pushed out, for the next tier


@dataclass
class TierStats:
    """Cumulative counters of one tier (a worker's view of it)."""

    hits: int = 0  # entries read back and verified
    misses: Counter = field(default_factory=Counter)  # by reason: absent, corrupt, raced, error
    loaded_bytes: int = 0
    load_s: float = 0.0
    stored: int = 0  # entries written
    stored_bytes: int = 0
    store_s: float = 0.0
    store_errors: int = 0  # writes that failed (full disk, deleted directory): nothing stored
    evicted: int = 0  # entries dropped (or handed to the next tier) for room


class Tier(Protocol):
    name: str  # "cpu" or "disk"
    capacity_bytes: int
    stats: TierStats

    def used_bytes(self) -> int: ...

    def contains(self, key: bytes) -> bool:
        """Cheap: whether an entry is indexed under `key` (a later `get` may still miss)."""
        ...

    def get(self, key: bytes) -> np.ndarray | None:
        """A verified copy of the entry's payload, or None (a miss, counted by reason)."""
        ...

    def put(self, key: bytes, payload: np.ndarray, crc: int) -> Demoted:
        """Store a payload whose CRC-32 is `crc`; returns the entries evicted for room (for the
        next tier). Never raises on I/O trouble: the write is counted as a store error."""
        ...

    def close(self) -> None: ...
