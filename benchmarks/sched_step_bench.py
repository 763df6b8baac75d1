"""The scheduler's own cost per step (schedule + update, no model), for a checkout.

    python benchmarks/sched_step_bench.py [CHECKOUT]      # default: this one; a few seconds

64 requests decoding (300-token prompts), 500 steps, best of 5: the time the scheduler adds to
every engine step. Run it on two checkouts alternately (`git worktree add /tmp/old REV`) to see
what a change to sched/ or kv/ costs.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, sys.argv[1] if len(sys.argv) > 1 else str(Path(__file__).resolve().parents[1]))

from pdserve.config import EngineArgs  # noqa: E402
from pdserve.kv.manager import KVCacheManager  # noqa: E402
from pdserve.request import Request  # noqa: E402
from pdserve.sched.scheduler import Scheduler  # noqa: E402
from pdserve.types import SamplingParams  # noqa: E402

NUM_SEQS, PROMPT, STEPS, REPEATS = 64, 300, 500, 5


def once() -> float:
    sched = Scheduler(EngineArgs(model="m").scheduler_config(4096), KVCacheManager(4096, 16))
    params = SamplingParams(max_tokens=4000, ignore_eos=True)
    for i in range(NUM_SEQS):
        prompt = list(range(i * 1000, i * 1000 + PROMPT))
        sched.add_request(Request(f"r{i}", prompt, params, 4000))
    plan = sched.schedule()  # the prefills
    sched.update(plan, [5] * sum(s.sample for s in plan.scheduled))
    t0 = time.perf_counter()
    for _ in range(STEPS):
        plan = sched.schedule()
        sched.update(plan, [5] * len(plan.scheduled))
    return (time.perf_counter() - t0) / STEPS


if __name__ == "__main__":
    import pdserve

    best = min(once() for _ in range(REPEATS))
    print(
        f"{Path(pdserve.__file__).parent}: schedule + update, {NUM_SEQS} decodes: {best * 1e6:.0f} us"
    )
