"""Workers on a Ray cluster: each engine worker runs in a Ray actor placed by resources.

`pdserve serve --ray-address auto|HOST:PORT` makes the frontend a Ray driver and gives the
`WorkerPool` this backend instead of local subprocesses. An actor reserves a worker's CPUs (and
GPUs), lands on a node whose labels match its pool's (`--ray-prefill-labels`, ...; actors of one
pool are spread over the nodes that match), makes the deployment's private directories on that
node and starts the same worker command there as its child. Nothing else changes: the worker
binds its control channel and its KV channel on its node's address, reports in over TCP, and
the pool supervises it as it does a local one. The worker dies with its actor (it watches its
parent), and the actor with the frontend (Ray ends a driver's actors when the driver goes).

Ray's own control plane serializes task arguments with pickle and trusts its network: run a
cluster only on a network you trust, as Ray requires. What pdserve sends through Ray is plain
data (a command line and a few environment variables); every pdserve channel between the
frontend and the workers is authenticated by the deployment's secret, as on one host.

Ray is imported only here, and only when `--ray-address` is given.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import uuid
from dataclasses import dataclass

from pdserve.config.disagg import parse_labels
from pdserve.ipc.channel import RuntimeDirs
from pdserve.pools.worker_pool import WorkerSpec
from pdserve.types import Role

logger = logging.getLogger("pdserve.ray")

NAMESPACE = "pdserve"
PLACE_TIMEOUT_S = 120.0  # an actor that no node can host within this is an error, not a wait


def _ray():
    try:
        import ray
    except ImportError:
        raise RuntimeError(
            "--ray-address needs Ray: pip install -e '.[ray]' (or pip install ray)"
        ) from None
    return ray


class WorkerActor:
    """The body of a worker's actor (made a Ray actor class in `RayBackend`): it runs one
    worker process on its node and reports its end."""

    def __init__(self) -> None:
        self.dirs = RuntimeDirs()  # this node's private directories for the worker
        self.proc: subprocess.Popen | None = None

    def where(self) -> dict:
        ray = _ray()
        ctx = ray.get_runtime_context()
        return {
            "backend": "ray",
            "node_id": ctx.get_node_id(),
            "node_ip": ray.util.get_node_ip_address(),
            "actor_id": ctx.get_actor_id(),
        }

    def start(self, argv: list[str], env: dict[str, str]) -> int:
        env = {**os.environ, **env, **self.dirs.env()}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pdserve.engine.worker", *argv], env=env
        )
        return self.proc.pid

    def wait(self) -> int:
        try:
            return self.proc.wait()
        finally:
            self.dirs.remove()


class RayWorkerProcess:
    """A worker in an actor, as the pool sees a process: `poll` is its exit code once the
    worker exited or the actor died (then -9), and the actor is ended with it."""

    def __init__(self, ray, actor, pid: int, done) -> None:
        self._ray, self.actor, self.pid = ray, actor, pid
        self.returncode: int | None = None
        self._done = threading.Event()
        threading.Thread(
            target=self._watch, args=(done,), name="pdserve-ray-watch", daemon=True
        ).start()

    def _watch(self, done) -> None:
        try:
            code = self._ray.get(done)
        except self._ray.exceptions.RayActorError:
            code = -signal.SIGKILL  # the actor (and with it the worker) was killed or lost
        except Exception as e:
            logger.error("lost track of a worker actor: %s", e)
            code = 1
        self.returncode = code
        self._done.set()
        with contextlib.suppress(Exception):  # its CPUs and GPUs go back to the cluster
            self._ray.kill(self.actor, no_restart=True)

    def poll(self) -> int | None:
        return self.returncode

    def kill(self) -> None:
        with contextlib.suppress(Exception):
            self._ray.kill(self.actor, no_restart=True)

    def wait(self, timeout: float | None = None) -> int | None:
        self._done.wait(timeout)
        return self.returncode


@dataclass
class RayPlacement:
    ray: object
    actor: object
    host: str
    where: dict

    def start(self, argv: list[str], env: dict[str, str]) -> RayWorkerProcess:
        pid = self.ray.get(self.actor.start.remote(argv, env), timeout=PLACE_TIMEOUT_S)
        return RayWorkerProcess(self.ray, self.actor, pid, self.actor.wait.remote())


class RayBackend:
    """Places each worker in an actor of its own on the cluster at `address`."""

    remote = True

    def __init__(
        self,
        address: str,
        *,
        cpus_per_worker: float = 1.0,
        gpus_per_worker: float = 0.0,
        prefill_labels: str = "",
        decode_labels: str = "",
    ) -> None:
        self.ray = ray = _ray()
        if not ray.is_initialized():
            # ray.init makes SIGTERM exit at once; the server's own handler shuts down cleanly
            on_sigterm = signal.getsignal(signal.SIGTERM)
            ray.init(address=address, namespace=NAMESPACE, log_to_driver=True)
            if threading.current_thread() is threading.main_thread():
                signal.signal(signal.SIGTERM, on_sigterm)
        self.host = ray.util.get_node_ip_address()  # the frontend's channels bind here
        self.cpus, self.gpus = cpus_per_worker, gpus_per_worker
        self.labels = {Role.PREFILL: parse_labels(prefill_labels)}
        self.labels[Role.DECODE] = self.labels[Role.BOTH] = parse_labels(decode_labels)
        self.deployment = uuid.uuid4().hex[:8]  # names this deployment's actors
        self.actor_class = ray.remote(WorkerActor)

    def place(self, worker_id: int, spec: WorkerSpec) -> RayPlacement:
        ranks = spec.args.tensor_parallel_size  # a tensor-parallel worker: this much per rank
        cpus, gpus = self.cpus * ranks, self.gpus * ranks
        options = {
            "num_cpus": cpus,
            "num_gpus": gpus,
            "name": f"pdserve-{self.deployment}-worker{worker_id}-{uuid.uuid4().hex[:6]}",
            "scheduling_strategy": "SPREAD",
            "max_restarts": 0,  # the pool restarts workers (--restart-workers), not Ray
        }
        if self.labels[spec.role]:
            options["label_selector"] = self.labels[spec.role]
        actor = self.actor_class.options(**options).remote()
        try:
            where = self.ray.get(actor.where.remote(), timeout=PLACE_TIMEOUT_S)
        except self.ray.exceptions.GetTimeoutError:
            self.ray.kill(actor)
            raise RuntimeError(
                f"no Ray node could host worker {worker_id} ({spec.role}) within "
                f"{PLACE_TIMEOUT_S:.0f}s: it needs {cpus} CPUs, {gpus} GPUs"
                + (f" and labels {self.labels[spec.role]}" if self.labels[spec.role] else "")
            ) from None
        where["actor"] = options["name"]
        logger.info("worker %d (%s) placed on node %s", worker_id, spec.role, where["node_ip"])
        return RayPlacement(self.ray, actor, where["node_ip"], where)
