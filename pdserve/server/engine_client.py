"""EngineClient: the frontend's handle on its engine worker processes (asyncio, ZMQ, msgspec).

It starts each worker as a subprocess, waits for its `WorkerInfo`, and then runs one task that
receives `StepOutputs` from every worker and turns them into per-request `RequestOutput`s (the
tokenizer and the `OutputProcessor` live here, so workers only schedule and compute). A second
task watches the worker processes: when one dies, the client turns unhealthy and every in-flight
request ends at once with `EngineDeadError`.
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
from pdserve.engine.output_processor import OutputProcessor
from pdserve.ipc.channel import Decoder, Encoder, ipc_address, make_socket
from pdserve.ipc.messages import (
    AddRequest,
    FinishRequests,
    FromWorker,
    Shutdown,
    StepOutputs,
    WorkerError,
    WorkerInfo,
    WorkerState,
)
from pdserve.types import RequestOutput, SamplingParams

logger = logging.getLogger("pdserve.server")


class EngineDeadError(RuntimeError):
    """The engine worker is gone: in-flight and new requests fail with 503."""


class RequestRejected(ValueError):
    """The engine refused a request (e.g. the queue timeout expired)."""


@dataclass
class WorkerHandle:
    worker_id: int
    role: str
    proc: subprocess.Popen
    sock: zmq.asyncio.Socket
    info: WorkerInfo | None = None
    state: WorkerState | None = None
    alive: bool = True


@dataclass
class _Stream:
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    worker_id: int = 0


class EngineClient:
    def __init__(
        self,
        args: EngineArgs,
        tokenizer,
        *,
        queue_timeout_s: float | None = None,
        on_step=None,
        on_finish=None,
    ) -> None:
        self.args = args
        self.tokenizer = tokenizer
        self.queue_timeout_s = queue_timeout_s
        self.on_step = on_step  # callback(worker_id, role, StepOutputs) for metrics
        self.on_finish = on_finish  # callback(worker_id, role, RequestOutput)
        self.ctx = zmq.asyncio.Context()
        self.output_addr = ipc_address("out")
        self.pull = make_socket(self.ctx, zmq.PULL, self.output_addr, bind=True)
        self.encode = Encoder()
        self.decode = Decoder(FromWorker)
        self.workers: list[WorkerHandle] = []
        self.processor = OutputProcessor(tokenizer)
        self.streams: dict[str, _Stream] = {}
        self.dead_reason: str | None = None
        self.closing = False
        self._tasks: list[asyncio.Task] = []

    # ---- lifecycle -----------------------------------------------------------------------
    async def start(self, role: str = "both", timeout_s: float = 600.0) -> None:
        handle = self._spawn(len(self.workers), role)
        self.workers.append(handle)
        await self._wait_ready(handle, timeout_s)
        self._tasks = [
            asyncio.create_task(self._output_loop(), name="pdserve-outputs"),
            asyncio.create_task(self._watch_loop(), name="pdserve-watch"),
        ]

    def _spawn(self, worker_id: int, role: str) -> WorkerHandle:
        input_addr = ipc_address(f"in{worker_id}")
        sock = make_socket(self.ctx, zmq.PUSH, input_addr, bind=True)
        cmd = [
            sys.executable,
            "-m",
            "pdserve.engine.worker",
            "--engine-args",
            msgspec.json.encode(self.args).decode(),
            "--input",
            input_addr,
            "--output",
            self.output_addr,
            "--role",
            role,
            "--worker-id",
            str(worker_id),
        ]
        proc = subprocess.Popen(cmd, env=os.environ.copy())
        return WorkerHandle(worker_id, role, proc, sock)

    async def _wait_ready(self, handle: WorkerHandle, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if handle.proc.poll() is not None:
                raise RuntimeError(
                    f"engine worker {handle.worker_id} exited with code {handle.proc.returncode} "
                    "while starting (see its log above)"
                )
            if await self.pull.poll(200):
                msg = self.decode(await self.pull.recv())
                if isinstance(msg, WorkerInfo) and msg.worker_id == handle.worker_id:
                    handle.info = msg
                    return
                if isinstance(msg, WorkerError):
                    raise RuntimeError(msg.message)
        raise RuntimeError(f"engine worker {handle.worker_id} not ready after {timeout_s:.0f}s")

    @property
    def info(self) -> WorkerInfo:
        return self.workers[0].info

    @property
    def healthy(self) -> bool:
        return self.dead_reason is None and all(w.alive for w in self.workers)

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
        for t in self._tasks:
            t.cancel()
        self._fail_all("the server is shutting down")
        for w in self.workers:
            w.sock.close()
        self.pull.close()
        self.ctx.term()

    # ---- background tasks ----------------------------------------------------------------
    async def _output_loop(self) -> None:
        while True:
            msg = self.decode(await self.pull.recv())
            if isinstance(msg, StepOutputs):
                self._on_outputs(msg)
            elif isinstance(msg, WorkerError) and msg.request_id is None:
                logger.error("%s", msg.message)
                self.dead_reason = msg.message

    def _on_outputs(self, msg: StepOutputs) -> None:
        worker = self.workers[msg.worker_id]
        worker.state = msg.state
        if self.on_step is not None:
            self.on_step(worker, msg)
        processed = self.processor.process(msg.outputs)
        if processed.core_ids_to_stop:
            self._send(worker, FinishRequests(processed.core_ids_to_stop, reason="stop"))
        for out in processed.request_outputs:
            stream = self.streams.get(out.request_id)
            if stream is not None:
                stream.queue.put_nowait(out)
            if out.finished and self.on_finish is not None:
                self.on_finish(worker, out)

    async def _watch_loop(self) -> None:
        while True:
            await asyncio.sleep(0.2)
            for w in self.workers:
                if w.alive and not self.closing and w.proc.poll() is not None:
                    w.alive = False
                    self.dead_reason = (
                        f"engine worker {w.worker_id} died (exit code {w.proc.returncode})"
                    )
                    logger.error("%s", self.dead_reason)
                    self._fail_all(self.dead_reason)

    def _fail_all(self, reason: str) -> None:
        for rid, stream in list(self.streams.items()):
            stream.queue.put_nowait(EngineDeadError(reason))
            self.processor.remove(rid)

    def _send(self, worker: WorkerHandle, msg) -> None:
        worker.sock.send(self.encode(msg))  # PUSH with no HWM: never blocks

    # ---- requests ------------------------------------------------------------------------
    @property
    def num_in_flight(self) -> int:
        return len(self.streams)

    def num_waiting(self) -> int:
        """Requests not yet producing tokens (as seen by the workers' last report)."""
        return sum(w.state.num_waiting for w in self.workers if w.state is not None)

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
        worker = self.workers[0]
        children = self.processor.add_request(
            request_id, prompt, prompt_token_ids, params, arrival_time
        )
        stream = self.streams[request_id] = _Stream(worker_id=worker.worker_id)
        finished = False
        try:
            for core_id, child_params in children:
                self._send(
                    worker,
                    AddRequest(core_id, prompt_token_ids, child_params, self.queue_timeout_s),
                )
            while True:
                item = await stream.queue.get()
                if isinstance(item, Exception):
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

    def abort(self, request_id: str) -> None:
        core_ids = self.processor.remove(request_id)
        if core_ids and self.healthy:
            for w in self.workers:
                self._send(w, FinishRequests(core_ids, reason="abort"))
