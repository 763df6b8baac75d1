"""Router: where a request is prefilled and where it decodes (pure logic, no torch).

- Decode worker: the live one with the most free KV blocks (its last report, less what was
  routed to it since); a prompt whose leading blocks a decode (or colocated) worker recently
  saw goes there instead while that worker has room for it and its prompt queue is within
  `affinity_slack_tokens` of the shortest (its prefix cache, or the host's offload tier behind
  it, will likely hit: a conversation's turns stay where its history is).
- Prefill worker: the live one with the fewest queued prefill tokens; a prompt whose leading
  blocks a prefill worker has recently seen goes there instead when its queue is within
  `affinity_slack_tokens` of the shortest (its prefix cache will likely hit).
- Conditional disaggregation: short prompts (`min_prompt_tokens`) and prompts mostly cached on the
  chosen decode worker are prefilled by the decode worker itself: shipping KV would cost more than
  computing it there. With no live prefill worker, everything is local.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from pdserve.kv.block_pool import hash_block
from pdserve.types import Role


@dataclass
class WorkerLoad:
    worker_id: int
    role: Role
    alive: bool = True
    num_free_blocks: int = 0
    queued_prefill_tokens: int = 0
    pending_blocks: int = 0  # routed since the last report
    pending_tokens: int = 0
    recent_hashes: OrderedDict = field(default_factory=OrderedDict)  # LRU of prompt block hashes

    def remember(self, hashes: list[bytes], capacity: int) -> None:
        for h in hashes:
            self.recent_hashes[h] = None
            self.recent_hashes.move_to_end(h)
        while len(self.recent_hashes) > capacity:
            self.recent_hashes.popitem(last=False)

    def matched_blocks(self, hashes: list[bytes]) -> int:
        n = 0
        for h in hashes:
            if h not in self.recent_hashes:
                break
            n += 1
        return n


@dataclass(frozen=True)
class Route:
    decode_id: int
    prefill_id: int | None  # None: prefill on the decode worker
    reason: str  # remote | short_prompt | cached_on_decode | no_prefill_worker | local_only


class Router:
    def __init__(
        self,
        block_size: int,
        min_prompt_tokens: int = 0,
        cached_fraction: float = 0.8,
        affinity_slack_tokens: int = 4096,
        hash_capacity: int = 100_000,
    ) -> None:
        self.block_size = block_size
        self.min_prompt_tokens = min_prompt_tokens
        self.cached_fraction = cached_fraction
        self.affinity_slack_tokens = affinity_slack_tokens
        self.hash_capacity = hash_capacity
        self.workers: dict[int, WorkerLoad] = {}

    def add_worker(self, worker_id: int, role: str, num_free_blocks: int) -> None:
        self.workers[worker_id] = WorkerLoad(worker_id, role, num_free_blocks=num_free_blocks)

    def report(self, worker_id: int, num_free_blocks: int, queued_prefill_tokens: int) -> None:
        w = self.workers[worker_id]
        w.num_free_blocks, w.queued_prefill_tokens = num_free_blocks, queued_prefill_tokens
        w.pending_blocks = w.pending_tokens = 0

    def set_role(self, worker_id: int, role: Role) -> None:
        """A switchable worker's new role: it takes new work of that role only."""
        self.workers[worker_id].role = role

    def set_alive(self, worker_id: int, alive: bool) -> None:
        w = self.workers[worker_id]
        w.alive = alive
        if not alive:
            w.recent_hashes.clear()

    def prompt_hashes(self, prompt: list[int]) -> list[bytes]:
        bs, out = self.block_size, []
        for i in range(len(prompt) // bs):
            out.append(hash_block(out[-1] if out else None, prompt[i * bs : (i + 1) * bs]))
        return out

    def _live(self, *roles: Role) -> list[WorkerLoad]:
        return [w for w in self.workers.values() if w.alive and w.role in roles]

    def route(self, prompt: list[int], remote_prefill: bool = True) -> Route:
        """Where to decode, and where to prefill; `remote_prefill=False` keeps the prompt on
        the decode worker (a request that scores its prompt, or generates nothing)."""
        decoders = self._live(Role.DECODE, Role.BOTH)
        if not decoders:
            raise LookupError("no live decode worker")
        hashes = self.prompt_hashes(prompt)
        num_blocks = -(-len(prompt) // self.block_size)
        dec = self._pick_decode(decoders, hashes, num_blocks)
        dec.pending_blocks += num_blocks
        cached_on_decode = dec.matched_blocks(hashes) * self.block_size
        dec.remember(hashes, self.hash_capacity)
        prefillers = self._live(Role.PREFILL)
        if not prefillers:
            return Route(dec.worker_id, None, "no_prefill_worker")
        if not remote_prefill:
            return Route(dec.worker_id, None, "local_only")
        if len(prompt) < self.min_prompt_tokens:
            return Route(dec.worker_id, None, "short_prompt")
        if cached_on_decode >= self.cached_fraction * len(prompt):
            return Route(dec.worker_id, None, "cached_on_decode")
        pre = self._pick_prefill(prefillers, hashes)
        pre.pending_tokens += len(prompt)
        pre.remember(hashes, self.hash_capacity)
        return Route(dec.worker_id, pre.worker_id, "remote")

    def _pick_decode(
        self, decoders: list[WorkerLoad], hashes: list[bytes], num_blocks: int
    ) -> WorkerLoad:
        def free(w: WorkerLoad) -> int:
            return w.num_free_blocks - w.pending_blocks

        roomiest = max(decoders, key=lambda w: (free(w), -w.worker_id))
        if len(decoders) == 1 or not hashes:
            return roomiest
        best = max(decoders, key=lambda w: (w.matched_blocks(hashes), free(w), -w.worker_id))
        shortest = min(w.queued_prefill_tokens for w in decoders)
        if (
            best.matched_blocks(hashes) > roomiest.matched_blocks(hashes)
            and free(best) >= num_blocks
            and best.queued_prefill_tokens <= shortest + self.affinity_slack_tokens
        ):
            return best
        return roomiest

    def _pick_prefill(self, prefillers: list[WorkerLoad], hashes: list[bytes]) -> WorkerLoad:
        def queued(w: WorkerLoad) -> int:
            return w.queued_prefill_tokens + w.pending_tokens

        least = min(prefillers, key=lambda w: (queued(w), w.worker_id))
        best = max(prefillers, key=lambda w: (w.matched_blocks(hashes), -queued(w)))
        if (
            best.matched_blocks(hashes) > 0
            and queued(best) <= queued(least) + self.affinity_slack_tokens
        ):
            return best
        return least
