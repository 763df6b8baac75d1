"""EngineCore: the scheduler, the KV cache manager and the model runner, stepped together.

Token ids in, token ids out: no tokenizer here, so the same core runs inside a worker process
(server, prefill and decode roles) and in-process for the offline `LLM`. `step()` is the whole
loop: plan, execute, update; it also records the step's phase statistics.
"""

from __future__ import annotations

import time

from pdserve.config import EngineArgs, ModelConfig
from pdserve.engine.stats import StepStats, StepStatsRecorder
from pdserve.kv.manager import KVCacheManager
from pdserve.request import Request
from pdserve.runner.model_runner import ModelRunner
from pdserve.sched.scheduler import Scheduler
from pdserve.types import EngineCoreOutput, RequestStatus, SamplingParams


class EngineCore:
    def __init__(
        self, args: EngineArgs, model_config: ModelConfig | None = None, kv_cache_factory=None
    ) -> None:
        self.args = args
        self.model_config = model_config or ModelConfig.from_pretrained(args.model)
        max_len = self.model_config.max_model_len
        if args.max_model_len is not None:
            if args.max_model_len > max_len:
                raise ValueError(
                    f"invalid max_model_len={args.max_model_len}: the model supports {max_len}"
                )
            max_len = args.max_model_len
        self.max_model_len = max_len
        if args.num_threads:
            import torch

            torch.set_num_threads(args.num_threads)
        cache_config = args.cache_config()
        self.runner = ModelRunner(
            self.model_config,
            cache_config,
            args.device,
            args.dtype,
            max_len,
            args.seed,
            kv_cache_factory=kv_cache_factory,
            linear_backend=args.linear_backend,
        )
        self.kv = KVCacheManager(
            self.runner.num_blocks, cache_config.block_size, cache_config.enable_prefix_caching
        )
        self.scheduler = Scheduler(args.scheduler_config(max_len), self.kv)
        self.stats = StepStatsRecorder(self.model_config, self.runner, args.hardware_profile)

    # ---- requests ------------------------------------------------------------------------
    def make_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
    ) -> Request:
        """Validate a tokenized request against this engine's limits and build its state."""
        if not prompt_token_ids:
            raise ValueError("invalid prompt: it is empty")
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"invalid prompt token id {bad[0]}: the vocabulary has {vocab} ids")
        n = len(prompt_token_ids)
        room = self.max_model_len - n
        if room < 1:
            raise ValueError(
                f"invalid prompt: {n} tokens is longer than the model's context "
                f"({self.max_model_len} tokens, room for at least one output token needed)"
            )
        if params.max_tokens is not None and params.max_tokens > room:
            raise ValueError(
                f"invalid max_tokens={params.max_tokens}: the prompt has {n} tokens and the "
                f"context {self.max_model_len}, so at most {room} can be generated"
            )
        capacity = self.kv.num_blocks * self.kv.block_size
        # No max_tokens: up to the context, or as much as the whole KV cache holds.
        max_tokens = params.max_tokens or min(room, capacity - n)
        if n + max_tokens > capacity or max_tokens < 1:
            raise ValueError(
                f"invalid request: {n} prompt + {max_tokens} output tokens exceed the KV cache "
                f"({capacity} tokens); raise --kv-cache-memory or lower max_tokens"
            )
        kwargs = {} if arrival_time is None else {"arrival_time": arrival_time}
        return Request(
            request_id,
            list(prompt_token_ids),
            params,
            max_tokens,
            eos_token_ids=self.model_config.eos_token_ids,
            **kwargs,
        )

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> list[Request]:
        return self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def stop_requests(self, request_ids: list[str]) -> list[Request]:
        """Finish requests that matched a stop string (found by the detokenizer)."""
        return self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_STOPPED)

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    # ---- the step ------------------------------------------------------------------------
    def step(self) -> list[EngineCoreOutput]:
        plan = self.scheduler.schedule()
        if plan.is_empty:
            return []
        return self.execute(plan)

    def execute(self, plan) -> list[EngineCoreOutput]:
        """Run a scheduled plan: forward, sample, update (for callers that act between)."""
        t0 = time.perf_counter()
        sampled, logprobs = self.runner.execute(plan, self.kv.req_block_ids)
        t1 = time.perf_counter()
        outputs = self.scheduler.update(plan, sampled, logprobs)
        self.stats.record(plan, t0, t1, self.scheduler.stats())
        return outputs

    @property
    def last_step(self) -> StepStats | None:
        return self.stats.last
