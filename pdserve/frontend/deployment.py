"""The deployment as the frontend sees and changes it: which worker has which role.

Static (`--pd-ratio static`): roles are fixed at startup and `report` only describes them. With
`manual` or `auto` the workers are switchable: `set_split` (POST /deployment) or the P:D
controller (`control_loop`, every second) give them new roles through the router. With
`--pd-merge` a split may park workers: each parked worker's CPUs go to the one colocated worker
(`SetCPUs`) once it holds nothing any more, and go back when a split gives it work again. The
client feeds `on_step`, `on_arrival`, `on_output` and `on_gone`, from which `LoadObserver` builds
the samples the controller reads and the SLO attainment gauges, and `PrefillRate` the prefill
rate that SLO-aware admission predicts with (`pdserve.frontend.admission`).
"""

from __future__ import annotations

import asyncio
import logging

from pdserve.config import DisaggConfig
from pdserve.engine.cpu_placement import parse_cpu_set
from pdserve.frontend.admission import PrefillRate
from pdserve.ipc.messages import SetCPUs, StepOutputs
from pdserve.pools.pd_controller import MERGED, PDController, PhaseSLO
from pdserve.pools.roles import LoadObserver, RoleManager, cpu_sets
from pdserve.pools.roles import Worker as RoleWorker
from pdserve.pools.worker_pool import WorkerHandle, WorkerPool
from pdserve.types import RequestOutput, Role, RoleControl

logger = logging.getLogger("pdserve.frontend")


