"""WorkerPool: the frontend's engine workers as processes: start, handshake, watch, restart, stop.

The pool owns the deployment's runtime directory and secret, the output channel every worker
pushes to, and one input channel per worker. It knows nothing of requests: the client routes
them and the `HandoffCoordinator` coordinates handoffs; the pool says who is alive.

Where a worker process runs is a `WorkerBackend`: a local subprocess (`LocalProcessBackend`, the
default) or a Ray actor on some node of a cluster (`pdserve.pools.ray_backend`). Either way the
worker is the same command; it binds its own input channel (a unix socket in the deployment's
private directory, or a TCP port on its node for a cluster) and reports where in its
`WorkerInfo`, and the frontend connects to it then. Only the frontend's output channel is bound
by the frontend. Every frame on either is authenticated by the deployment's secret.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Protocol

import msgspec
import zmq
import zmq.asyncio

from pdserve.config import EngineArgs
from pdserve.ipc.channel import (
    SECRET_ENV,
    BadFrame,
    Decoder,
    Encoder,
    RuntimeDirs,
    bound_address,
    make_socket,
    new_secret,
)
from pdserve.ipc.messages import (
    FromWorker,
    PeerInfo,
    Shutdown,
    WorkerError,
    WorkerInfo,
    WorkerState,
)
from pdserve.types import KVTransportKind, Role

logger = logging.getLogger("pdserve.pool")


@dataclass(frozen=True)
class WorkerSpec:
    """How to start one worker: its role, engine arguments and placement."""

    role: Role
    args: EngineArgs
    cpus: str | None = None
    switchable: bool = False  # its role can change at run time (it sends and receives KV)


class WorkerProcess(Protocol):
    pid: int
    returncode: int | None

    def poll(self) -> int | None: ...
    def kill(self) -> None: ...
    def wait(self) -> int: ...


class Placement(Protocol):
    """Where one worker will run, chosen before its command line is written."""

    host: str  # the address its TCP channels bind to (its node's, for a cluster)
    where: dict  # for GET /deployment: the node and process that hold it

    def start(self, argv: list[str], env: dict[str, str]) -> WorkerProcess:
        """Start `python -m pdserve.engine.worker *argv` there; `env` adds to its environment."""


class WorkerBackend(Protocol):
    remote: bool  # workers may run on other hosts: every channel is TCP
    host: str  # with `remote`: the frontend's address, reachable from every node

    def place(self, worker_id: int, spec: WorkerSpec) -> Placement: ...


@dataclass
class LocalPlacement:
    host: str
    where: dict

    def start(self, argv: list[str], env: dict[str, str]) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-m", "pdserve.engine.worker", *argv], env={**os.environ, **env}
        )


class LocalProcessBackend:
    """Workers as subprocesses of the frontend, on this host."""

    remote = False

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.host = host  # where decode workers bind a TCP KV channel

    def place(self, worker_id: int, spec: WorkerSpec) -> LocalPlacement:
        return LocalPlacement(self.host, {"backend": "local"})


@dataclass
class WorkerHandle:
    worker_id: int
    spec: WorkerSpec
    proc: WorkerProcess
    where: dict
    sock: zmq.asyncio.Socket | None = None  # to its input channel, once it reported in
    info: WorkerInfo | None = None
    state: WorkerState | None = None
    alive: bool = True
    restarting: bool = False
    role: Role | None = None  # what it does now: the spec's role, unless switched since

    def __post_init__(self) -> None:
        if self.role is None:
            self.role = self.spec.role


class WorkerPool:
    def __init__(
        self,
        specs: list[WorkerSpec],
        *,
        kv_transport: KVTransportKind = KVTransportKind.SHM,
        backend: WorkerBackend | None = None,
        metrics=None,
    ) -> None:
        self.specs = specs
        self.kv_transport = KVTransportKind(kv_transport)
        self.backend = backend or LocalProcessBackend()
        if self.backend.remote and self.kv_transport == KVTransportKind.SHM:
            raise ValueError("workers on a cluster move KV over tcp, not shm")
        self.metrics = metrics
        self.ctx = zmq.asyncio.Context()
        self.dirs = RuntimeDirs()  # private; removed in `shutdown`
        self.secret = new_secret()  # authenticates every channel of this deployment
        self.pull = make_socket(self.ctx, zmq.PULL, self._address("out", None), bind=True)
        self.output_addr = bound_address(self.pull)
        self.encode = Encoder(self.secret)
        self.decoder = Decoder(FromWorker, self.secret)
        self.num_bad_frames = 0
        self.workers: list[WorkerHandle] = []
        self.closing = False

    # ---- starting ------------------------------------------------------------------------
    def spawn(self) -> None:
        """Start the worker processes; they load their model while the caller goes on."""
        if not self.workers:
            self.workers = [self._launch(i, spec) for i, spec in enumerate(self.specs)]

    def _address(self, name: str, host: str | None) -> str:
        """Where a channel binds: a unix socket here, or a TCP port on `host` (the frontend's
        own for None) when workers may be elsewhere."""
        if self.backend.remote:
            return f"tcp://{host or self.backend.host}:0"
        return self.dirs.address(name)

    def _launch(self, worker_id: int, spec: WorkerSpec) -> WorkerHandle:
        place = self.backend.place(worker_id, spec)
        argv = [
            "--engine-args",
            msgspec.json.encode(spec.args).decode(),
            "--input",
            self._address(f"in{worker_id}", place.host),
            "--output",
            self.output_addr,
            "--role",
            spec.role,
            "--worker-id",
            str(worker_id),
            "--kv-transport",
            self.kv_transport,
        ]
        if spec.switchable:
            argv.append("--switchable")
        if spec.role == Role.DECODE or spec.switchable:
            kv_addr = (
                self.dirs.address(f"kv{worker_id}")
                if self.kv_transport == KVTransportKind.SHM
                else f"tcp://{place.host}:0"
            )
            argv += ["--kv-address", kv_addr]
        if spec.cpus:
            argv += ["--cpus", spec.cpus]
        env = {**self.dirs.env(), SECRET_ENV: self.secret.hex()}
        proc = place.start(argv, env)
        return WorkerHandle(worker_id, spec, proc, {**place.where, "pid": proc.pid})

    def _connect(self, w: WorkerHandle, info: WorkerInfo) -> None:
        """A worker reported in: accept its info and connect to its input channel."""
        if w.sock is not None:
            w.sock.close()
        w.info = info
        w.sock = make_socket(self.ctx, zmq.PUSH, info.input_endpoint, bind=False)

    async def wait_ready(self, timeout_s: float) -> None:
        """Wait for every worker's `WorkerInfo`, then check they agree on the KV layout."""
        pending = {w.worker_id for w in self.workers}
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
                msg = self.receive(await self.pull.recv())
                if isinstance(msg, WorkerInfo) and msg.worker_id in pending:
                    self._connect(self.workers[msg.worker_id], msg)
                    pending.discard(msg.worker_id)
                elif isinstance(msg, WorkerError):
                    raise RuntimeError(msg.message)
        self._check_layouts()

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

    def announce_peers(self) -> None:
        """Tell every live worker that may send KV where every other live worker takes it."""
        for p in self.live():
            if p.role != Role.PREFILL and not p.spec.switchable:
                continue
            for d in self.live():
                if d is not p and d.info.kv_endpoint is not None:
                    self.send(p.worker_id, PeerInfo(d.info.kv_endpoint))

    # ---- state -----------------------------------------------------------------------------
    @property
    def info(self) -> WorkerInfo:
        return self.workers[0].info

    def live(self, role: Role | None = None) -> list[WorkerHandle]:
        return [w for w in self.workers if w.alive and (role is None or w.role == role)]

    def is_alive(self, worker_id: int) -> bool:
        return self.workers[worker_id].alive

    @property
    def disaggregated(self) -> bool:
        return any(w.role == Role.PREFILL for w in self.workers)

    @property
    def dead_reason(self) -> str | None:
        dead = [w for w in self.workers if not w.alive]
        return ", ".join(self.death(w) for w in dead) or None

    @staticmethod
    def death(w: WorkerHandle) -> str:
        return f"engine worker {w.worker_id} ({w.role}) died (exit code {w.proc.returncode})"

    # ---- messages --------------------------------------------------------------------------
    def send(self, worker_id: int, msg) -> None:
        w = self.workers[worker_id]
        if w.alive and w.sock is not None:
            w.sock.send(self.encode(msg))  # PUSH with no HWM: never blocks

    def receive(self, frame: bytes):
        """A worker's message, or None for a frame that is not one (counted, logged, dropped)."""
        try:
            msg = self.decoder(frame)
            if not 0 <= msg.worker_id < len(self.workers):
                raise BadFrame(f"a message from unknown worker {msg.worker_id}")
        except BadFrame as e:
            self.num_bad_frames += 1
            logger.warning("dropped a frame on the worker output channel: %s", e)
            if self.metrics is not None:
                self.metrics.dropped_frames.labels("frontend", "-", "control").inc()
            return None
        return msg

    async def next_message(self):
        return self.receive(await self.pull.recv())

    # ---- supervision -----------------------------------------------------------------------
    def reap(self) -> list[WorkerHandle]:
        """Workers that exited since the last call, now marked dead."""
        dead = []
        for w in self.workers:
            if w.alive and w.proc.poll() is not None:
                w.alive = False
                self._cleanup_shm(w)
                dead.append(w)
            elif w.restarting and w.proc.poll() is not None:
                w.restarting = False
                logger.error(
                    "restarting worker %d failed (exit code %s)", w.worker_id, w.proc.returncode
                )
        return dead

    async def restart(self, old: WorkerHandle, delay_s: float = 0.5) -> None:
        """Start a dead worker again; it counts as alive once its `WorkerInfo` is accepted."""
        await asyncio.sleep(delay_s)
        if old.sock is not None:
            old.sock.close()
            old.sock = None
        try:  # placing a worker on a cluster waits for the cluster: not on the event loop
            new = await asyncio.to_thread(self._launch, old.worker_id, old.spec)
        except Exception as e:  # e.g. no node can host it now: it stays dead, and says why
            logger.error("restarting worker %d failed: %s", old.worker_id, e)
            return
        new.alive, new.restarting, new.role = False, True, old.role
        self.workers[old.worker_id] = new

    def rejoin(self, info: WorkerInfo) -> WorkerHandle | None:
        """A restarted worker reported in: accept it if it matches the deployment."""
        w = self.workers[info.worker_id]
        reference = next((x.info for x in self.workers if x is not w and x.info), None)
        diff = reference.layout.mismatch(info.layout) if reference is not None else None
        if diff:
            logger.error("restarted worker %d has a different KV layout: %s", w.worker_id, diff)
            return None
        self._connect(w, info)
        w.alive, w.restarting = True, False
        self.announce_peers()
        return w

    # ---- stopping --------------------------------------------------------------------------
    def kill(self) -> None:
        """Stop the workers at once and remove the runtime directories (a failed start)."""
        for w in self.workers:
            if w.proc.poll() is None:
                w.proc.kill()
                w.proc.wait()
        self.dirs.remove()

    async def stop(self, grace_s: float = 5.0) -> None:
        """Ask every worker to stop; kill those still running after `grace_s`."""
        self.closing = True
        for w in self.workers:
            if w.alive and w.sock is not None:
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

    def close(self) -> None:
        """Close the channels and remove the runtime directories (after `stop`)."""
        for w in self.workers:
            if w.sock is not None:
                w.sock.close()
        self.pull.close()
        self.ctx.term()
        self.dirs.remove()

    @staticmethod
    def _cleanup_shm(w: WorkerHandle) -> None:
        ep = w.info.kv_endpoint if w.info is not None else None
        for path in ep.shm_paths if ep is not None else ():
            with contextlib.suppress(OSError):
                os.unlink(path)
