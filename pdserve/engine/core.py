"""EngineCore: the scheduler, the KV cache manager and the model runner, stepped together.

Token ids in, token ids out: no tokenizer here, so the same core runs inside a worker process
(server, prefill and decode roles) and in-process for the offline `LLM`. `step()` is the whole
loop: plan, execute, update; it also records the step's phase statistics.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import weakref
from concurrent.futures import Future

from pdserve.config import EngineArgs, ModelConfig
from pdserve.disagg.connector.base import KVConnector
from pdserve.engine import c_heap, cpu_placement
from pdserve.engine.cpu_placement import PlacementMonitor
from pdserve.engine.stats import StepStats, StepStatsRecorder
from pdserve.engine.thread_binding import bound_step
from pdserve.kv.manager import KVCacheManager
from pdserve.request import Request
from pdserve.runner.kv_offload import BlockMover, build_stack
from pdserve.runner.model_runner import ModelRunner
from pdserve.sched.scheduler import Scheduler
from pdserve.structured.matcher import GrammarCompiler
from pdserve.types import EngineCoreOutput, RequestStatus, SamplingParams
from pdserve.validation import EngineLimits

logger = logging.getLogger(__name__)


def place_threads(args: EngineArgs) -> PlacementMonitor | None:
    """`--num-threads` as given; else, on a CPU, threads and pinning from the free cores."""
    if args.num_threads:
        import torch

        if cpu_placement.supported():
            cpu_placement.unpin()  # N threads on the CPUs an earlier engine did not claim
        torch.set_num_threads(args.num_threads)
        return None
    if args.device != "cpu" or not cpu_placement.supported() or args.tensor_parallel_size > 1:
        return None  # tensor parallel: the ranks share this process's CPUs out at start
    return PlacementMonitor()


class EngineCore:
    def __init__(
        self,
        args: EngineArgs,
        model_config: ModelConfig | None = None,
        connector: KVConnector | None = None,
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
        self.connector = connector or KVConnector()  # colocated: no KV crosses workers
        cache_config = args.cache_config()
        sched_config = args.scheduler_config(max_len)  # checked before the weights load
        if not self.connector.decodes:  # a prefill worker: no speculation, no draft model
            sched_config = dataclasses.replace(sched_config, speculation=None)
        self.runner = ModelRunner(
            self.model_config,
            cache_config,
            args.device,
            args.dtype,
            max_len,
            args.seed,
            kv_cache_factory=self.connector.kv_cache_factory(),
            linear_backend=args.linear_backend,
            attention_backend=args.attention_backend,
            enforce_eager=args.enforce_eager,
            quantization=args.quantization,
            group_size=args.quantization_group_size,
            calibration_tokens=args.quantization_calibration_tokens,
            kv_cache_dtype=args.kv_cache_dtype,
            draft_model=args.draft_model if sched_config.speculation else None,
            draft_layers=args.draft_layers if sched_config.speculation else None,
            tensor_parallel_size=args.tensor_parallel_size,
            tensor_parallel_threads=args.num_threads,
        )
        if self.runner.tp is not None:
            weakref.finalize(self, self.runner.tp.close)
        c_heap.release_free_memory()  # what loading freed (the weights' unpacked forms)
        c_heap.keep_freed_memory()  # before the warm-up, whose memory the steps then reuse
        if args.warmup:
            tokens = min(sched_config.max_num_batched_tokens, max_len)
            took = self.runner.warm_up(tokens, sched_config.max_num_seqs)
            logger.info("warmed up in %.2f s (%d prompt tokens, %d decodes)", took, tokens,
                        sched_config.max_num_seqs)  # fmt: skip
        self.offload = None  # BlockMover, with --kv-offload
        tiers = build_stack(self)
        self.kv = KVCacheManager(
            self.runner.num_blocks,
            cache_config.block_size,
            cache_config.enable_prefix_caching,
            tier=tiers,
        )
        if tiers is not None:
            self.offload = BlockMover(
                self.runner.kv_caches, self.runner.num_blocks, tiers, self.runner.tp
            )
            weakref.finalize(self, tiers.close)
        self.scheduler = Scheduler(sched_config, self.kv)
        self.max_steps = self._max_steps(sched_config.num_scheduler_steps)
        self.limits = EngineLimits(
            max_len,
            self.model_config.vocab_size,
            kv_capacity=self.kv.num_blocks * self.kv.block_size,
            max_unchunked_prompt=(
                None if sched_config.enable_chunked_prefill else sched_config.max_num_batched_tokens
            ),
        )
        self.stats = StepStatsRecorder(self.model_config, self.runner, args.hardware_profile)
        # Structured output: requests wait here while their grammar compiles (off this thread).
        self.grammars: GrammarCompiler | None = None  # made for the first such request
        self.compiling: dict[str, tuple[Request, Future]] = {}
        self.connector.attach(self)

    def _max_steps(self, asked: int) -> int:
        """The longest burst this engine runs: `--num-scheduler-steps` where the runner has a
        fused decode step with a native head, else 1 (said once, at start)."""
        fused = self.runner.model.fused_decode
        if asked > 1 and (fused is None or fused.embed is None):
            logger.warning("--num-scheduler-steps %d ignored: bursts run on the fused decode "
                           "step with a native head, which this model does not run", asked)  # fmt: skip
            return 1
        return asked

    def close(self) -> None:
        """End the follower ranks of a tensor-parallel runner (they end with this process
        anyway)."""
        self.runner.close()

    # ---- requests ------------------------------------------------------------------------
    def make_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
    ) -> Request:
        """Validate a tokenized request against this engine's limits and build its state."""
        max_tokens = self.limits.check(prompt_token_ids, params.max_tokens)
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
        ended = self.scheduler.finish_requests(request_ids, status, release_kv)
        self.connector.forget(request_ids)
        return ended

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
        # a request whose grammar compiles is waiting too: no burst makes it wait longer
        self.scheduler.max_steps = 1 if self.compiling else self.max_steps
        plan = self.scheduler.schedule()
        if self.offload is not None:  # blocks out to the tier, and back, before any KV write
            self.offload.sync(self.kv)
        if plan.is_empty:
            return outputs
        self.connector.begin_step(plan, self.kv.req_block_ids)
        outputs += self.execute(plan)
        self.connector.end_step(self.scheduler.remote.take_handed_off(), outputs)
        return outputs

    def execute(self, plan) -> list[EngineCoreOutput]:
        """Run a scheduled plan: forward, sample, update (for callers that act between)."""
        with bound_step():
            t0 = time.perf_counter()
            result = self.runner.execute(plan, self.kv.req_block_ids)
            t1 = time.perf_counter()
        if self.offload is not None and plan.num_decode_tokens == 0:
            self.kv.tier.cost.observe_prefill(plan.num_prefill_tokens, t1 - t0)
        outputs = self.scheduler.update(
            plan,
            result.sampled,
            result.logprobs,
            result.prompt_logprobs,
            result.speculated,
            result.bursts,
        )
        self.scheduler.observe_step(plan, t1 - t0)  # after update: it counts the accepted
        steps = len(result.bursts[0]) if result.bursts else 1  # those a burst ran
        step = self.stats.record(plan, t0, t1, self.scheduler.stats(), steps)
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
