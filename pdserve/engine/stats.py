"""Per-step statistics: what each step computed, how long it took, and MFU / MBU per phase.

FLOPs and bytes of a step come from the model's shapes (`pdserve.perf.cost`), the peaks from a
hardware profile (`pdserve profile-hardware`, or a file). Without a profile MFU and MBU are None:
the engine never runs a measurement behind the user's back.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from pdserve.perf.cost import ModelShape, step_cost
from pdserve.sched.scheduler import SchedulerOutput, SchedulerStats

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class StepStats:
    phase: str  # "prefill" | "decode" | "mixed"
    step_time_s: float  # of one forward step (a burst's time over its steps)
    num_prefill_tokens: int
    num_decode_seqs: int
    kv_usage: float
    prefix_hit_rate: float
    num_running: int
    num_waiting: int
    flops: float
    bytes: float
    mfu: float | None
    mbu: float | None
    num_steps: int = 1  # a burst's decode steps (`--num-scheduler-steps`), each as above


@dataclass(slots=True)
class PhaseTotals:
    steps: int = 0
    time_s: float = 0.0
    tokens: int = 0
    flops: float = 0.0
    bytes: float = 0.0


def _kv_bytes_per_value(runner, head_dim: int) -> float | None:
    """Stored bytes per KV value where the cache is not the model's dtype (int8 rows with their
    scale: (head_dim + 4) / head_dim), else None."""
    kv_dtype = getattr(runner, "kv_dtype", None)
    if kv_dtype is None or kv_dtype == runner.dtype:
        return None
    return runner.kv_row_width * kv_dtype.itemsize / head_dim


@dataclass
class StepStatsRecorder:
    model_config: object
    runner: object
    hardware_profile: str | None = None
    last: StepStats | None = None
    totals: dict[str, PhaseTotals] = field(default_factory=dict)

    def __post_init__(self) -> None:
        c = self.model_config
        self.shape = ModelShape(
            hidden_size=c.hidden_size,
            num_layers=c.num_layers,
            num_heads=c.num_heads,
            num_kv_heads=c.num_kv_heads,
            head_dim=c.head_dim,
            intermediate_size=c.intermediate_size,
            vocab_size=c.vocab_size,
            tied=c.tie_word_embeddings,
            dtype_bytes=self.runner.dtype.itemsize,
            qkv_bias=c.qkv_bias,
            qk_norm=c.qk_norm,
            matmul_bytes_per_param=getattr(self.runner, "matmul_bytes_per_param", None),
            kv_dtype_bytes=_kv_bytes_per_value(self.runner, c.head_dim),
        )
        self._peaks_threads = -1
        self._update_peaks()

    def _update_peaks(self) -> None:
        """The peaks for the engine's current CPU thread count (it may change at run time)."""
        import torch

        threads = torch.get_num_threads()
        if threads == self._peaks_threads:
            return
        self._peaks_threads = threads
        self.peak_flops = self.peak_bytes = None
        try:
            from pdserve.perf.hardware import cached_hardware_profile

            profile = cached_hardware_profile(self.hardware_profile, self.runner.device, threads)
        except (ImportError, OSError, ValueError) as e:
            logger.warning("no hardware profile (%s): MFU/MBU not reported", e)
            return
        if profile is not None:
            self.peak_flops = profile.peak_flops_for(self.runner.dtype)
            self.peak_bytes = profile.mem_bandwidth_bytes_s
            if profile.source != "measured":
                logger.info("hardware profile: %s (%s)", profile.name, profile.source)

    def record(
        self, plan: SchedulerOutput, t0: float, t1: float, sched: SchedulerStats, steps: int = 1
    ) -> StepStats:
        """The step's statistics; `steps`: the decode steps a burst ran (its plan's, unless
        the runner ran fewer)."""
        self._update_peaks()
        q_lens = [s.num_new_tokens for s in plan.scheduled]
        ctx_lens = [s.request.num_computed_tokens for s in plan.scheduled]
        num_sampled = sum(1 for s in plan.scheduled if s.sample)
        flops = num_bytes = 0.0
        for back in range(steps - 1, -1, -1):  # a burst's steps, each context one longer
            cost = step_cost(self.shape, q_lens, [c - back for c in ctx_lens], num_sampled)
            flops += cost.flops
            num_bytes += cost.weight_bytes + cost.kv_read_bytes + cost.kv_write_bytes
        dt = t1 - t0
        if plan.num_prefill_tokens and plan.num_decode_tokens:
            phase = "mixed"
        else:
            phase = "prefill" if plan.num_prefill_tokens else "decode"
        stats = StepStats(
            phase=phase,
            step_time_s=dt / steps,
            num_prefill_tokens=plan.num_prefill_tokens,
            num_decode_seqs=plan.num_decode_tokens,
            kv_usage=sched.kv_usage,
            prefix_hit_rate=sched.prefix_hits / sched.prefix_queries
            if sched.prefix_queries
            else 0.0,
            num_running=sched.num_running,
            num_waiting=sched.num_waiting,
            flops=flops / steps,
            bytes=num_bytes / steps,
            mfu=flops / dt / self.peak_flops if self.peak_flops and dt > 0 else None,
            mbu=num_bytes / dt / self.peak_bytes if self.peak_bytes and dt > 0 else None,
            num_steps=steps,
        )
        t = self.totals.setdefault(phase, PhaseTotals())
        t.steps += steps
        t.time_s += dt
        t.tokens += plan.num_tokens * steps
        t.flops += flops
        t.bytes += num_bytes
        self.last = stats
        return stats

    def phase_mfu_mbu(self, phase: str) -> tuple[float | None, float | None]:
        t = self.totals.get(phase)
        if t is None or t.time_s <= 0:
            return None, None
        mfu = t.flops / t.time_s / self.peak_flops if self.peak_flops else None
        mbu = t.bytes / t.time_s / self.peak_bytes if self.peak_bytes else None
        return mfu, mbu
