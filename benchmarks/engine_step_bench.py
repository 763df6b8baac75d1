"""The runner's own cost per decode step (inputs, sampling, the whole execute), for a checkout.

    python benchmarks/engine_step_bench.py [CHECKOUT]      # default: this one; ~15 s

stories260K (a model so small that a step is Python and small ops), 32 requests decoding: the
minimum over many repeats of `ModelRunner.prepare` (the step's inputs), the sampler (greedy
rows) and `ModelRunner.execute` (inputs, forward, logits, sampling) for one decode plan. Minima,
not means: on a shared machine the wall time of whole runs moves by 30% from minute to minute,
the minimum of a short call far less. Run it on two checkouts alternately
(`git worktree add /tmp/old REV`) to see what a change to the per-step path costs.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, sys.argv[1] if len(sys.argv) > 1 else str(HERE.parent))
sys.path.insert(1, str(HERE))

from lib.paths import STORIES  # noqa: E402

from pdserve import LLM, SamplingParams  # noqa: E402

NUM_SEQS = 32


def best_us(fn, n: int) -> float:
    best = float("inf")
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e6


def main() -> int:
    import pdserve

    llm = LLM(str(STORIES), num_threads=2, enable_prefix_caching=False)
    core, runner = llm.engine.core, llm.engine.core.runner
    params = SamplingParams(temperature=0, max_tokens=300, ignore_eos=True)
    for i in range(NUM_SEQS):
        prompt = [1, 400 + i, 300, 200, 100 + i] * 20
        core.add_request(core.make_request(f"r{i}", prompt, params))
    for _ in range(5):  # prefill, then decoding
        core.step()
    plan, tables = core.scheduler.schedule(), core.kv.req_block_ids
    inputs = runner.prepare(plan, tables)
    hidden = runner.model(inputs.input_ids, inputs.positions, runner.kv_caches, inputs.meta)
    logits = runner.model.compute_logits(hidden[inputs.logits_indices])
    print(f"checkout {Path(pdserve.__file__).parents[1]}, {len(plan.scheduled)} decodes: "
          f"prepare {best_us(lambda: runner.prepare(plan, tables), 300):.1f} us, "
          f"sampler {best_us(lambda: runner.sampler(logits, inputs.rows), 300):.1f} us, "
          f"execute {best_us(lambda: runner.execute(plan, tables), 100):.1f} us")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
