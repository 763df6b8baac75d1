"""Roles of switchable workers at run time: who prefills, who decodes (no torch).

`RoleManager` applies a split `(p, d)` to the live workers: `p` get the prefill role, the rest the
decode role, or all of them role `both` when `p` is 0. A switch moves no state: the workers run
`DualConnector`s, so the router simply stops giving a worker work of its old role, and what it
holds finishes in place (running decodes decode on, queued prefills hand off as before). Which
workers switch: the ones holding the least of what they stop doing.

With `--pd-merge` the split may be `MERGED`: one worker keeps role `both` and the others are
parked (no new work; what they hold finishes in place). `cpu_sets` then lends the CPUs of every
parked worker that has nothing left to do to the colocated one, which runs a thread on each.

`LoadObserver` turns what the frontend sees (worker states, step times, finished requests,
requests still waiting for their first token) into the `LoadSample`s the P:D controller reads.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass

from pdserve.pools.pd_controller import (
    MERGED,
    Decision,
    LoadSample,
    PDController,
    PhaseSLO,
    describe,
)
from pdserve.types import Role, RoleControl

logger = logging.getLogger("pdserve.pool")

Split = tuple[int, int]


class LoadObserver:
    """A sliding window over the frontend's view of the load."""

    def __init__(self, slo: PhaseSLO, window_s: float = 10.0, clock=time.monotonic) -> None:
        self.slo = slo
        self.window_s = window_s
        self.clock = clock
        self.decode_steps: dict[int, float] = {}  # worker -> smoothed decode step seconds
        self.prefill_on_decoders: deque[tuple[float, int]] = deque()  # (time, prompt tokens)
        self.finished: deque[tuple[float, float | None, float | None]] = deque()
        self.unstarted: dict[str, float] = {}  # request id -> arrival (no first token yet)
        self.arrived: dict[str, float] = {}  # request id -> arrival (not finished yet)
        self.switched_at: float | None = None  # the last switch of the split

    def on_decode_step(self, worker_id: int, step_s: float) -> None:
        old = self.decode_steps.get(worker_id)
        self.decode_steps[worker_id] = step_s if old is None else 0.8 * old + 0.2 * step_s

    def on_prefill_on_decoder(self, num_tokens: int) -> None:
        """A worker that also decodes computed `num_tokens` prompt tokens in one step."""
        self.prefill_on_decoders.append((self.clock(), num_tokens))

    def on_arrival(self, request_id: str) -> None:
        self.unstarted[request_id] = self.arrived[request_id] = self.clock()

    def on_first_output(self, request_id: str) -> None:
        self.unstarted.pop(request_id, None)

    def on_gone(self, request_id: str) -> None:
        """The request ended without finishing (aborted, failed)."""
        self.unstarted.pop(request_id, None)
        self.arrived.pop(request_id, None)

    def on_finish(self, ttft_s: float | None, tpot_s: float | None, request_id: str = "") -> None:
        """A request finished. One that arrived before the last switch is not counted: part of
        its life ran under the old split, whose queue and batch the new one inherited."""
        arrival = self.arrived.pop(request_id, None)
        if self.switched_at is not None and arrival is not None and arrival < self.switched_at:
            return
        self.finished.append((self.clock(), ttft_s, tpot_s))

    def on_switch(self) -> None:
        """The split changed: what was measured under the old one no longer describes the
        deployment (without this, the controller would judge a new split by requests that ran
        under the old one, and switch back one dwell time later). From now on only requests that
        arrive after the switch count towards attainment (`on_finish`)."""
        self.finished.clear()
        self.prefill_on_decoders.clear()
        self.decode_steps.clear()
        self.switched_at = self.clock()

    def _prune(self, now: float) -> None:
        for window in (self.finished, self.prefill_on_decoders):
            while window and now - window[0][0] > self.window_s:
                window.popleft()

    def ttfts(self) -> list[float]:
        """TTFTs of the requests finished in the window."""
        self._prune(self.clock())
        return [t for _, t, _ in self.finished if t is not None]

    def attainment(self) -> tuple[float | None, float | None]:
        """The shares of the requests finished in the window that met the TTFT and the TPOT SLO
        (None: no such request)."""
        self._prune(self.clock())
        ttfts = [t for _, t, _ in self.finished if t is not None]
        tpots = [t for _, _, t in self.finished if t is not None]
        return _share(ttfts, self.slo.ttft_s), _share(tpots, self.slo.tpot_s)

    def sample(self, queued_prefill_tokens: int, kv_usage: float) -> LoadSample:
        now = self.clock()
        ttft_attainment, tpot_attainment = self.attainment()
        oldest = min(self.unstarted.values(), default=now)
        steps = list(self.decode_steps.values())
        return LoadSample(
            t=now,
            queued_prefill_tokens=queued_prefill_tokens,
            oldest_wait_s=now - oldest,
            decode_step_s=max(steps) if steps else None,
            kv_usage=kv_usage,
            ttft_attainment=ttft_attainment,
            tpot_attainment=tpot_attainment,
            prefill_tokens_on_decoders=sum(n for _, n in self.prefill_on_decoders),
            recent_ttfts_s=tuple(self.ttfts()),
        )


