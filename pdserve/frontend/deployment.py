"""The deployment as the frontend sees and changes it: which worker has which role.

Static (`--pd-ratio static`): roles are fixed at startup and `report` only describes them. With
`manual` or `auto` the workers are switchable: `set_split` (POST /deployment) or the P:D
controller (`control_loop`, every second) give them new roles through the router. The client
feeds `on_step`, `on_arrival`, `on_output` and `on_gone`, from which `LoadObserver` builds the
samples the controller reads and the SLO attainment gauges, and `PrefillRate` the prefill rate
that SLO-aware admission predicts with (`pdserve.frontend.admission`).
"""

from __future__ import annotations

import asyncio
import logging

from pdserve.config import DisaggConfig
from pdserve.frontend.admission import PrefillRate
from pdserve.ipc.messages import StepOutputs
from pdserve.pools.pd_controller import PDController, PhaseSLO
from pdserve.pools.roles import LoadObserver, RoleManager
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
        if disagg.switchable:
            controller = None
            if disagg.pd_ratio == RoleControl.AUTO:
                start = (disagg.num_prefill_workers, disagg.num_decode_workers)
                controller = PDController(
                    disagg.num_workers, slo, start=start, min_dwell_s=disagg.pd_min_dwell_s
                )
            self.roles = RoleManager(disagg.pd_ratio, controller)

    @property
    def automatic(self) -> bool:
        return self.roles is not None and self.roles.controller is not None

    # ---- what the client sees ------------------------------------------------------------
    def on_step(self, worker: WorkerHandle, msg: StepOutputs) -> None:
        for st in msg.steps:
            self.prefill_rate.observe(worker.worker_id, st.num_prefill_tokens, st.step_time_s)
            if st.num_decode_seqs:
                self.load.on_decode_step(worker.worker_id, st.step_time_s)
            if st.num_prefill_tokens and worker.role.decodes:
                self.load.on_prefill_on_decoder(st.num_prefill_tokens)

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
            )
            for w in self.pool.workers
        ]

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
        for row, w in zip(out["workers"], self.pool.workers):
            row["placement"] = w.where
        return out

    def set_split(self, num_prefill: int, reason: str = "operator request") -> dict:
        """Give `num_prefill` live workers the prefill role and the rest the decode role (or
        all of them role both for 0). Raises ValueError when the roles are static or the split
        does not fit the live workers."""
        if self.roles is None:
            raise ValueError("the workers' roles are static: start with --pd-ratio manual or auto")
        live = len(self.pool.live())
        if not 0 <= num_prefill < live:
            raise ValueError(
                f"invalid prefill_workers={num_prefill}: {live} live workers, and one must decode"
            )
        self._apply(self.roles.plan(self._view(), (num_prefill, live - num_prefill), reason))
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
