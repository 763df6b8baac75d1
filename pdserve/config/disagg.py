"""Worker pools of one deployment (`DisaggConfig`) and the workers they start (`worker_specs`).

Each field is a setting of `pdserve serve`; a pool's own engine settings (`--prefill-max-num-seqs`,
...) are the per-pool settings of `EngineArgs`, kept here as overrides by field name and checked
as the base settings are. No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from pdserve.config.engine import EngineArgs
from pdserve.config.server import ADMISSION_GROUP
from pdserve.config.settings import (
    POSITIVE,
    Check,
    at_least,
    check_overrides,
    check_settings,
    internal,
    require,
    setting,
)
from pdserve.pools.pd_controller import PhaseSLO
from pdserve.types import KVTransportKind, PrefillFailurePolicy, Role, RoleControl


def _slo(text: str) -> str:
    PhaseSLO.parse(text)  # a clear error now rather than at startup
    return text


def parse_labels(text: str) -> dict[str, str]:
    """`KEY=VALUE,...` (Ray node labels) as a dict; a clear error for anything else."""
    labels = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key.strip() or not value.strip():
            raise ValueError(f"node labels are KEY=VALUE[,KEY=VALUE...], not {text!r}")
        labels[key.strip()] = value.strip()
    return labels


def _labels_ok(text: str) -> bool:
    try:
        parse_labels(text)
    except ValueError:
        return False
    return True


LABELS = Check(_labels_ok, "node labels are KEY=VALUE[,KEY=VALUE...]")


DISAGG_GROUP = "disaggregation (prefill and decode worker pools)"
CLUSTER_GROUP = "cluster (workers as Ray actors; pip install -e '.[ray]')"


@dataclass(frozen=True)
class DisaggConfig:
    """Worker pools. `num_prefill_workers == 0` is the colocated default (one worker, role both)."""

    num_prefill_workers: int = setting(
        0,
        flag="prefill-workers",
        metavar="P",
        help="prefill workers (0: colocated, one worker runs both phases)",
        checks=(at_least(0),),
    )
    num_decode_workers: int = setting(
        1,
        flag="decode-workers",
        metavar="D",
        help="decode workers (with no prefill workers: colocated workers behind the router)",
        checks=(at_least(1),),
    )
    kv_transport: KVTransportKind = setting(
        KVTransportKind.SHM,
        help="how KV moves from prefill to decode workers (shm: one host; tcp: across hosts; "
        "auto: tcp, with the rows written in shared memory where the two share a host; "
        "with --ray-address shm becomes tcp, auto stays; on a GPU shm is CUDA IPC and tcp "
        "stages through pinned memory)",
    )
    kv_host: str = setting("127.0.0.1", help="address decode workers bind their TCP KV channel to")
    kv_transfer_timeout_s: float = setting(
        30.0,
        flag="kv-transfer-timeout",
        metavar="SECONDS",
        help="recompute on the decode worker if the KV has not arrived this long after the "
        "request was routed, or once the prefill worker has it, after that worker last "
        "reported a step (a busy prefill worker keeps its queue)",
        checks=(POSITIVE,),
    )
    min_prompt_tokens: int = setting(
        0,
        flag="disagg-min-prompt-tokens",
        metavar="N",
        help="prefill prompts shorter than N on the decode worker itself",
        checks=(at_least(0),),
    )
    on_prefill_failure: PrefillFailurePolicy = setting(
        PrefillFailurePolicy.RECOMPUTE,
        help="a dead prefill worker: recompute on the decode worker, or fail with 503",
    )
    prefill_cpus: tuple[str, ...] = setting(
        (), help="CPU set of a prefill worker (repeat per worker; cycled), e.g. 0"
    )
    decode_cpus: tuple[str, ...] = setting(
        (), help="CPU set of a decode worker (repeat per worker; cycled), e.g. 1"
    )
    prefill_overrides: dict[str, Any] = internal(
        default_factory=dict, why="EngineArgs per-pool settings: the --prefill-* flags"
    )
    decode_overrides: dict[str, Any] = internal(
        default_factory=dict, why="EngineArgs per-pool settings: the --decode-* flags"
    )
    restart_workers: bool = setting(False, help="start a dead worker again; it rejoins its pool")
    pd_ratio: RoleControl = setting(
        RoleControl.STATIC,
        help="static: roles fixed at startup; manual: every worker can switch role, set with "
        "POST /deployment; auto: the P:D controller switches roles from the measured load "
        "(the starting split is --prefill-workers:--decode-workers)",
    )
    slo: str = setting(
        "ttft_ms=2000,tpot_ms=150",
        parse=_slo,
        group=ADMISSION_GROUP,
        help="latency targets: the P:D controller steers by them, --slo-admission admits by "
        "the TTFT one, and pdserve_slo_attainment_ratio reports against both",
    )
    pd_min_dwell_s: float = setting(
        30.0,
        metavar="SECONDS",
        help="the P:D controller keeps a split at least this long",
        checks=(POSITIVE,),
    )
    pd_merge: bool = setting(
        False,
        help="with --pd-ratio manual|auto, colocated means one worker on every worker's CPUs: "
        "the others are parked (no new work; once what they hold is done their CPUs are lent "
        "to it) until a split needs them. Needs a CPU set per worker (--decode-cpus, "
        "--prefill-cpus) and workers on this host",
    )

    ray_address: str | None = setting(
        None,
        metavar="auto|HOST:PORT",
        group=CLUSTER_GROUP,
        help="start the workers as Ray actors on this cluster (auto: the one `ray start` runs "
        "here); the frontend stays in this process and KV moves over tcp",
    )
    ray_cpus_per_worker: float = setting(
        1.0,
        metavar="N",
        group=CLUSTER_GROUP,
        help="CPUs each worker actor reserves per engine rank (times --tensor-parallel-size), "
        "and each rank's thread count unless --num-threads",
        checks=(POSITIVE,),
    )
    ray_gpus_per_worker: float = setting(
        0.0,
        metavar="N",
        group=CLUSTER_GROUP,
        help="GPUs each worker actor reserves (Ray sets its CUDA_VISIBLE_DEVICES)",
        checks=(at_least(0),),
    )
    ray_prefill_labels: str = setting(
        "",
        checks=(LABELS,),
        metavar="KEY=VALUE,...",
        group=CLUSTER_GROUP,
        help="place prefill workers on nodes with these labels (`ray start --labels`)",
    )
    ray_decode_labels: str = setting(
        "",
        checks=(LABELS,),
        metavar="KEY=VALUE,...",
        group=CLUSTER_GROUP,
        help="place decode (and colocated) workers on nodes with these labels",
    )

    def __post_init__(self) -> None:
        check_settings(self)
        if self.ray_address and self.kv_transport == KVTransportKind.SHM:
            # shared memory reaches one host only; a cluster's workers may be on any node
            object.__setattr__(self, "kv_transport", KVTransportKind.TCP)
        require(
            self.pd_ratio == RoleControl.STATIC or self.num_workers >= 2,
            "pd_ratio",
            self.pd_ratio,
            "switching roles needs at least two workers",
        )
        if self.pd_merge:
            require(
                self.pd_ratio != RoleControl.STATIC,
                "pd_merge",
                True,
                "merging workers needs switchable roles: --pd-ratio manual or auto",
            )
            require(
                not self.ray_address,
                "pd_merge",
                True,
                "workers on a cluster cannot lend each other CPUs",
            )
            require(
                bool(self.decode_cpus) and (self.num_prefill_workers == 0 or self.prefill_cpus),
                "pd_merge",
                True,
                "a parked worker lends its CPU set: give every worker one (--decode-cpus, "
                "--prefill-cpus, repeated per worker)",
            )
        check_overrides(EngineArgs, self.prefill_overrides, "prefill_overrides")
        check_overrides(EngineArgs, self.decode_overrides, "decode_overrides")

    @property
    def disaggregated(self) -> bool:
        return self.num_prefill_workers > 0

    @property
    def num_workers(self) -> int:
        return self.num_prefill_workers + self.num_decode_workers

    @property
    def switchable(self) -> bool:
        return self.pd_ratio != RoleControl.STATIC


def worker_specs(
    args: EngineArgs, disagg: DisaggConfig
) -> list[tuple[Role, EngineArgs, str | None]]:
    """(role, engine args, CPU set) of every worker, prefill workers first. With no prefill
    workers the decode workers are colocated ones (role both). On a Ray cluster a worker runs
    as many threads as the CPUs its actor reserves (this host's CPU sets mean nothing there)."""
    if disagg.ray_address:
        threads = args.num_threads or max(1, int(disagg.ray_cpus_per_worker))
        local = replace(disagg, ray_address=None, prefill_cpus=(), decode_cpus=())
        return [
            (role, replace(a, num_threads=a.num_threads or threads), None)
            for role, a, _ in worker_specs(args, local)
        ]
    if disagg.num_workers == 1:
        cpus = disagg.decode_cpus[0] if disagg.decode_cpus else None
        return [(Role.BOTH, args, cpus)]
    require(
        not disagg.pd_merge or args.tensor_parallel_size == 1,
        "pd_merge",
        True,
        "a worker of several tensor-parallel ranks cannot take another worker's CPUs",
    )
    out = []
    # oneDNN's spinning threads and per-shape kernel builds hurt when several engine processes
    # share cores: disaggregated pools take the native kernel or F.linear unless the user asks
    # for oneDNN.
    if args.linear_backend == "auto":
        args = replace(args, linear_backend=_pool_linear_backend(args))
    for role, n, overrides, cpus in (
        (Role.PREFILL, disagg.num_prefill_workers, disagg.prefill_overrides, disagg.prefill_cpus),
        (
            Role.DECODE if disagg.disaggregated else Role.BOTH,
            disagg.num_decode_workers,
            disagg.decode_overrides,
            disagg.decode_cpus,
        ),
    ):
        pool_args = replace(args, **overrides)
        for i in range(n):
            out.append((role, pool_args, cpus[i % len(cpus)] if cpus else None))
    return out


def _pool_linear_backend(args: EngineArgs) -> str:
    from pdserve.kernels.linear import available

    cpu_float32 = args.device == "cpu" and args.dtype in ("auto", "float32")
    return "native" if cpu_float32 and available()[0] else "torch"
