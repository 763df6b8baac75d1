"""Where an engine step's time goes, timed apart from the forward by wrapping the pieces of
`EngineCore.step`; section 5 of engine_bench.py (scheduler and input-preparation time per step)."""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from typing import Any

from lib.engine_common import BenchConfig, random_prompts, start_decoding
from lib.quiet import Quiet
from pdserve import LLM
from pdserve.perf.cost import ModelShape


class StepTimer:
    """Times the pieces of one LLM's steps by wrapping them (well under a microsecond each):
    `LLMEngine.step` > `EngineCore.step` > schedule, execute (> prepare, forward, logits,
    sample), update, stats. `detach` puts the originals back."""

    def __init__(self, llm: LLM) -> None:
        engine = llm.engine
        core = engine.core
        runner = core.runner
        wrapped = [
            (engine, "step", "engine_step"),
            (core, "step", "core_step"),
            (core.scheduler, "schedule", "schedule"),
            (runner, "execute", "execute"),
            (runner, "prepare", "prepare"),
            (runner.model, "compute_logits", "logits"),
            (runner, "sampler", "sample"),  # an attribute of the runner, not a method
            (core.scheduler, "update", "update"),
            (core.stats, "record", "stats"),
        ]
        self.samples: dict[str, list[float]] = {name: [] for _, _, name in wrapped}
        # Attributes the object holds itself are put back on detach; methods are shadowed by
        # an instance attribute, deleted on detach.
        self._saved = [(obj, attr, vars(obj).get(attr)) for obj, attr, _ in wrapped]
        for obj, attr, name in wrapped:
            setattr(obj, attr, _timed(getattr(obj, attr), self.samples[name]))

    def detach(self) -> None:
        for obj, attr, original in self._saved:
            if original is not None:
                setattr(obj, attr, original)
            else:
                delattr(obj, attr)

    @property
    def num_steps(self) -> int:
        return len(self.samples["core_step"])

    def forward_s(self) -> list[float]:
        """Per step: execute minus prepare, logits and sampling."""
        s = self.samples
        return [
            e - p - lg - sm
            for e, p, lg, sm in zip(s["execute"], s["prepare"], s["logits"], s["sample"])
        ]

    def totals_s(self, wall_s: float) -> dict[str, float]:
        """Where a run's wall time went, in disjoint parts that add up to `wall_s`."""
        s = {name: sum(v) for name, v in self.samples.items()}
        return {
            "forward": sum(self.forward_s()),
            "logits": s["logits"],
            "sample": s["sample"],
            "prepare": s["prepare"],
            "schedule": s["schedule"],
            "update": s["update"],
            "stats": s["stats"],
            "core_other": s["core_step"] - s["execute"] - s["schedule"] - s["update"] - s["stats"],
            "llm_engine": s["engine_step"] - s["core_step"],  # detokenize, build outputs
            "llm_generate": wall_s - s["engine_step"],  # add requests, the loop
        }

    def median_us(self) -> dict[str, float]:
        us = {name: statistics.median(v) * 1e6 for name, v in self.samples.items() if v}
        us["forward"] = statistics.median(self.forward_s()) * 1e6
        return us


def _timed(fn: Callable[..., Any], sink: list[float]) -> Callable[..., Any]:
    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            sink.append(time.perf_counter() - t0)

    return timed


def run_overhead(cfg: BenchConfig, llm: LLM, shape: ModelShape) -> dict[str, float]:
    """Median microseconds per step of each piece, `overhead_num_seqs` sequences decoding.
    Steps the EngineCore directly (no detokenizer)."""
    core = llm.engine.core
    rng = random.Random(cfg.seed + 3)
    warm_steps = 3
    max_tokens = warm_steps + cfg.overhead_steps + 2
    n = cfg.overhead_num_seqs
    prompts = random_prompts(rng, [cfg.decode_prompt_len] * n, shape.vocab_size)
    start_decoding(core, prompts, max_tokens, "overhead-", warm_steps)
    timer = StepTimer(llm)
    try:
        for _ in range(cfg.overhead_steps):
            if len(core.scheduler.running) != n:
                raise RuntimeError(f"{len(core.scheduler.running)} sequences running, {n} expected")
            core.step()
    finally:
        timer.detach()
        core.abort_requests(list(core.scheduler.requests))
    return timer.median_us()


def bench_overhead(cfg: BenchConfig, quiet: Quiet, llm: LLM, shape: ModelShape) -> dict[str, Any]:
    m = quiet.run("overhead", lambda: run_overhead(cfg, llm, shape))
    us = m.value
    host = us["schedule"] + us["prepare"] + us["update"]
    return {
        "num_seqs": cfg.overhead_num_seqs,
        "steps": cfg.overhead_steps,
        "median_us": us,
        "schedule_prepare_update_us": host,
        "host_fraction_of_step": host / us["core_step"],
        "foreign_cores": m.foreign_cores,
    }
