"""Priorities: the order of requests, aging, and who gives way to whom (no torch).

A request's *level* is its `SamplingParams.priority` (lower is more urgent) less one per
`priority_aging_s` it has waited since it arrived, so a low priority is delayed, never starved.
Requests are ordered by (level, arrival): FCFS within a level. Every rule here is a no-op while
no request sets a priority, so the scheduler's order stays FCFS at no cost.

With `priority_preemption`, levels also decide who computes: `urgent_level` is the most urgent
level among requests with prompt tokens to compute, and requests less urgent than it sit the
step out (their streams pause while the urgent prompt prefills); a waiting request that finds no
sequence slot or no KV blocks may take them from a less urgent running one (`victim`).
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Callable, Iterable, Sequence

from pdserve.config import SchedulerConfig
from pdserve.request import Request


class PriorityPolicy:
    def __init__(self, config: SchedulerConfig) -> None:
        self.aging_s = config.priority_aging_s
        self.preemption = config.priority_preemption

    def key(self, now: float) -> Callable[[Request], tuple[int, float]]:
        """The sort key at time `now`: (aged level, arrival)."""
        aging = self.aging_s

        def key(request: Request) -> tuple[int, float]:
            aged = math.floor((now - request.arrival_time) / aging)
            return request.sampling_params.priority - aged, request.arrival_time

        return key

    def level(self, now: float) -> Callable[[Request], int]:
        key = self.key(now)
        return lambda request: key(request)[0]

    @staticmethod
    def in_play(requests: Iterable[Request]) -> bool:
        return any(r.sampling_params.priority for r in requests)

    def ordered(self, waiting: deque[Request], now: float) -> deque[Request]:
        """The waiting queue in admission order."""
        if self.in_play(waiting):
            return deque(sorted(waiting, key=self.key(now)))
        return waiting

    def sort_running(self, running: list[Request], now: float) -> None:
        """Urgent requests first, so their chunks take the budget first."""
        if self.in_play(running):
            running.sort(key=self.key(now))

    def victim(self, candidates: Sequence[Request], now: float) -> Request:
        """The request to preempt: the newest, or with priorities in play the newest of the
        least urgent."""
        if self.in_play(candidates):
            return max(candidates, key=self.key(now))
        return candidates[-1]

    def urgent_level(
        self, running: Sequence[Request], waiting: deque[Request], now: float
    ) -> int | None:
        """priority_preemption: the most urgent level among the requests with prompt tokens to
        compute (running prompts, the waiting head). None when the setting is off or every
        request is at the same level."""
        if not self.preemption:
            return None
        level = self.level(now)
        if len({level(r) for r in (*running, *waiting)}) < 2:
            return None
        pending = [r for r in running if r.num_tokens - r.num_computed_tokens > 1]
        pending += list(itertools.islice(waiting, 1))
        return min((level(r) for r in pending), default=None)

    def yielding_to(
        self, request: Request, running: Sequence[Request], now: float, planned: set[int]
    ) -> list[Request]:
        """priority_preemption: the running requests (not in this step's plan) that `request`
        may preempt for a slot or blocks: those less urgent than it."""
        if not self.preemption:
            return []
        level = self.level(now)
        mine = level(request)
        return [r for r in running if id(r) not in planned and level(r) > mine]
