"""EngineCore: the scheduler, the KV cache manager and the model runner, stepped together.

Token ids in, token ids out: no tokenizer here, so the same core runs inside a worker process
(server, prefill and decode roles) and in-process for the offline `LLM`. `step()` is the whole
loop: plan, execute, update; it also records the step's phase statistics.
"""

from __future__ import annotations

import time
from concurrent.futures import Future

from pdserve.config import EngineArgs, ModelConfig
from pdserve.engine import cpu_placement
from pdserve.engine.cpu_placement import PlacementMonitor
from pdserve.engine.stats import StepStats, StepStatsRecorder
from pdserve.kv.manager import KVCacheManager
from pdserve.request import Request
from pdserve.runner.model_runner import ModelRunner
from pdserve.sched.scheduler import Scheduler
from pdserve.structured.matcher import GrammarCompiler
from pdserve.types import EngineCoreOutput, RequestStatus, SamplingParams


def place_threads(args: EngineArgs) -> PlacementMonitor | None:
    """`--num-threads` as given; else, on a CPU, threads and pinning from the free cores."""
    if args.num_threads:
        import torch

        torch.set_num_threads(args.num_threads)
        return None
    if args.device != "cpu" or not cpu_placement.supported():
        return None
    return PlacementMonitor()


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
        self.placement = place_threads(args)
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
        # Structured output: requests wait here while their grammar compiles (off this thread).
        self.grammars: GrammarCompiler | None = None  # made for the first such request
        self.compiling: dict[str, tuple[Request, Future]] = {}

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
        max_tokens = params.max_tokens
        if max_tokens is None:
            max_tokens = min(room, capacity - n)
        if n + max_tokens > capacity or (params.max_tokens is None and max_tokens < 1):
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
        grammar = request.sampling_params.grammar
        if grammar is None:
            self.scheduler.add_request(request)
            return
        rid = request.request_id
        if rid in self.compiling or rid in self.scheduler.requests:
            raise ValueError(f"invalid request_id={rid!r}: already in use")
        if self.grammars is None:
            self.grammars = GrammarCompiler(
                self.args.tokenizer or self.args.model,
                self.model_config.vocab_size,
                self.model_config.eos_token_ids,
            )
        self.compiling[rid] = (request, self.grammars.submit(grammar))

    def admit_compiled(self) -> list[EngineCoreOutput]:
        """Hand requests whose grammar is ready to the scheduler; returns the ones that failed."""
        failed = []
        for rid, (request, future) in list(self.compiling.items()):
            if not future.done():
                continue
            del self.compiling[rid]
            try:
                request.grammar_state = future.result()
                self.scheduler.add_request(request)
            except ValueError as e:
                failed.append(EngineCoreOutput(rid, [], finish_reason="abort", error=str(e)))
        return failed

    def finish_requests(
        self, request_ids: list[str], status: RequestStatus, release_kv: bool = True
    ) -> list[Request]:
        for rid in request_ids:
            self.compiling.pop(rid, None)
        return self.scheduler.finish_requests(request_ids, status, release_kv)

    def abort_requests(self, request_ids: list[str]) -> list[Request]:
        return self.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def stop_requests(self, request_ids: list[str]) -> list[Request]:
        """Finish requests that matched a stop string (found by the detokenizer)."""
        return self.finish_requests(request_ids, RequestStatus.FINISHED_STOPPED)

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished or bool(self.compiling)

    # ---- the step ------------------------------------------------------------------------
    def step(self) -> list[EngineCoreOutput]:
        outputs = self.admit_compiled()
        plan = self.scheduler.schedule()
        if plan.is_empty:
            return outputs
        return outputs + self.execute(plan)

    def execute(self, plan) -> list[EngineCoreOutput]:
        """Run a scheduled plan: forward, sample, update (for callers that act between)."""
        t0 = time.perf_counter()
        result = self.runner.execute(plan, self.kv.req_block_ids)
        t1 = time.perf_counter()
        outputs = self.scheduler.update(
            plan, result.sampled, result.logprobs, result.prompt_logprobs
        )
        step = self.stats.record(plan, t0, t1, self.scheduler.stats())
        if self.placement is not None:
            self.placement.on_step(step.phase, step.num_decode_seqs, step.step_time_s)
        return outputs

    def on_idle(self) -> None:
        """The caller has no work for this engine right now (the worker loop between requests)."""
        if self.placement is not None:
            self.placement.on_idle()

    @property
    def last_step(self) -> StepStats | None:
        return self.stats.last
