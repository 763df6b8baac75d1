"""Control messages between the frontend and engine workers (msgspec, tagged; never pickle).

The protocol is role-agnostic: a worker of any role (both, prefill, decode) takes the same
requests and answers with the same outputs; the role only changes what its engine admits and
what its KV connector does. Tensors never travel here.
"""

from __future__ import annotations

import msgspec

from pdserve.disagg.protocol import KVDest, KVLayout, PeerEndpoint
from pdserve.types import EngineCoreOutput, KVRole, Role, SamplingParams


class AddRequest(msgspec.Struct, tag=True):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    queue_timeout_s: float | None = None
    # Disaggregation: the request's part in a handoff (`KVRole`); "send" ships to `kv_dest`.
    kv_role: KVRole | None = None
    kv_dest: KVDest | None = None


class FinishRequests(msgspec.Struct, tag=True):
    request_ids: list[str]
    reason: str = "abort"  # "abort" (client gone, error) | "stop" (stop string matched)
    # Decode worker: False while a prefill worker may still write into the request's blocks
    # (they are then held until it confirms); True when it never got the request or is dead.
    release_kv: bool = True


class ResumeLocally(msgspec.Struct, tag=True):
    """Decode worker: stop waiting for remote KV and compute the prompt here, continuing after
    the tokens the client already received."""

    request_id: str
    output_token_ids: list[int]
    release_kv: bool = False


class ReleaseKV(msgspec.Struct, tag=True):
    """Decode worker: the prefill worker of these requests is dead; free their held blocks."""

    request_ids: list[str]


class PeerInfo(msgspec.Struct, tag=True):
    """Prefill worker: how to reach a decode worker's KV cache (sent again after a restart)."""

    endpoint: PeerEndpoint


class SetCPUs(msgspec.Struct, tag=True):
    """Run on these CPUs, one thread each, from the next step on (`--pd-merge`: a parked
    worker's CPUs lent to the colocated one, and given back)."""

    cpus: list[int]


class Shutdown(msgspec.Struct, tag=True):
    pass


ToWorker = AddRequest | FinishRequests | ResumeLocally | ReleaseKV | PeerInfo | SetCPUs | Shutdown


class WorkerInfo(msgspec.Struct, tag=True):
    """Sent once when the worker is ready: what the frontend needs to validate requests."""

    worker_id: int
    role: Role
    model: str
    max_model_len: int
    vocab_size: int
    num_kv_blocks: int
    block_size: int
    kv_bytes_per_block: int
    dtype: str
    pid: int
    layout: KVLayout
    kv_endpoint: PeerEndpoint | None = None  # decode role: where prefill workers send KV
    input_endpoint: str = ""  # the control channel it bound: the frontend connects here


class StepStatsMsg(msgspec.Struct, array_like=True):
    phase: str
    step_time_s: float
    num_prefill_tokens: int
    num_decode_seqs: int
    mfu: float | None
    mbu: float | None


class KVTierState(msgspec.Struct, array_like=True):
    """One offload tier as a worker sees it; counts are cumulative since the worker started
    (usage of a shared host tier is the whole arena's)."""

    tier: str  # cpu | disk
    capacity_bytes: int
    used_bytes: int
    hits: int  # blocks read back and verified
    misses: dict[str, int]  # by reason: absent, corrupt, raced, error
    loaded_bytes: int
    load_s: float
    stored: int
    stored_bytes: int
    store_s: float
    store_errors: int
    evicted: int


class KVOffloadState(msgspec.Struct, array_like=True):
    saved_blocks: int  # evicted from the pool, handed to the tiers
    dropped_blocks: int  # evicted while the store thread was behind: not saved
    loaded_blocks: int  # loaded back into the pool instead of recomputed
    swap_ins: int  # preempted requests that resumed from a tier
    copy_s: float  # the steps' own time copying blocks out of and into the pool
    prefetched_blocks: int  # read ahead while their request waited
    read_on_step: int  # read while scheduling their request (not prefetched in time)
    tiers: list[KVTierState] = []


class WorkerState(msgspec.Struct, array_like=True):
    num_running: int
    num_waiting: int
    kv_usage: float
    num_preemptions: int
    prefix_queries: int
    prefix_hits: int
    num_free_blocks: int = 0
    queued_prefill_tokens: int = 0  # prompt tokens not yet computed (router load signal)
    # Frames dropped since the worker started, by reason: "control" (a control frame that is not
    # from the frontend) and the KV channel's reasons (see `KVReceiver`).
    dropped_frames: dict[str, int] = {}
    kv_offload: KVOffloadState | None = None  # with --kv-offload
    num_threads: int = 0  # the CPU threads its steps run on now


class KVReservation(msgspec.Struct, array_like=True):
    request_id: str
    block_ids: list[int]
    num_cached_tokens: int


class KVReceived(msgspec.Struct, array_like=True):
    request_id: str
    first_token: int  # sampled by the prefill worker


class TransferStat(msgspec.Struct, array_like=True):
    request_id: str
    num_bytes: int
    seconds: float  # time spent moving the rows (the transfer thread's busy time)
    span_s: float  # first layer queued -> KV complete (overlaps the prefill's compute)
    path: str = "shm"  # what the rows went through: shm (written in place) or tcp


class StepOutputs(msgspec.Struct, tag=True):
    worker_id: int
    outputs: list[EngineCoreOutput]
    steps: list[StepStatsMsg]  # the steps since the last message
    state: WorkerState
    reservations: list[KVReservation] = []  # decode role: blocks held for remote KV
    kv_received: list[KVReceived] = []  # decode role: requests whose remote KV arrived
    transfers: list[TransferStat] = []  # prefill role: KV sent for handed-off requests
    kv_exposed_s: float = 0.0  # prefill role: cumulative time steps waited on KV transfers


class WorkerError(msgspec.Struct, tag=True):
    """A request the worker rejected (validation), or a fatal error (request_id None)."""

    worker_id: int
    message: str
    request_id: str | None = None


FromWorker = WorkerInfo | StepOutputs | WorkerError
