"""KVCacheManager: which blocks each request holds, and prefix matching over the block pool.

Per request it keeps the list of blocks (its block table) and publishes each block to the prefix
cache as soon as the step that fills it is scheduled: a second request scheduled in the same step
can then share it, since a layer writes every token's KV before any token attends (this is how the
`n` completions of one prompt share the prompt's blocks). No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.kv.block_pool import BlockPool, KVBlock, hash_block
from pdserve.request import Request


@dataclass(slots=True)
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # prompt tokens found


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_blocks: dict[str, list[KVBlock]] = {}
        self.req_block_ids: dict[str, list[int]] = {}  # the block table handed to the runner
        self.req_num_cached_blocks: dict[str, int] = {}
        self.stats = PrefixCacheStats()

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

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """The longest cached prefix of a new (or preempted) request, as whole blocks.

        At least one token is always left to compute, so the step produces logits for it."""
        if not self.enable_caching:
            return [], 0
        self._update_hashes(request, request.num_tokens - 1)
        hits: list[KVBlock] = []
        for h in request.block_hashes:
            block = self.pool.lookup(h)
            if block is None:
                break
            hits.append(block)
        num_hit_tokens = len(hits) * self.block_size
        self.stats.queries += request.num_tokens
        self.stats.hits += num_hit_tokens
        return hits, num_hit_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVBlock] = (),
        publish: bool = True,
        keep_free: int = 0,
    ) -> bool:
        """Make room for `num_new_tokens` more tokens after `num_computed_tokens` (and after any
        cache hits in `new_computed_blocks`). Returns False, changing nothing, if the pool is short
        or would keep fewer than `keep_free` blocks free. `publish=False` keeps the new blocks out
        of the prefix cache until `publish_blocks`: for blocks reserved for KV that another worker
        will send."""
        rid = request.request_id
        blocks = self.req_blocks.get(rid)
        if blocks is None:
            blocks = self.req_blocks[rid] = []
            self.req_block_ids[rid] = []
            self.req_num_cached_blocks[rid] = 0
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        total = num_computed + num_new_tokens
        num_needed = -(-total // self.block_size) - len(blocks) - len(new_computed_blocks)
        num_reclaimed = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_needed > self.pool.num_free_blocks - num_reclaimed - keep_free:
            return False
        block_ids = self.req_block_ids[rid]
        if new_computed_blocks:
            self.pool.touch(new_computed_blocks)
            blocks.extend(new_computed_blocks)
            block_ids.extend(b.block_id for b in new_computed_blocks)
            self.req_num_cached_blocks[rid] += len(new_computed_blocks)
        if num_needed > 0:
            new_blocks = self.pool.allocate(num_needed)
            blocks.extend(new_blocks)
            block_ids.extend(b.block_id for b in new_blocks)
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
        if blocks:
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