class Deployment:
    def __init__(self, disagg: DisaggConfig, pool: WorkerPool, metrics=None) -> None:
        self.pool = pool
        self.metrics = metrics
        self.router = None  # set once the client has built it
        self.roles: RoleManager | None = None  # switchable workers only
        self.slo = slo = PhaseSLO.parse(disagg.slo)
        self.load = LoadObserver(slo)
        self.prefill_rate = PrefillRate()
        self.merge = disagg.pd_merge
        self.start_merged = disagg.pd_merge and disagg.num_prefill_workers == 0
        # --pd-merge: each worker's own CPU set, and the set it was last told to run on
        self.own_cpus: dict[int, frozenset[int]] = {}
        self.cpus_sent: dict[int, frozenset[int]] = {}
        if self.merge:
            self.own_cpus = {i: parse_cpu_set(spec.cpus) for i, spec in enumerate(pool.specs)}
            self.cpus_sent = dict(self.own_cpus)
        if disagg.switchable:
            controller = None
            if disagg.pd_ratio == RoleControl.AUTO:
                start = (disagg.num_prefill_workers, disagg.num_decode_workers)
                controller = PDController(
                    disagg.num_workers,
                    slo,
                    start=start,
                    min_dwell_s=disagg.pd_min_dwell_s,
                    merge=disagg.pd_merge,
                )
            self.roles = RoleManager(disagg.pd_ratio, controller)

    @property
    def automatic(self) -> bool:
        return self.roles is not None and self.roles.controller is not None

    def start(self) -> None:
        """The workers are up: with --pd-merge and no prefill workers, merge at once."""
        if self.start_merged:
            self._apply(self.roles.plan(self._view(), MERGED, "start (--pd-merge)"))

    # ---- what the client sees ------------------------------------------------------------
    def on_step(self, worker: WorkerHandle, msg: StepOutputs) -> None:
        for st in msg.steps:
            self.prefill_rate.observe(worker.worker_id, st.num_prefill_tokens, st.step_time_s)
            if st.num_decode_seqs:
                self.load.on_decode_step(worker.worker_id, st.step_time_s)
            if st.num_prefill_tokens and worker.role.decodes:
                self.load.on_prefill_on_decoder(st.num_prefill_tokens)
        if self.merge:  # a parked worker may have finished its last request
            self._lend()

    def on_arrival(self, request_id: str) -> None:
        self.load.on_arrival(request_id)

    def on_output(self, out: RequestOutput) -> None:
        self.load.on_first_output(out.request_id)
        if out.finished and out.metrics is not None:
            self.load.on_finish(out.metrics.ttft, out.metrics.tpot, out.request_id)
            if self.metrics is not None:
                ttft, tpot = self.load.attainment()
                self.metrics.set_slo_attainment(ttft, tpot)

    def on_gone(self, request_id: str) -> None:
        self.load.on_gone(request_id)

    def current_prefill_rate(self) -> float | None:
        """Prompt tokens per second the deployment computes now: the measured rates of the
        prefill workers, or of the colocated workers when none has the prefill role."""
        live = self.pool.live()
        prefilling = [w for w in live if w.role == Role.PREFILL] or [
            w for w in live if w.role == Role.BOTH
        ]
        return self.prefill_rate.total(w.worker_id for w in prefilling)

    # ---- roles -----------------------------------------------------------------------------
    def _view(self) -> list[RoleWorker]:
        return [
            RoleWorker(
                w.worker_id,
                w.role,
                w.alive,
                w.state.num_running if w.state else 0,
                w.state.queued_prefill_tokens if w.state else 0,
                w.state.num_waiting if w.state else 0,
            )
            for w in self.pool.workers
        ]

    def _lend(self) -> None:
        """Tell each live worker the CPUs it should run on, where that changed (`--pd-merge`)."""
        if not self.merge or self.roles is None or not self.pool.workers:
            return
        for wid, cpus in cpu_sets(self._view(), self.own_cpus).items():
            if self.cpus_sent.get(wid) != cpus:
                self.pool.send(wid, SetCPUs(sorted(cpus)))
                self.cpus_sent[wid] = cpus
                logger.info("worker %d runs on CPUs %s", wid, sorted(cpus))

    def on_death(self, worker: WorkerHandle) -> None:
        """A worker died. If only parked workers are left, one of them takes over."""
        if self.roles is None:
            return
        view = self._view()
        live = [v for v in view if v.alive]
        if live and all(v.role == Role.PARKED for v in live):
            why = f"worker {worker.worker_id} died; a parked worker takes over"
            self._apply(self.roles.plan(view, MERGED if self.merge else (0, len(live)), why))
        self._lend()

    def on_rejoin(self, worker: WorkerHandle) -> None:
        """A restarted worker is back: a fresh process on its own CPUs."""
        if self.merge:
            self.cpus_sent[worker.worker_id] = self.own_cpus[worker.worker_id]
            self._lend()

    def report(self) -> dict:
        """What GET /deployment shows: each worker's role and where it runs."""
        if self.roles is None:
            workers = [
                {"id": w.worker_id, "role": str(w.role), "alive": w.alive}
                for w in self.pool.workers
            ]
            out = {"control": str(RoleControl.STATIC), "workers": workers}
        else:
            out = self.roles.report(self._view())
            out["merge"] = self.merge
        for row, w in zip(out["workers"], self.pool.workers):
            row["placement"] = w.where
            if w.state is not None and w.state.num_threads:
                row["threads"] = w.state.num_threads
            if self.merge:
                row["cpus"] = sorted(self.cpus_sent[w.worker_id])
        return out

    def set_split(
        self, num_prefill: int, reason: str = "operator request", merge: bool = False
    ) -> dict:
        """Give `num_prefill` live workers the prefill role and the rest the decode role (or
        all of them role both for 0; with `merge`, one of them on every worker's CPUs and the
        rest parked). Raises ValueError when the roles are static or the split does not fit
        the live workers."""
        if self.roles is None:
            raise ValueError("the workers' roles are static: start with --pd-ratio manual or auto")
        live = len(self.pool.live())
        if not 0 <= num_prefill < live:
            raise ValueError(
                f"invalid prefill_workers={num_prefill}: {live} live workers, and one must decode"
            )
        if merge and not self.merge:
            raise ValueError("merging workers needs --pd-merge at startup")
        if merge and num_prefill:
            raise ValueError("a merged deployment has no prefill workers: prefill_workers=0")
        split = MERGED if merge else (num_prefill, live - num_prefill)
        self._apply(self.roles.plan(self._view(), split, reason))
        return self.report()

    def _apply(self, changes: dict) -> None:
        for wid, role in changes.items():
            w = self.pool.workers[wid]
            if self.metrics is not None:
                self.metrics.role_switches.labels(str(w.role), str(role)).inc()
                self.metrics.forget_role(wid, w.role)
            w.role = role
            self.router.set_role(wid, role)
        if changes:
            self.load.on_switch()
            if self.metrics is not None:
                self.metrics.set_roles(self.pool.live())
            self._lend()  # CPUs go back before (or as) a parked worker gets work again

    async def control_loop(self, interval_s: float = 1.0) -> None:
        while True:
            await asyncio.sleep(interval_s)
            live = [w for w in self.pool.live() if w.state is not None]
            queued = sum(w.state.queued_prefill_tokens for w in live)
            kv = max((w.state.kv_usage for w in live if w.role.decodes), default=0.0)
            try:
                self._apply(self.roles.tick(self._view(), self.load.sample(queued, kv)))
            except ValueError as e:  # e.g. a worker died since the sample: try again next time
                logger.warning("P:D controller: %s", e)
