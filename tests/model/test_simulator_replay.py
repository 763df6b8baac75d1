"""The simulator makes the real engine's scheduling decisions: a recorded run of the engine on
the real tiny model (arrivals between steps, chunked prefill, a KV cache small enough to
preempt) is replayed in the simulator with the recorded step times, and every step schedules
the same requests for the same numbers of tokens."""

from __future__ import annotations

import random
import time

import pytest

from pdserve.bench.workload import RequestSpec
from pdserve.config import EngineArgs
from pdserve.engine.core import EngineCore
from pdserve.planner.profile import Profile
from pdserve.planner.simulator import Simulation
from pdserve.planner.step_model import LinearStepModel
from pdserve.types import SamplingParams

# step index -> requests added before that step: (prompt tokens, output tokens)
SCRIPT = {
    0: [(100, 20), (30, 40)],
    2: [(200, 12)],
    5: [(50, 30), (60, 6), (90, 25)],
    9: [(150, 25)],
    14: [(40, 50)],
}


def record_engine_run(stories_path: str, args: EngineArgs):
    core = EngineCore(args)
    rng = random.Random(0)
    vocab = core.model_config.vocab_size
    plans, durations, specs = [], [], []
    schedule = core.scheduler.schedule

    def recording():
        plan = schedule()
        if not plan.is_empty:
            plans.append(
                ([(i.request.request_id, i.num_new_tokens) for i in plan.scheduled], plan.num_steps)
            )
        return plan

    core.scheduler.schedule = recording
    step = 0
    while step <= max(SCRIPT) or core.scheduler.has_unfinished:
        for prompt_len, max_tokens in SCRIPT.get(step, []):
            index = len(specs)
            prompt = [rng.randrange(3, vocab) for _ in range(prompt_len)]
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
            core.add_request(core.make_request(f"r{index}", prompt, params))
            specs.append((index, step, prompt_len, max_tokens))
        before = len(plans)
        t0 = time.perf_counter()
        core.step()
        elapsed = time.perf_counter() - t0
        assert len(plans) == before + 1, "the script keeps the engine busy at every step"
        durations.append(elapsed)
        step += 1
    return core, plans, durations, specs


@pytest.mark.parametrize("steps", [1, 4])
def test_the_simulator_replays_the_engines_decisions(stories_path, steps):
    """`steps` 4: bursts of decode steps between the arrivals, planned alike."""
    args = EngineArgs(
        model=stories_path,
        num_kv_blocks=22,  # 352 token slots: the script's peak needs more, so some preempt
        max_num_batched_tokens=64,  # prompts go in chunks, mixed with decodes
        max_num_seqs=4,
        num_threads=1,
        num_scheduler_steps=steps,
    )
    core, plans, durations, specs = record_engine_run(stories_path, args)
    assert core.scheduler.num_preemptions > 0  # the scenario exercises preemption
    assert any(n > 1 for _, n in plans) == (steps > 1)
    starts = [0.0]
    for d in durations:
        starts.append(starts[-1] + d)
    requests = [
        RequestSpec(index, max(starts[step] - 1e-9, 0.0), prompt_len, max_tokens)
        for index, step, prompt_len, max_tokens in specs
    ]
    replay = iter(durations)
    profile = Profile("measured", "replay", 1, 1, {1: LinearStepModel(1, 0, 0, 0, 0)})
    sim = Simulation(
        profile,
        args,
        max_model_len=core.max_model_len,
        step_time=lambda worker, shape: next(replay),
    )
    result = sim.run(requests)
    assert [(s.scheduled, s.num_steps) for s in result.steps] == plans
    assert sim.workers[0].scheduler.num_preemptions == core.scheduler.num_preemptions
    assert all(r.completion_tokens == spec[3] for r, spec in zip(result.records, specs))
