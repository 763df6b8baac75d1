"""Speed traces: a shared machine's speed over time, and the simulator's path through it."""

from __future__ import annotations

import random

import pytest

from pdserve.bench.workload import RequestSpec
from pdserve.config import EngineArgs
from pdserve.planner.profile import Anchor, Profile, TransferModel
from pdserve.planner.simulator import Simulation
from pdserve.planner.speed import (
    BLOCK_S,
    NARROW_ROWS,
    AlignedPath,
    SpeedPath,
    SpeedTrace,
    follows_speed,
)
from pdserve.planner.step_model import LinearStepModel, SplitStepModel, StepShape

ONE = LinearStepModel(0.040, 0.0010, 1e-8, 1e-7, 0.0005)
TWO = LinearStepModel(0.030, 0.0006, 1e-8, 1e-7, 0.0003)


def profile(**fields) -> Profile:
    return Profile(
        "measured", "synthetic", 36864, 12, {1: ONE, 2: TWO},
        {"shm": TransferModel(0.001, 5e9)}, **fields,
    )  # fmt: skip


def stretches(seconds: float, period: float, levels=(1.0, 1.5)) -> SpeedTrace:
    """A probe every half second, the level changing every `period` seconds."""
    n = int(seconds / 0.5)
    return SpeedTrace(tuple((0.5 * i, levels[int(0.5 * i // period) % 2]) for i in range(n)))


def test_a_trace_is_checked_and_read_as_a_step_function():
    with pytest.raises(ValueError, match="two probes"):
        SpeedTrace(((0.0, 1.0),))
    with pytest.raises(ValueError, match="time order"):
        SpeedTrace(((0.0, 1.0), (0.0, 1.2)))
    with pytest.raises(ValueError, match="positive"):
        SpeedTrace(((0.0, 1.0), (1.0, 0.0)))
    trace = SpeedTrace(((10.0, 1.0), (10.5, 1.4), (11.0, 1.1)))  # times count from the first
    assert trace.seconds == 1.0
    assert [trace.ratio_at(t) for t in (-1, 0, 0.4, 0.5, 0.9, 1.0, 5)] == [
        1.0, 1.0, 1.0, 1.4, 1.4, 1.1, 1.1,
    ]  # fmt: skip
    assert SpeedTrace.from_dict(trace.to_dict()) == trace
    assert "3 probes over 1 s" in trace.describe()


def test_a_path_is_the_trace_cut_in_blocks_seeded():
    trace = stretches(180, period=30)
    a, b, c = (SpeedPath(trace, random.Random(s)) for s in (0, 0, 1))
    times = [0.25 * i for i in range(4000)]
    assert [a.ratio(t) for t in times] == [b.ratio(t) for t in times]
    assert [a.ratio(t) for t in times] != [c.ratio(t) for t in times]
    # every block is a piece of the trace: the time in it maps to one offset
    for start, offset in zip(a.starts, a.offsets):
        assert 0 <= offset <= trace.seconds - BLOCK_S
        for dt in (0.0, 7.3, BLOCK_S - 0.01):
            assert a.ratio(start + dt) == trace.ratio_at(offset + dt)
    # asked out of order, the same answers
    assert [a.ratio(t) for t in reversed(times)] == [b.ratio(t) for t in reversed(times)]


def test_an_aligned_path_reads_the_trace_in_time_from_its_offset():
    trace = SpeedTrace(((100.0, 1.0), (101.0, 1.5), (102.0, 1.2)))  # first probe at 100 s
    path = trace.aligned(0.5)  # the run began half a second after the first probe
    assert isinstance(path, AlignedPath)
    assert [path.ratio(t) for t in (0.0, 0.4, 0.5, 1.4, 1.5, 30.0)] == [
        1.0, 1.0, 1.5, 1.5, 1.2, 1.2,
    ]  # fmt: skip
    early = trace.aligned(-3.0)  # the run began before the sensor's first probe
    assert [early.ratio(t) for t in (0.0, 2.9, 3.0, 4.0)] == [1.0, 1.0, 1.0, 1.5]


def test_a_path_keeps_the_traces_share_and_its_stretches():
    trace = stretches(600, period=20)  # half the time at each level, in 20-s stretches
    path = SpeedPath(trace, random.Random(3))
    series = [path.ratio(0.5 * i) for i in range(40_000)]  # 20,000 simulated seconds
    assert sum(r == 1.5 for r in series) / len(series) == pytest.approx(0.5, abs=0.05)
    runs = 1 + sum(x != y for x, y in zip(series, series[1:]))
    assert len(series) * 0.5 / runs > 8  # stretches of seconds, not a fresh draw per probe
    short = SpeedTrace(((0.0, 1.0), (1.0, 2.0), (2.0, 1.0)))  # blocks no longer than the trace
    assert SpeedPath(short, random.Random(0)).block_s == 2.0


def test_a_profile_keeps_its_trace_by_worker_size():
    trace = stretches(10, period=5)
    p = profile(speed={2: trace})
    back = Profile.from_dict(p.to_dict())
    assert back.speed == {2: trace}
    assert back.speed_trace(2) == back.speed_trace(3) == trace  # the nearest size's
    assert back.speed_trace(1) is None
    assert profile().speed_trace(2) is None
    assert (
        Profile.from_dict({k: v for k, v in profile().to_dict().items() if k != "speed"}).speed
        == {}
    )


def run(p: Profile, reqs, speed: bool, seed: int = 0, offset: float | None = None, **engine):
    sim = Simulation(p, EngineArgs(model="m", **engine), max_model_len=2048,
                     threads_per_worker=2, speed_trace=speed, speed_offset_s=offset,
                     seed=seed)  # fmt: skip
    return sim.run(reqs)


def test_the_steps_that_follow_the_trace_are_those_of_a_few_rows():
    split = SplitStepModel(TWO, ONE, wide_decode=ONE, wide_rows=4)
    decode = lambda n: StepShape.of([1] * n, [100] * n, n)  # noqa: E731
    assert follows_speed(decode(1), split) and follows_speed(decode(4), split)
    assert not follows_speed(decode(5), split)  # past the narrow kernel's rows
    assert follows_speed(StepShape.of([3], [900], 1), split)  # a prefix hit of three tokens
    assert not follows_speed(StepShape.of([40], [40], 1), split)
    assert not follows_speed(StepShape.of([3, 1, 1], [900, 9, 9], 3), split)  # five rows
    # a model that fits no wide batches apart: decode-only steps, any batch, and any step of at
    # most NARROW_ROWS rows (a conversation's next turn over its cached prefix)
    assert follows_speed(decode(40), TWO) and follows_speed(decode(9), SplitStepModel(TWO, ONE))
    assert follows_speed(StepShape.of([3], [900], 1), TWO)
    assert follows_speed(StepShape.of([NARROW_ROWS - 2, 1, 1], [900, 9, 9], 3), TWO)
    assert not follows_speed(StepShape.of([NARROW_ROWS + 1], [900], 1), TWO)
    assert not follows_speed(StepShape.of([256], [256], 1), TWO)


def test_decode_steps_follow_the_trace_and_prompt_steps_do_not():
    slow = SpeedTrace(((0.0, 2.0), (100.0, 2.0)))
    # far-apart requests are scheduled alike whatever the step times
    reqs = [RequestSpec(i, 5.0 * i, 300 if i % 2 else 40, 6) for i in range(6)]
    plain = run(profile(), reqs, speed=False)
    traced = run(profile(speed={2: slow}), reqs, speed=True)
    off = run(profile(speed={2: slow}), reqs, speed=False)
    assert [s.scheduled for s in plain.steps] == [s.scheduled for s in traced.steps]
    assert [s.duration_s for s in off.steps] == [s.duration_s for s in plain.steps]

    def is_decode(step) -> bool:  # every prompt here is longer than a token
        return all(n == 1 for _, n in step.scheduled)

    kinds = set()
    for p, t in zip(plain.steps, traced.steps):
        kinds.add(decode := is_decode(p))
        assert t.duration_s == pytest.approx(p.duration_s * (2.0 if decode else 1.0))
    assert kinds == {True, False}
    # an anchored profile: the trace, taken against the fitted model, stands for the decode
    # anchor on the steps that follow it; the others keep the anchor's scale
    anchored = profile(speed={2: slow}).anchored({2: Anchor(1.5, 1.2)})
    both = run(anchored, reqs, speed=True)
    for p, t in zip(plain.steps, both.steps):
        assert t.duration_s == pytest.approx(p.duration_s * (2.0 if is_decode(p) else 1.2))


def test_a_traced_simulation_is_the_same_for_a_seed():
    p = profile(speed={2: stretches(120, period=10, levels=(1.0, 3.0))})
    busy = [RequestSpec(i, 0.4 * i, 200, 30) for i in range(30)]
    a, b, other = run(p, busy, True), run(p, busy, True), run(p, busy, True, seed=1)
    assert [r.to_dict() for r in a.records] == [r.to_dict() for r in b.records]
    assert [r.to_dict() for r in a.records] != [r.to_dict() for r in other.records]


def test_a_trace_probed_beside_a_run_is_followed_in_time_not_cut_at_random():
    # slow for the first 20 s of the trace, fast after: the run starts 5 s into it, so its
    # decode steps before 15 s are slow and those after are not, for any seed
    trace = SpeedTrace(((0.0, 2.0), (19.99, 2.0), (20.0, 1.0), (200.0, 1.0)))
    p = profile(speed={2: trace})
    reqs = [RequestSpec(i, 5.0 * i, 40, 6) for i in range(6)]
    plain = run(profile(), reqs, speed=False)
    for seed in (0, 1, 2):
        aligned = run(p, reqs, speed=True, seed=seed, offset=5.0)
        assert [s.scheduled for s in plain.steps] == [s.scheduled for s in aligned.steps]
        for s0, s1 in zip(plain.steps, aligned.steps):
            decode = all(n == 1 for _, n in s0.scheduled)
            slow = decode and s1.start_s < 15.0
            assert s1.duration_s == pytest.approx(s0.duration_s * (2.0 if slow else 1.0))
    assert run(p, reqs, True, offset=5.0).steps != run(p, reqs, True, offset=25.0).steps
