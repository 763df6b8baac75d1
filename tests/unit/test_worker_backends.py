"""Where workers run: the pool's channels follow the backend, and a cluster needs Ray."""

from __future__ import annotations

import sys

import pytest

from pdserve.config import EngineArgs
from pdserve.pools.worker_pool import LocalProcessBackend, WorkerPool, WorkerSpec
from pdserve.types import KVTransportKind, Role


class RemoteBackend:
    """A backend whose workers may be anywhere (nothing is started here)."""

    remote = True
    host = "127.0.0.1"

    def place(self, worker_id, spec):
        raise AssertionError("not started in these tests")


SPECS = [
    WorkerSpec(Role.PREFILL, EngineArgs(model="m")),
    WorkerSpec(Role.DECODE, EngineArgs(model="m")),
]


def test_channels_are_unix_sockets_here_and_tcp_for_a_cluster():
    local = WorkerPool(SPECS, backend=LocalProcessBackend())
    remote = WorkerPool(SPECS, kv_transport=KVTransportKind.TCP, backend=RemoteBackend())
    try:
        assert local.output_addr.startswith(f"ipc://{local.dirs.ipc}/")
        assert local._address("in0", "10.0.0.9").startswith(f"ipc://{local.dirs.ipc}/in0-")
        # Port 0 resolved to the port bound; a worker's channel binds on its own node.
        assert remote.output_addr.startswith("tcp://127.0.0.1:")
        assert not remote.output_addr.endswith(":0")
        assert remote._address("in0", "10.0.0.9") == "tcp://10.0.0.9:0"
    finally:
        for pool in (local, remote):
            pool.close()


def test_a_cluster_refuses_shared_memory_kv():
    with pytest.raises(ValueError, match="tcp, not shm"):
        WorkerPool(SPECS, kv_transport=KVTransportKind.SHM, backend=RemoteBackend())


def test_ray_address_without_ray_says_how_to_install(monkeypatch):
    from pdserve.pools.ray_backend import RayBackend

    monkeypatch.setitem(sys.modules, "ray", None)  # import ray fails
    with pytest.raises(RuntimeError, match=r"pip install -e '\.\[ray\]'"):
        RayBackend("auto")


def test_a_tensor_parallel_worker_reserves_its_cpus_and_gpus_per_rank():
    """A Ray actor hosts the whole worker, every rank of it: it reserves the per-worker CPUs
    and GPUs once per rank (the placement, with a stand-in for Ray)."""
    from pdserve.pools.ray_backend import RayBackend

    asked = []

    class Actor:
        class where:  # noqa: N801  (ray's method handle)
            @staticmethod
            def remote():
                return {"node_ip": "10.0.0.2"}

    class ActorClass:
        def options(self, **options):
            asked.append(options)
            return self

        def remote(self):
            return Actor()

    class Ray:
        @staticmethod
        def get(ref, timeout=None):
            return ref

    backend = object.__new__(RayBackend)
    backend.ray, backend.actor_class, backend.deployment = Ray(), ActorClass(), "test"
    backend.cpus, backend.gpus = 2.0, 0.5
    backend.labels = {Role.PREFILL: {}, Role.DECODE: {}, Role.BOTH: {}}
    for size in (1, 4):
        spec = WorkerSpec(Role.BOTH, EngineArgs(model="m", tensor_parallel_size=size))
        placement = backend.place(0, spec)
        assert placement.host == "10.0.0.2"
        assert (asked[-1]["num_cpus"], asked[-1]["num_gpus"]) == (2.0 * size, 0.5 * size)
