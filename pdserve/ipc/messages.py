"""Control messages between the frontend and engine workers (msgspec, tagged; never pickle).

The protocol is role-agnostic: a worker of any role (both, prefill, decode) takes the same
requests and answers with the same outputs; the role only changes what its engine admits and
what its KV connector does. Tensors never travel here.
"""

from __future__ import annotations

import msgspec

from pdserve.types import EngineCoreOutput, SamplingParams


class AddRequest(msgspec.Struct, tag=True):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    queue_timeout_s: float | None = None


class FinishRequests(msgspec.Struct, tag=True):
    request_ids: list[str]
    reason: str = "abort"  # "abort" (client gone, error) | "stop" (stop string matched)


class Shutdown(msgspec.Struct, tag=True):
    pass


ToWorker = AddRequest | FinishRequests | Shutdown


class WorkerInfo(msgspec.Struct, tag=True):
    """Sent once when the worker is ready: what the frontend needs to validate requests."""

    worker_id: int
    role: str
    model: str
    max_model_len: int
    vocab_size: int
    num_kv_blocks: int
    block_size: int
    kv_bytes_per_block: int
    dtype: str
    pid: int


class StepStatsMsg(msgspec.Struct, array_like=True):
    phase: str
    step_time_s: float
    num_prefill_tokens: int
    num_decode_seqs: int
    mfu: float | None
    mbu: float | None


class WorkerState(msgspec.Struct, array_like=True):
    num_running: int
    num_waiting: int
    kv_usage: float
    num_preemptions: int
    prefix_queries: int
    prefix_hits: int


class StepOutputs(msgspec.Struct, tag=True):
    worker_id: int
    outputs: list[EngineCoreOutput]
    steps: list[StepStatsMsg]  # the steps since the last message
    state: WorkerState


class WorkerError(msgspec.Struct, tag=True):
    """A request the worker rejected (validation), or a fatal error (request_id None)."""

    worker_id: int
    message: str
    request_id: str | None = None


FromWorker = WorkerInfo | StepOutputs | WorkerError
