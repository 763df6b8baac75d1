"""`Request`: the engine's runtime state of one sequence (no torch).

One counter model covers every phase: `num_computed_tokens` chases `num_tokens` (prompt plus
generated). A prefill chunk, a prefix-cache hit and KV received from a prefill worker all just
advance `num_computed_tokens`; decode is the case where one token is left to compute.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from pdserve.types import KVRole, RequestMetrics, RequestStatus, SamplingParams


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int  # resolved: params.max_tokens, capped by the model's context
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = field(default_factory=time.perf_counter)
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prompt tokens found in the prefix cache at first schedule
    stop_reason: str | int | None = None
    block_hashes: list[bytes] = field(default_factory=list)  # of the full blocks, in order
    metrics: RequestMetrics = field(init=False)
    runner_state: Any = None  # the model runner's per-request data (e.g. a seeded generator)
    grammar_state: Any = None  # structured output: the request's matcher (`pdserve.structured`)
    # Prompt logprobs (when asked for): entry i scores prompt token i; entry 0 is always None.
    prompt_logprobs: list[Any] | None = None
    queue_deadline: float | None = None  # abort if still unscheduled at this time
    # Disaggregation: its part in a handoff, on this worker (see `KVRole`).
    kv_role: KVRole | None = None
    kv_dest: Any = None  # for `KVRole.SEND`: where the KV goes (pdserve.disagg.KVDest)
    spec: Any = None  # speculative decoding: its record (`pdserve.spec.proposer.SpecState`)

    def __post_init__(self) -> None:
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids)
        self.metrics = RequestMetrics(
            arrival_time=self.arrival_time, num_prompt_tokens=len(self.prompt_token_ids)
        )

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
