"""The pool of KV-cache blocks: allocation, reference counts, the prefix-cache map and LRU eviction.

Pure bookkeeping over block ids (no torch): the tensors live in the model runner. Invariants:
a block is either referenced (ref_cnt > 0) or in `free_queue`; a block with a `block_hash` is in
`cached` under that hash; free blocks are handed out least-recently-used first, so a freed block
keeps its cached contents until the pool needs the space.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass


def hash_block(parent_hash: bytes | None, token_ids: Sequence[int]) -> bytes:
    """Chained hash of one full block: it names the block's tokens and everything before them."""
    h = hashlib.blake2b(parent_hash or b"", digest_size=16)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


@dataclass(slots=True, eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"invalid num_blocks={num_blocks}: must be >= 1")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # block_id -> block; the front is evicted first.
        self.free_queue: OrderedDict[int, KVBlock] = OrderedDict(
            (b.block_id, b) for b in self.blocks
        )
        self.cached: dict[bytes, KVBlock] = {}
        # Called with (block_id, hash) when a cached block is taken for reuse: an offload
        # tier saves its contents before the step overwrites them.
        self.on_evict: Callable[[int, bytes], None] | None = None

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by live requests (cached free blocks count as free)."""
        return 1.0 - len(self.free_queue) / self.num_blocks

    def lookup(self, block_hash: bytes) -> KVBlock | None:
        return self.cached.get(block_hash)

    def allocate(self, n: int) -> list[KVBlock]:
        """Take `n` blocks off the free queue (evicting their cached contents)."""
        if n > len(self.free_queue):
            raise RuntimeError(f"asked for {n} blocks with {len(self.free_queue)} free")
        out = []
        for _ in range(n):
            _, block = self.free_queue.popitem(last=False)
            if block.block_hash is not None:
                del self.cached[block.block_hash]
                if self.on_evict is not None:
                    self.on_evict(block.block_id, block.block_hash)
                block.block_hash = None
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on cached blocks that a new request reuses."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free_queue[block.block_id]
            block.ref_cnt += 1

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference on each block. Pass a request's blocks tail first: the tail is the
        least likely to be shared, so it is evicted first."""
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt < 0:
                raise RuntimeError(f"block {block.block_id} freed twice")
            if block.ref_cnt == 0:
                self.free_queue[block.block_id] = block
                if block.block_hash is None:  # nothing worth keeping: hand it out first
                    self.free_queue.move_to_end(block.block_id, last=False)

    def cache(self, block: KVBlock, block_hash: bytes) -> None:
        """Publish a full block under its hash; the first block to claim a hash keeps it."""
        if self.enable_caching and block.block_hash is None and block_hash not in self.cached:
            block.block_hash = block_hash
            self.cached[block_hash] = block

    def check_whole(self) -> None:
        """Raise if any block is still referenced (every request has ended)."""
        held = [b.block_id for b in self.blocks if b.ref_cnt != 0]
        if held or len(self.free_queue) != self.num_blocks:
            raise AssertionError(f"KV blocks still referenced: {held[:16]} ({len(held)} in all)")
