"""EngineClient: the frontend's handle on its engine: requests in, `RequestOutput`s out.

It puts three parts together: the `WorkerPool` (the worker processes), the `Router` (which worker
decodes a request and, disaggregated, which one prefills it) and the `HandoffCoordinator` (the
protocol of a request that crosses workers). One task receives every worker's `StepOutputs` and
turns them into per-request outputs (the tokenizer and the `OutputProcessor` live here, so
workers only schedule and compute); a second watches the processes and the handoff deadlines.

Colocated: one worker of role `both` does everything. A dead worker ends its requests with 503;
new requests go to live workers; a dead worker may be started again and rejoin (`--restart-workers`). A worker's refusal (a prompt its KV cache cannot hold, say) is a `RequestRejected`
carrying the reason, which the API answers with 400 (503 for a queue timeout).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from pdserve.config import DisaggConfig
from pdserve.disagg.handoff import HandoffCoordinator
from pdserve.disagg.router import Router
from pdserve.frontend.deployment import Deployment
from pdserve.frontend.output_processor import OutputProcessor
from pdserve.ipc.messages import AddRequest, FinishRequests, StepOutputs, WorkerError, WorkerInfo
from pdserve.pools.worker_pool import (
    LocalProcessBackend,
    WorkerHandle,
    WorkerPool,
    WorkerSpec,
)
from pdserve.types import (
    EngineCoreOutput,
    RequestOutput,
    SamplingParams,
)

logger = logging.getLogger("pdserve.frontend")

__all__ = ["EngineClient", "EngineDeadError", "RequestRejected", "WorkerSpec"]


class EngineDeadError(RuntimeError):
    """No live engine worker can serve the request: it fails with 503."""


class RequestRejected(ValueError):
    """The engine refused a request: `code` "queue_timeout" (503) or why it is invalid (400)."""

    def __init__(self, message: str, code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.param = param


def worker_backend(disagg: DisaggConfig):
    """Where the workers run: local subprocesses, or Ray actors with `--ray-address`."""
    if not disagg.ray_address:
        return LocalProcessBackend(disagg.kv_host)
    from pdserve.pools.ray_backend import RayBackend

    return RayBackend(
        disagg.ray_address,
        cpus_per_worker=disagg.ray_cpus_per_worker,
        gpus_per_worker=disagg.ray_gpus_per_worker,
        prefill_labels=disagg.ray_prefill_labels,
        decode_labels=disagg.ray_decode_labels,
    )


@dataclass
class _Stream:
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)


class EngineClient:
    def __init__(
        self,
        specs: list[WorkerSpec],
        tokenizer=None,
        *,
        queue_timeout_s: float | None = None,
        disagg: DisaggConfig | None = None,
        metrics=None,
    ) -> None:
        self.disagg = disagg = disagg or DisaggConfig()
        self.queue_timeout_s = queue_timeout_s
        self.metrics = metrics
        self.pool = WorkerPool(
            specs, kv_transport=disagg.kv_transport, backend=worker_backend(disagg), metrics=metrics
        )
        self.handoffs = HandoffCoordinator(
            self.pool.send,
            self.pool.is_alive,
            deliver=lambda wid, outs: self._deliver(self.pool.workers[wid], outs),
            fail=lambda core_id, reason: self._fail_where(lambda c: c == core_id, reason),
            kv_transfer_timeout_s=disagg.kv_transfer_timeout_s,
            queue_timeout_s=queue_timeout_s,
            on_prefill_failure=disagg.on_prefill_failure,
            on_fallback=self._count_fallback,
        )
        self.tokenizer = tokenizer
        self.processor = OutputProcessor(tokenizer) if tokenizer is not None else None
        self.streams: dict[str, _Stream] = {}
        self.core_to_request: dict[str, str] = {}
        self.placement: dict[str, int] = {}  # core id -> decode (or colocated) worker
        self.router: Router | None = None
        self._tasks: list[asyncio.Task] = []
        self.deployment = Deployment(disagg, self.pool, metrics)  # who does what, and switches

    # ---- lifecycle -------------------------------------------------------------------------
    def spawn(self) -> None:
        """Start the worker processes; they load their model while the caller goes on (the
        frontend loads its tokenizer meanwhile). `start` waits for them."""
        self.pool.spawn()

    def set_tokenizer(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.processor = OutputProcessor(tokenizer)

    def kill(self) -> None:
        """Stop the spawned workers at once (a failed start, before any event loop runs)."""
        self.pool.kill()

    async def start(self, timeout_s: float = 600.0) -> None:
        self.pool.spawn()
        try:
            await self.pool.wait_ready(timeout_s)
        except Exception:
            await self.shutdown(grace_s=1.0)
            raise
        self.router = Router(self.info.block_size, self.disagg.min_prompt_tokens)
        for w in self.pool.workers:
            self.router.add_worker(w.worker_id, w.role, w.info.num_kv_blocks)
        self.pool.announce_peers()
        self._tasks = [
            asyncio.create_task(self._output_loop(), name="pdserve-outputs"),
            asyncio.create_task(self._watch_loop(), name="pdserve-watch"),
        ]
        self.deployment.router = self.router
        self.deployment.start()
        if self.deployment.automatic:
            self._tasks.append(asyncio.create_task(self.deployment.control_loop(), name="pd"))
        if self.metrics is not None:
            self.metrics.set_roles(self.pool.live())

    async def shutdown(self, grace_s: float = 5.0) -> None:
        await self.pool.stop(grace_s)
        for t in self._tasks:
            t.cancel()
        self._fail_where(lambda core_id: True, "the server is shutting down")
        self.pool.close()

    # ---- state -----------------------------------------------------------------------------
    @property
    def workers(self) -> list[WorkerHandle]:
        return self.pool.workers

    @property
    def info(self) -> WorkerInfo:
        return self.pool.info

    @property
    def disaggregated(self) -> bool:
        return self.pool.disaggregated

    @property
    def healthy(self) -> bool:
        """Able to serve: at least one live worker that decodes."""
        return not self.pool.closing and any(w.role.decodes for w in self.pool.live())

    @property
    def degraded(self) -> bool:
        return len(self.pool.live()) < len(self.pool.workers)

    @property
    def dead_reason(self) -> str | None:
        return self.pool.dead_reason

    @property
    def num_bad_frames(self) -> int:
        return self.pool.num_bad_frames

    # ---- background tasks ------------------------------------------------------------------
    async def _output_loop(self) -> None:
        while True:
            msg = await self.pool.next_message()
            if isinstance(msg, StepOutputs):
                self._on_outputs(msg)
            elif isinstance(msg, WorkerInfo):
                self._on_rejoin(msg)
            elif isinstance(msg, WorkerError) and msg.request_id is None:
                logger.error("%s", msg.message)

    def _on_outputs(self, msg: StepOutputs) -> None:
        worker = self.pool.workers[msg.worker_id]
        if not worker.alive:
            return
        worker.state = msg.state
        if self.router is not None:
            self.router.report(
                worker.worker_id, msg.state.num_free_blocks, msg.state.queued_prefill_tokens
            )
        if self.metrics is not None:
            self.metrics.on_step(worker, msg)
        self.deployment.on_step(worker, msg)
        self.handoffs.on_progress(worker.worker_id)
        for r in msg.reservations:
            self.handoffs.on_reservation(
                worker.worker_id, r.request_id, r.block_ids, r.num_cached_tokens
            )
        for rec in msg.kv_received:
            self.handoffs.on_kv_received(rec.request_id, rec.first_token)
        self._deliver(worker, self.handoffs.accept(worker.worker_id, msg.outputs, self.placement))

    def _deliver(self, worker: WorkerHandle, outputs: list[EngineCoreOutput]) -> None:
        processed = self.processor.process(outputs)
        for core_id in processed.core_ids_to_stop:
            self._finish_everywhere(core_id, reason="stop")
        for out in processed.request_outputs:
            stream = self.streams.get(out.request_id)
            if stream is not None:
                stream.queue.put_nowait(out)
            if out.finished and self.metrics is not None:
                self.metrics.on_finish(worker, out)
            self.deployment.on_output(out)

    async def _watch_loop(self) -> None:
        while True:
            await asyncio.sleep(0.05)
            if self.pool.closing:
                return
            for w in self.pool.reap():
                self._on_death(w)
            for core_id in self.handoffs.check_deadlines():
                logger.warning(
                    "KV transfer for %s timed out: recomputing on the decode worker", core_id
                )

    def _count_fallback(self, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.kv_fallbacks.labels(reason).inc()

    def _on_death(self, w: WorkerHandle) -> None:
        reason = self.pool.death(w)
        logger.error("%s", reason)
        if self.router is not None:
            self.router.set_alive(w.worker_id, False)
        if self.metrics is not None:
            self.metrics.set_worker_up(w, False)
        # It may have been the prefill side of some requests and the decode side of others.
        self.handoffs.on_prefill_death(w.worker_id, [d.worker_id for d in self.pool.live()])
        lost = {c for c, wid in self.placement.items() if wid == w.worker_id}
        self.handoffs.on_decode_death(lost)
        self._fail_where(lambda c: c in lost, reason)
        self.deployment.on_death(w)
        if self.disagg.restart_workers and not self.pool.closing:
            asyncio.get_running_loop().create_task(self.pool.restart(w))

    def _on_rejoin(self, info: WorkerInfo) -> None:
        w = self.pool.rejoin(info)
        if w is None:
            return
        if self.router is not None:
            self.router.set_alive(w.worker_id, True)
            self.router.report(w.worker_id, info.num_kv_blocks, 0)
        if self.metrics is not None:
            self.metrics.set_worker_up(w, True)
        self.deployment.on_rejoin(w)
        logger.info("engine worker %d (%s) rejoined", w.worker_id, w.role)

    def _fail_where(self, pred, reason: str) -> None:
        for core_id in [c for c in list(self.core_to_request) if pred(c)]:
            rid = self.core_to_request.pop(core_id)
            self.placement.pop(core_id, None)
            stream = self.streams.get(rid)
            if stream is not None:
                stream.queue.put_nowait(EngineDeadError(reason))
            for c in self.processor.remove(rid):
                self.core_to_request.pop(c, None)

    # ---- requests --------------------------------------------------------------------------
    def _dispatch(self, core_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        scores_prompt = params.prompt_logprobs is not None or params.max_tokens == 0
        route = self.router.route(prompt_ids, remote_prefill=not scores_prompt)
        if self.metrics is not None and self.disaggregated:
            self.metrics.router_decisions.labels(route.reason).inc()
        self.placement[core_id] = route.decode_id
        if route.prefill_id is None:
            msg = AddRequest(core_id, prompt_ids, params, self.queue_timeout_s)
            self.pool.send(route.decode_id, msg)
        else:
            self.handoffs.start(core_id, route.decode_id, route.prefill_id, prompt_ids, params)

    async def generate(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs. Leaving the iterator early (client gone) aborts it."""
        if not self.healthy:
            raise EngineDeadError(self.dead_reason or "no live engine worker")
        arrival_time = time.perf_counter() if arrival_time is None else arrival_time
        children = self.processor.add_request(
            request_id, prompt, prompt_token_ids, params, arrival_time
        )
        stream = self.streams[request_id] = _Stream()
        self.deployment.on_arrival(request_id)
        finished = False
        try:
            for core_id, child_params in children:
                self.core_to_request[core_id] = request_id
                self._dispatch(core_id, prompt_token_ids, child_params)
            while True:
                item = await stream.queue.get()
                if isinstance(item, Exception):
                    finished = True
                    raise item
                if item.finished and item.error:
                    finished = True
                    raise RequestRejected(item.error, item.error_code, item.error_param)
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            self.streams.pop(request_id, None)
            self.deployment.on_gone(request_id)
            if not finished:
                self.abort(request_id)
            for core_id, _ in children:
                self.core_to_request.pop(core_id, None)
                self.placement.pop(core_id, None)
                self.handoffs.forget(core_id)

    def abort(self, request_id: str) -> None:
        for core_id in self.processor.remove(request_id):
            self.core_to_request.pop(core_id, None)
            self._finish_everywhere(core_id, reason="abort")

    def _finish_everywhere(self, core_id: str, reason: str) -> None:
        """End a core request on every worker that holds part of it."""
        wid = self.placement.pop(core_id, None)
        if not self.handoffs.finish(core_id, reason) and wid is not None:
            self.pool.send(wid, FinishRequests([core_id], reason))
