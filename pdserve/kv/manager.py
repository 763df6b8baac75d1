"""KVCacheManager: which blocks each request holds, and prefix matching over the block pool.

Per request it keeps the list of blocks (its block table) and publishes each block to the prefix
cache as soon as the step that fills it is scheduled: a second request scheduled in the same step
can then share it, since a layer writes every token's KV before any token attends (this is how the
`n` completions of one prompt share the prompt's blocks). No torch here.

With an offload tier (`kv/offload/`), a prompt's prefix may continue past the pool's hits into
the tier: those blocks get fresh pool blocks and are loaded into them after scheduling, before
the step's forward (`take_transfers`), and blocks the pool evicts are handed out to be saved.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from pdserve.kv.block_pool import BlockPool, KVBlock, hash_block
from pdserve.kv.offload.stack import TierStack
from pdserve.request import Request


@dataclass(slots=True)
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # prompt tokens found (in the pool or a tier)
    tier_hits: int = 0  # of which loaded back from an offload tier


@dataclass(slots=True)
class PrefixMatch:
    """A request's cached prefix: whole blocks in the pool, then blocks fetched from a tier
    (verified payloads, loaded into fresh blocks once the request gets them)."""

    blocks: list[KVBlock] = field(default_factory=list)
    loads: list[np.ndarray] = field(default_factory=list)
    keys: list[bytes] = field(default_factory=list)  # the hashes of `loads`

    @property
    def num_blocks(self) -> int:
        return len(self.blocks) + len(self.loads)


@dataclass(slots=True)
class KVTransfers:
    """Copies the runner makes after scheduling and before the forward, in this order."""

    save: list[tuple[int, bytes]]  # (block id, hash): evicted blocks whose contents go to a tier
    load: list[tuple[int, np.ndarray]]  # (block id, payload): tier hits into fresh blocks

    def __bool__(self) -> bool:
        return bool(self.save or self.load)


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        tier: TierStack | None = None,
    ) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_blocks: dict[str, list[KVBlock]] = {}
        self.req_block_ids: dict[str, list[int]] = {}  # the block table handed to the runner
        self.req_num_cached_blocks: dict[str, int] = {}
        self.stats = PrefixCacheStats()
        if tier is not None and not enable_caching:
            raise ValueError("an offload tier needs prefix caching (its keys are block hashes)")
        self.tier = tier
        self._saves: list[tuple[int, bytes]] = []
        self._loads: dict[int, np.ndarray] = {}  # block id -> payload, loaded after scheduling
        if tier is not None:
            self.pool.on_evict = self._on_evict

    def _on_evict(self, block_id: int, block_hash: bytes) -> None:
        if self._loads.pop(block_id, None) is not None:
            return  # loaded and evicted in one schedule: the tier has it, the new owner writes
        self._saves.append((block_id, block_hash))

    def take_transfers(self) -> KVTransfers:
        """The copies between the pool and the tier that this schedule decided."""
        out = KVTransfers(self._saves, list(self._loads.items()))
        self._saves, self._loads = [], {}
        return out

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def block_ids(self, request_id: str) -> list[int]:
        return self.req_block_ids[request_id]

    def _update_hashes(self, request: Request, num_tokens: int) -> None:
        """Extend `request.block_hashes` to cover the full blocks within its first `num_tokens`."""
        bs, hashes, tokens = self.block_size, request.block_hashes, request.all_token_ids
        for i in range(len(hashes), num_tokens // bs):
            hashes.append(hash_block(hashes[-1] if hashes else None, tokens[i * bs : (i + 1) * bs]))

    def get_computed_blocks(self, request: Request) -> tuple[PrefixMatch, int]:
        """The longest cached prefix of a new (or preempted) request, as whole blocks: in the
        pool, then in the offload tier when loading them is faster than computing them.

        At least one token is always left to compute, so the step produces logits for it."""
        match = PrefixMatch()
        if not self.enable_caching:
            return match, 0
        self._update_hashes(request, request.num_tokens - 1)
        for h in request.block_hashes:
            block = self.pool.lookup(h)
            if block is None:
                break
            match.blocks.append(block)
        if self.tier is not None and len(match.blocks) < len(request.block_hashes):
            rest = request.block_hashes[len(match.blocks) :]
            n = self.tier.leading(rest)
            if n and self.tier.cost.worth_loading(n):
                match.loads = self.tier.fetch(rest[:n])
                match.keys = rest[: len(match.loads)]
        return match, match.num_blocks * self.block_size

    def prefetch(self, request: Request) -> None:
        """A request arrived: have the tier read the blocks of its prompt that the pool lacks,
        while it waits to be scheduled."""
        if self.tier is None or request.sampling_params.prompt_logprobs is not None:
            return
        self._update_hashes(request, request.num_tokens - 1)
        hashes = request.block_hashes
        n = 0
        while n < len(hashes) and self.pool.lookup(hashes[n]) is not None:
            n += 1
        if n < len(hashes) and self.tier.cost.worth_loading(len(hashes) - n):
            self.tier.prefetch(hashes[n:])

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        match: PrefixMatch | None = None,
        publish: bool = True,
        keep_free: int = 0,
    ) -> bool:
        """Make room for `num_new_tokens` more tokens after `num_computed_tokens` (and after the
        cached prefix in `match`). Returns False, changing nothing, if the pool is short or would
        keep fewer than `keep_free` blocks free. `publish=False` keeps the new blocks out of the
        prefix cache until `publish_blocks`: for blocks reserved for KV that another worker
        will send."""
        rid = request.request_id
        blocks = self.req_blocks.get(rid)
        if blocks is None:
            blocks = self.req_blocks[rid] = []
            self.req_block_ids[rid] = []
            self.req_num_cached_blocks[rid] = 0
        hits = match.blocks if match is not None else []
        loads = match.loads if match is not None else []
        num_computed = request.num_computed_tokens + (len(hits) + len(loads)) * self.block_size
        total = num_computed + num_new_tokens
        num_needed = -(-total // self.block_size) - len(blocks) - len(hits)
        num_reclaimed = sum(1 for b in hits if b.ref_cnt == 0)
        if num_needed > self.pool.num_free_blocks - num_reclaimed - keep_free:
            return False
        block_ids = self.req_block_ids[rid]
        if hits:
            self.pool.touch(hits)
            blocks.extend(hits)
            block_ids.extend(b.block_id for b in hits)
            self.req_num_cached_blocks[rid] += len(hits)
        if num_needed > 0:
            new_blocks = self.pool.allocate(num_needed)
            blocks.extend(new_blocks)
            block_ids.extend(b.block_id for b in new_blocks)
            for block, payload in zip(new_blocks, loads):  # the tier's blocks come first
                self._loads[block.block_id] = payload
        if match is not None:  # counted once the request holds them, not per lookup
            self.stats.queries += request.num_tokens
            self.stats.hits += match.num_blocks * self.block_size
            self.stats.tier_hits += len(loads) * self.block_size
        if loads:
            self.tier.taken(match.keys)
            if request.metrics.num_preemptions:
                self.tier.swap_ins += 1
        if self.enable_caching and publish:
            self._cache_full_blocks(request, blocks, total)
        return True

    def publish_blocks(self, request: Request, num_tokens: int) -> None:
        """Publish the full blocks within the first `num_tokens` tokens (their KV is now valid)."""
        if self.enable_caching:
            self._cache_full_blocks(request, self.req_blocks[request.request_id], num_tokens)

    def _cache_full_blocks(self, request: Request, blocks: list[KVBlock], num_tokens: int) -> None:
        rid = request.request_id
        start = self.req_num_cached_blocks[rid]
        end = min(num_tokens, request.num_tokens) // self.block_size
        if end <= start:
            return
        self._update_hashes(request, end * self.block_size)
        for i in range(start, end):
            self.pool.cache(blocks[i], request.block_hashes[i])
        self.req_num_cached_blocks[rid] = end

    def trim(self, request: Request, num_tokens: int) -> None:
        """Return the request's blocks past its first `num_tokens` tokens: those that only held
        the KV of rejected speculative proposals (never published: they hold no committed
        token)."""
        rid = request.request_id
        blocks = self.req_blocks.get(rid)
        keep = -(-num_tokens // self.block_size)
        if not blocks or len(blocks) <= keep:
            return
        extra = blocks[keep:]
        del blocks[keep:]
        del self.req_block_ids[rid][keep:]
        self.req_num_cached_blocks[rid] = min(self.req_num_cached_blocks[rid], keep)
        self.pool.free(reversed(extra))

    def free(self, request: Request) -> None:
        """Return every block of the request (tail first, so the tail is evicted first)."""
        rid = request.request_id
        blocks = self.req_blocks.pop(rid, None)
        self.req_block_ids.pop(rid, None)
        self.req_num_cached_blocks.pop(rid, None)
        if not blocks:
            return
        if self._loads:  # ended in the schedule that loaded it: unpublished blocks need no bytes
            for b in blocks:
                if b.block_hash is None:
                    self._loads.pop(b.block_id, None)
        self.pool.free(reversed(blocks))

    def detach(self, request: Request) -> list[KVBlock]:
        """Take a request's blocks out of its hands without freeing them (the caller frees them
        later with `pool.free`): for blocks another process may still be writing into."""
        rid = request.request_id
        self.req_block_ids.pop(rid, None)
        self.req_num_cached_blocks.pop(rid, None)
        return self.req_blocks.pop(rid, [])

    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks
