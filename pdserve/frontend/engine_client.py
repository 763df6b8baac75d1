"""EngineClient: the frontend's handle on its engine workers (asyncio, ZMQ, msgspec).

It starts each worker as a subprocess, checks that they agree on the KV layout, and runs one
task that receives every worker's `StepOutputs` and turns them into per-request `RequestOutput`s
(the tokenizer and the `OutputProcessor` live here, so workers only schedule and compute). A
second task watches the processes and the KV transfer deadlines.

Colocated: one worker of role `both` does everything. Disaggregated: the `Router` picks a decode
worker and, for long uncached prompts, a prefill worker, and the frontend runs the handoff:

1. decode worker: `AddRequest(kv_role="receive")` -> it reserves blocks -> `KVReservation`
2. prefill worker: `AddRequest(kv_role="send", kv_dest=...)` -> it prefills, ships the KV layer
   by layer, sends `KVDone` (with the first token) straight to the decode worker, and the first
   token to the frontend, which streams it at once (TTFT is the prefill worker's)
3. decode worker: reports `kv_received` and decodes on; its tokens follow the first one.

No KV by `--kv-transfer-timeout`, or a dead prefill worker: the decode worker recomputes the
prompt (after any token the client already has), counted as a fallback, or with
`--on-prefill-failure fail` the request ends with 503. A dead decode worker ends its requests with
503; new requests go to live workers; with `restart_workers` a dead worker is started again and
rejoins. Every path returns the KV blocks on both sides.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import msgspec
import zmq
import zmq.asyncio

from pdserve.config import EngineArgs
from pdserve.disagg.protocol import KVDest
from pdserve.disagg.router import Router
from pdserve.frontend.output_processor import OutputProcessor
from pdserve.ipc.channel import (
    SECRET_ENV,
    BadFrame,
    Decoder,
    Encoder,
    RuntimeDirs,
    make_socket,
    new_secret,
)
from pdserve.ipc.messages import (
    AddRequest,
    FinishRequests,
    FromWorker,
    PeerInfo,
    ReleaseKV,
    ResumeLocally,
    Shutdown,
    StepOutputs,
    WorkerError,
    WorkerInfo,
    WorkerState,
)
from pdserve.types import EngineCoreOutput, RequestOutput, SamplingParams

logger = logging.getLogger("pdserve.frontend")


class EngineDeadError(RuntimeError):
    """No live engine worker can serve the request: it fails with 503."""


class RequestRejected(ValueError):
    """The engine refused a request (e.g. the queue timeout expired)."""


@dataclass(frozen=True)
class WorkerSpec:
    """How to start one worker: its role, engine arguments and placement."""

    role: str  # "both" | "prefill" | "decode"
    args: EngineArgs
    cpus: str | None = None


@dataclass
class DisaggOptions:
    kv_transport: str = "shm"  # "shm" | "tcp"
    kv_host: str = "127.0.0.1"  # where decode workers bind their TCP KV channel
    kv_transfer_timeout_s: float = 30.0
    min_prompt_tokens: int = 0  # shorter prompts are prefilled on the decode worker
    on_prefill_failure: str = "recompute"  # "recompute" | "fail"


@dataclass
class WorkerHandle:
    worker_id: int
    spec: WorkerSpec
    proc: subprocess.Popen
    sock: zmq.asyncio.Socket
    info: WorkerInfo | None = None
    state: WorkerState | None = None
    alive: bool = True
    restarting: bool = False

    @property
    def role(self) -> str:
        return self.spec.role


@dataclass
class _Stream:
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)


@dataclass
class _Remote:
    """A core request whose prompt is prefilled on another worker than the one decoding it."""

    core_id: str
    decode_id: int
    prefill_id: int
    prompt_token_ids: list[int]
    params: SamplingParams
    deadline: float
    sent_to_prefill: bool = False
    accepted_tokens: list[int] = field(default_factory=list)  # from the prefill worker
    kv_done: bool = False  # the decode worker has the KV (its signal may beat the first token)
    first_token: int | None = None  # as the decode worker received it
    held: list[EngineCoreOutput] = field(default_factory=list)  # decode outputs to follow it


class EngineClient:
    def __init__(
        self,
        specs: list[WorkerSpec],
        tokenizer=None,
        *,
        queue_timeout_s: float | None = None,
        disagg: DisaggOptions | None = None,
        restart_workers: bool = False,
        metrics=None,
    ) -> None:
        self.specs = specs
        self.tokenizer = tokenizer
        self.queue_timeout_s = queue_timeout_s
        self.disagg = disagg or DisaggOptions()
        self.restart_workers = restart_workers
        self.metrics = metrics
        self.ctx = zmq.asyncio.Context()
        self.dirs = RuntimeDirs()  # private; removed in `shutdown`
        self.secret = new_secret()  # authenticates every channel of this deployment
        self.output_addr = self.dirs.address("out")
        self.pull = make_socket(self.ctx, zmq.PULL, self.output_addr, bind=True)
        self.encode = Encoder(self.secret)
        self.decode = Decoder(FromWorker, self.secret)
        self.num_bad_frames = 0
        self.workers: list[WorkerHandle] = []
        self.processor = OutputProcessor(tokenizer) if tokenizer is not None else None
        self.streams: dict[str, _Stream] = {}
        self.core_to_request: dict[str, str] = {}
        self.placement: dict[str, int] = {}  # core id -> decode (or colocated) worker
        self.remote: dict[str, _Remote] = {}
        self.sent_to: dict[int, set[str]] = {}  # prefill worker -> core ids it may write for
        self.router: Router | None = None
        self.closing = False
        self._tasks: list[asyncio.Task] = []

    # ---- lifecycle -----------------------------------------------------------------------
    def spawn(self) -> None:
        """Start the worker processes; they load their model while the caller goes on (the
        frontend loads its tokenizer meanwhile). `start` waits for them."""
        if not self.workers:
            self.workers = [self._spawn(i, spec) for i, spec in enumerate(self.specs)]

    def set_tokenizer(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.processor = OutputProcessor(tokenizer)

    def kill(self) -> None:
        """Stop the spawned workers at once and remove the runtime directories (a failed
        start, before any event loop runs)."""
        for w in self.workers:
            if w.proc.poll() is None:
                w.proc.kill()
                w.proc.wait()
        self.dirs.remove()

    async def start(self, timeout_s: float = 600.0) -> None:
        self.spawn()
        try:
            await self._wait_ready([w.worker_id for w in self.workers], timeout_s)
            self._check_layouts()
        except Exception:
            await self.shutdown(grace_s=1.0)
            raise
        self.router = Router(self.info.block_size, self.disagg.min_prompt_tokens)
        for w in self.workers:
            self.router.add_worker(w.worker_id, w.role, w.info.num_kv_blocks)
        self._announce_peers()
        self._tasks = [
            asyncio.create_task(self._output_loop(), name="pdserve-outputs"),
            asyncio.create_task(self._watch_loop(), name="pdserve-watch"),
        ]

    def _spawn(self, worker_id: int, spec: WorkerSpec) -> WorkerHandle:
        input_addr = self.dirs.address(f"in{worker_id}")
        sock = make_socket(self.ctx, zmq.PUSH, input_addr, bind=True)
        cmd = [
            sys.executable,
            "-m",
            "pdserve.engine.worker",
            "--engine-args",
            msgspec.json.encode(spec.args).decode(),
            "--input",
            input_addr,
            "--output",
            self.output_addr,
            "--role",
            spec.role,
            "--worker-id",
            str(worker_id),
            "--kv-transport",
            self.disagg.kv_transport,
        ]
        if spec.role == "decode":
            kv_addr = (
                self.dirs.address(f"kv{worker_id}")
                if self.disagg.kv_transport == "shm"
                else f"tcp://{self.disagg.kv_host}:0"
            )
            cmd += ["--kv-address", kv_addr]
        if spec.cpus:
            cmd += ["--cpus", spec.cpus]
        env = {**os.environ, **self.dirs.env(), SECRET_ENV: self.secret.hex()}
        proc = subprocess.Popen(cmd, env=env)
        return WorkerHandle(worker_id, spec, proc, sock)

    async def _wait_ready(self, ids: list[int], timeout_s: float) -> None:
        pending = set(ids)
        deadline = time.monotonic() + timeout_s
        while pending:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"engine workers {sorted(pending)} not ready after {timeout_s:.0f}s"
                )
            for i in pending:
                w = self.workers[i]
                if w.proc.poll() is not None:
                    raise RuntimeError(
                        f"engine worker {i} ({w.role}) exited with code {w.proc.returncode} "
                        "while starting (see its log above)"
                    )
            if await self.pull.poll(200):
                msg = self._receive(await self.pull.recv())
                if isinstance(msg, WorkerInfo) and msg.worker_id in pending:
                    self.workers[msg.worker_id].info = msg
                    pending.discard(msg.worker_id)
                elif isinstance(msg, WorkerError):
                    raise RuntimeError(msg.message)

    def _check_layouts(self) -> None:
        """Every worker must hold the same model with the same KV layout (handshake)."""
        first = self.workers[0]
        for w in self.workers[1:]:
            diff = first.info.layout.mismatch(w.info.layout)
            if diff:
                raise RuntimeError(
                    f"workers {first.worker_id} ({first.role}) and {w.worker_id} ({w.role}) "
                    f"disagree on the KV layout: {diff}"
                )
            if w.info.max_model_len != first.info.max_model_len:
                raise RuntimeError(
                    f"workers disagree on max_model_len: {first.info.max_model_len} != "
                    f"{w.info.max_model_len}"
                )

    def _announce_peers(self) -> None:
        for p in self.workers:
            if p.role == "prefill" and p.alive:
                for d in self.workers:
                    if d.role == "decode" and d.alive and d.info.kv_endpoint is not None:
                        self._send(p, PeerInfo(d.info.kv_endpoint))

    @property
    def info(self) -> WorkerInfo:
        return self.workers[0].info

    @property
    def disaggregated(self) -> bool:
        return any(w.role == "prefill" for w in self.workers)

    @property
    def healthy(self) -> bool:
        """Able to serve: at least one live worker that decodes."""
        return not self.closing and any(w.alive and w.role != "prefill" for w in self.workers)

    @property
    def degraded(self) -> bool:
        return any(not w.alive for w in self.workers)

    @property
    def dead_reason(self) -> str | None:
        dead = [w for w in self.workers if not w.alive]
        if not dead:
            return None
        return ", ".join(
            f"engine worker {w.worker_id} ({w.role}) died (exit code {w.proc.returncode})"
            for w in dead
        )

    async def shutdown(self, grace_s: float = 5.0) -> None:
        self.closing = True
        for w in self.workers:
            if w.alive:
                with contextlib.suppress(zmq.ZMQError):
                    await w.sock.send(self.encode(Shutdown()))
        deadline = time.monotonic() + grace_s
        for w in self.workers:
            while w.proc.poll() is None and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            if w.proc.poll() is None:
                w.proc.kill()
                w.proc.wait()
            self._cleanup_shm(w)
        for t in self._tasks:
            t.cancel()
        self._fail_where(lambda core_id: True, "the server is shutting down")
        for w in self.workers:
            w.sock.close()
        self.pull.close()
        self.ctx.term()
        self.dirs.remove()

    @staticmethod
    def _cleanup_shm(w: WorkerHandle) -> None:
        ep = w.info.kv_endpoint if w.info is not None else None
        if ep is not None and ep.shm_path and os.path.exists(ep.shm_path):
            with contextlib.suppress(OSError):
                os.unlink(ep.shm_path)

    # ---- background tasks ----------------------------------------------------------------
    def _receive(self, frame: bytes):
        """A worker's message, or None for a frame that is not one (counted, logged, dropped)."""
        try:
            msg = self.decode(frame)
            if not 0 <= msg.worker_id < len(self.workers):
                raise BadFrame(f"a message from unknown worker {msg.worker_id}")
        except BadFrame as e:
            self.num_bad_frames += 1
            logger.warning("dropped a frame on the worker output channel: %s", e)
            if self.metrics is not None:
                self.metrics.dropped_frames.labels("frontend", "-", "control").inc()
            return None
        return msg

    async def _output_loop(self) -> None:
        while True:
            msg = self._receive(await self.pull.recv())
            if isinstance(msg, StepOutputs):
                self._on_outputs(msg)
            elif isinstance(msg, WorkerInfo):
                self._on_rejoin(msg)
            elif isinstance(msg, WorkerError) and msg.request_id is None:
                logger.error("%s", msg.message)

    def _on_outputs(self, msg: StepOutputs) -> None:
        worker = self.workers[msg.worker_id]
        if not worker.alive:
            return
        worker.state = msg.state
        if self.router is not None:
            self.router.report(
                worker.worker_id, msg.state.num_free_blocks, msg.state.queued_prefill_tokens
            )
        if self.metrics is not None:
            self.metrics.on_step(worker, msg)
        for r in msg.reservations:
            self._on_reservation(worker, r)
        for rec in msg.kv_received:
            r = self.remote.get(rec.request_id)
            if r is not None:
                r.kv_done, r.first_token = True, rec.first_token
                if r.accepted_tokens:
                    del self.remote[rec.request_id]
        outputs = msg.outputs
        if worker.role == "prefill":
            outputs = self._from_prefill(worker, outputs)
        else:
            outputs = self._from_decode(worker, outputs)
        self._deliver(worker, outputs)

    def _from_decode(self, worker: WorkerHandle, outputs: list[EngineCoreOutput]):
        """Decode tokens of a handed-off request wait until its first token (from the prefill
        worker, on another socket) has been delivered: the client sees them in order."""
        kept = []
        for out in outputs:
            r = self.remote.get(out.request_id)
            if r is not None and r.decode_id == worker.worker_id and out.error is None:
                r.held.append(out)
            else:
                kept.append(out)
        return kept

    def _from_prefill(self, worker: WorkerHandle, outputs: list[EngineCoreOutput]):
        kept = []
        for out in outputs:
            r = self.remote.get(out.request_id)
            if r is None or r.prefill_id != worker.worker_id:
                continue  # fallen back to local recompute (or gone): the decode worker owns it
            self.sent_to.get(worker.worker_id, set()).discard(out.request_id)
            r.accepted_tokens.extend(out.new_token_ids)
            kept.append(out)
            if out.finish_reason is not None:  # ended at the first token: nothing to hand off
                self.remote.pop(out.request_id, None)
                self._send(
                    self.workers[r.decode_id], FinishRequests([out.request_id], release_kv=False)
                )
            elif r.kv_done:  # the decode worker's tokens waited for this one
                del self.remote[out.request_id]
                kept.extend(r.held)
        return kept

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

    def _on_reservation(self, decode: WorkerHandle, res) -> None:
        r = self.remote.get(res.request_id)
        if r is None or r.decode_id != decode.worker_id:
            return
        prefill = self.workers[r.prefill_id]
        if not prefill.alive:
            self._fallback(r, "prefill_dead")
            return
        dest = KVDest(decode.worker_id, res.block_ids, res.num_cached_tokens)
        self._send(
            prefill,
            AddRequest(r.core_id, r.prompt_token_ids, r.params, kv_role="send", kv_dest=dest),
        )
        r.sent_to_prefill = True
        self.sent_to.setdefault(prefill.worker_id, set()).add(r.core_id)

    async def _watch_loop(self) -> None:
        while True:
            await asyncio.sleep(0.05)
            if self.closing:
                return
            for w in self.workers:
                if w.alive and w.proc.poll() is not None:
                    self._on_death(w)
                elif w.restarting and w.proc.poll() is not None:
                    w.restarting = False
                    logger.error(
                        "restarting worker %d failed (exit code %s)", w.worker_id, w.proc.returncode
                    )
            now = time.monotonic()
            for r in [r for r in self.remote.values() if now > r.deadline and not r.kv_done]:
                logger.warning(
                    "KV transfer for %s timed out: recomputing on the decode worker", r.core_id
                )
                self._fallback(r, "timeout")

    def _fallback(self, r: _Remote, reason: str) -> None:
        """Give up on the remote prefill of one request (see the module docstring)."""
        self.remote.pop(r.core_id, None)
        if r.kv_done:  # the decode worker has everything; only the first token was lost
            first = [] if r.accepted_tokens else [EngineCoreOutput(r.core_id, [r.first_token])]
            self._deliver(self.workers[r.decode_id], first + r.held)
            return
        prefill, decode = self.workers[r.prefill_id], self.workers[r.decode_id]
        if self.metrics is not None:
            self.metrics.kv_fallbacks.labels(reason).inc()
        if reason == "prefill_dead" and self.disagg.on_prefill_failure == "fail":
            self._send(decode, FinishRequests([r.core_id], release_kv=True))
            self._fail_where(
                lambda c: c == r.core_id, f"prefill worker {r.prefill_id} died during the request"
            )
            return
        writer_alive = r.sent_to_prefill and prefill.alive
        self._send(
            decode, ResumeLocally(r.core_id, list(r.accepted_tokens), release_kv=not writer_alive)
        )
        if writer_alive:
            self._send(prefill, FinishRequests([r.core_id]))

    def _on_death(self, w: WorkerHandle) -> None:
        w.alive = False
        reason = f"engine worker {w.worker_id} ({w.role}) died (exit code {w.proc.returncode})"
        logger.error("%s", reason)
        self._cleanup_shm(w)
        if self.router is not None:
            self.router.set_alive(w.worker_id, False)
        if self.metrics is not None:
            self.metrics.set_worker_up(w, False)
        if w.role == "prefill":
            for r in [r for r in self.remote.values() if r.prefill_id == w.worker_id]:
                self._fallback(r, "prefill_dead")
            held = self.sent_to.pop(w.worker_id, set())
            for d in self.workers:  # it will never write again: held blocks can go back
                if d.role == "decode" and d.alive and held:
                    self._send(d, ReleaseKV(sorted(held)))
        else:
            lost = {c for c, wid in self.placement.items() if wid == w.worker_id}
            for c in lost:
                r = self.remote.pop(c, None)
                if r is not None and r.sent_to_prefill and self.workers[r.prefill_id].alive:
                    self._send(self.workers[r.prefill_id], FinishRequests([c]))
            self._fail_where(lambda c: c in lost, reason)
        if self.restart_workers and not self.closing:
            asyncio.get_running_loop().create_task(self._restart(w))

    async def _restart(self, old: WorkerHandle) -> None:
        await asyncio.sleep(0.5)
        old.sock.close()
        new = self._spawn(old.worker_id, old.spec)
        new.alive = False  # until its WorkerInfo arrives (`_on_rejoin`)
        new.restarting = True
        self.workers[old.worker_id] = new

    def _on_rejoin(self, info: WorkerInfo) -> None:
        w = self.workers[info.worker_id]
        diff = self.info.layout.mismatch(info.layout) if w.worker_id != 0 else None
        if diff:
            logger.error("restarted worker %d has a different KV layout: %s", w.worker_id, diff)
            return
        w.info, w.alive, w.restarting = info, True, False
        if self.router is not None:
            self.router.set_alive(w.worker_id, True)
            self.router.report(w.worker_id, info.num_kv_blocks, 0)
        if self.metrics is not None:
            self.metrics.set_worker_up(w, True)
        self._announce_peers()
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

    def _send(self, worker: WorkerHandle, msg) -> None:
        if worker.alive:
            worker.sock.send(self.encode(msg))  # PUSH with no HWM: never blocks

    # ---- requests ------------------------------------------------------------------------
    def _dispatch(self, core_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        scores_prompt = params.prompt_logprobs is not None or params.max_tokens == 0
        route = self.router.route(prompt_ids, remote_prefill=not scores_prompt)
        if self.metrics is not None and self.disaggregated:
            self.metrics.router_decisions.labels(route.reason).inc()
        decode = self.workers[route.decode_id]
        self.placement[core_id] = decode.worker_id
        if route.prefill_id is None:
            self._send(decode, AddRequest(core_id, prompt_ids, params, self.queue_timeout_s))
            return
        self.remote[core_id] = _Remote(
            core_id,
            decode.worker_id,
            route.prefill_id,
            prompt_ids,
            params,
            deadline=time.monotonic() + self.disagg.kv_transfer_timeout_s,
        )
        self._send(
            decode, AddRequest(core_id, prompt_ids, params, self.queue_timeout_s, kv_role="receive")
        )

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
                    raise RequestRejected(item.error)
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            self.streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)
            for core_id, _ in children:
                self.core_to_request.pop(core_id, None)
                self.placement.pop(core_id, None)
                self.remote.pop(core_id, None)

    def abort(self, request_id: str) -> None:
        for core_id in self.processor.remove(request_id):
            self.core_to_request.pop(core_id, None)
            self._finish_everywhere(core_id, reason="abort")

    def _finish_everywhere(self, core_id: str, reason: str) -> None:
        """End a core request on every worker that holds part of it."""
        r = self.remote.pop(core_id, None)
        wid = self.placement.pop(core_id, None)
        if r is not None:
            writer = self.workers[r.prefill_id]
            writer_alive = r.sent_to_prefill and writer.alive
            self._send(
                self.workers[r.decode_id],
                FinishRequests([core_id], reason, release_kv=not writer_alive),
            )
            if writer_alive:
                self._send(writer, FinishRequests([core_id], reason))
        elif wid is not None:
            self._send(self.workers[wid], FinishRequests([core_id], reason))

    # ---- load ----------------------------------------------------------------------------
    @property
    def num_in_flight(self) -> int:
        return len(self.streams)