def _share(values: list[float], limit: float) -> float | None:
    return sum(v <= limit for v in values) / len(values) if values else None


@dataclass
class Worker:
    """What the role manager needs to know of a worker."""

    worker_id: int
    role: Role
    alive: bool
    num_running: int = 0
    queued_prefill_tokens: int = 0
    num_waiting: int = 0

    @property
    def idle(self) -> bool:
        return self.num_running == 0 and self.num_waiting == 0


def current_split(workers: list[Worker]) -> Split:
    """(prefill, decode or colocated) among the live workers; parked ones are in neither."""
    live = [w for w in workers if w.alive and w.role != Role.PARKED]
    p = sum(w.role == Role.PREFILL for w in live)
    return p, len(live) - p


def assign(workers: list[Worker], split: Split) -> dict[int, Role]:
    """New roles for the live workers so that `split` holds, switching as few as possible and,
    among candidates, the ones holding the least of what they stop doing. `MERGED` keeps the
    worker with the most work (it would take longest to finish) and parks the others."""
    live = [w for w in workers if w.alive]
    p, d = split
    if split == MERGED and len(live) > 1:
        host = max(live, key=lambda w: (w.role.decodes, w.num_running, -w.worker_id))
        return {w.worker_id: Role.BOTH if w is host else Role.PARKED for w in live}
    if p + d != len(live):
        raise ValueError(f"split {describe(split)} does not fit {len(live)} live workers")
    if p == 0:
        return {w.worker_id: Role.BOTH for w in live}
    prefill = [w for w in live if w.role == Role.PREFILL]
    others = [w for w in live if w.role != Role.PREFILL]
    if len(prefill) < p:  # take decode work from the least busy decoders (parked ones first)
        others.sort(key=lambda w: (w.role != Role.PARKED, w.num_running, w.worker_id))
        prefill += others[: p - len(prefill)]
    elif len(prefill) > p:  # keep the prefill workers with the most queued prompt tokens
        prefill.sort(key=lambda w: (-w.queued_prefill_tokens, w.worker_id))
        prefill = prefill[:p]
    chosen = {w.worker_id for w in prefill}
    return {w.worker_id: Role.PREFILL if w.worker_id in chosen else Role.DECODE for w in live}


def cpu_sets(workers: list[Worker], own: dict[int, frozenset[int]]) -> dict[int, frozenset[int]]:
    """The CPUs each live worker should run on: its own (`own`), and for the one colocated
    worker of a merged deployment also those of every parked worker that holds nothing any
    more, or died. A parked worker that still finishes requests keeps its CPUs until it is
    done, so no core ever runs two workers' threads."""
    live = [w for w in workers if w.alive]
    out = {w.worker_id: own[w.worker_id] for w in live}
    active = [w for w in live if w.role != Role.PARKED]
    if len(active) != 1 or not any(w.role == Role.PARKED for w in workers):
        return out
    host = active[0].worker_id
    lent = set(out[host])
    for w in workers:
        if w.role == Role.PARKED and (not w.alive or w.idle):
            lent |= own[w.worker_id]
    out[host] = frozenset(lent)
    return out


class RoleManager:
    """The deployment's split: applied on request (manual) or by the controller (auto)."""

    def __init__(
        self, control: RoleControl, controller: PDController | None = None, history: int = 50
    ) -> None:
        self.control = control
        self.controller = controller
        self.decisions: deque[Decision] = deque(maxlen=history)

    def plan(self, workers: list[Worker], split: Split, reason: str) -> dict[int, Role]:
        """The role changes that make `split` hold (empty when it already does), logged."""
        if self.control == RoleControl.STATIC:
            raise ValueError("the workers' roles are static: start with --pd-ratio manual or auto")
        old = current_split(workers)
        roles = assign(workers, split)
        changes = {wid: r for wid, r in roles.items() if _role_of(workers, wid) != r}
        if changes:
            decision = Decision(time.monotonic(), old, split, reason, len(roles))
            self.decisions.append(decision)
            logger.info("deployment %s -> %s: %s", *decision.describe(), reason)
        return changes

    def tick(self, workers: list[Worker], sample: LoadSample) -> dict[int, Role]:
        """Auto control: feed the controller one sample; the role changes it asks for."""
        if self.controller is None:
            return {}
        # a death or a manual switch moved them
        self.controller.split = current_split(workers)
        self.controller.num_workers = sum(w.alive for w in workers)
        decision = self.controller.observe(sample)
        if decision is None:
            return {}
        return self.plan(workers, decision.new, decision.reason)

    def report(self, workers: list[Worker]) -> dict:
        """What GET /deployment shows."""
        return {
            "control": str(self.control),
            "split": describe(current_split(workers), sum(w.alive for w in workers)),
            "workers": [
                {"id": w.worker_id, "role": str(w.role), "alive": w.alive} for w in workers
            ],
            "decisions": [
                {
                    "old": d.describe()[0],
                    "new": d.describe()[1],
                    "reason": d.reason,
                    "age_s": round(time.monotonic() - d.t, 3),  # how long ago it was made
                }
                for d in self.decisions
            ],
        }


def _role_of(workers: list[Worker], worker_id: int) -> Role:
    return next(w.role for w in workers if w.worker_id == worker_id)
