"""How a shared machine's speed moves over time, and a simulated run's way through it (no torch).

A virtual machine's memory bandwidth is the host's to give. On a 2-core Zen 4 VM, compute held
at about 180-200 GFLOP/s while the bandwidth two threads could read moved between about 31-35
and 54-55 GB/s, in stretches of seconds to minutes, and two-thread decode steps of llama-125m
moved with it (15.5-20 and 10.5-13 ms; `benchmarks/speed_levels_bench.py`); one thread never
reads fast enough to notice. A step model fitted in one stretch is off by up to 1.5x in another,
and a constant anchor puts every simulated request at the mix's mean, where a served run has
most of its requests in one level or the other.

A `SpeedTrace` is what `pdserve profile --speed-trace SECONDS` measures on the idle machine: every
half second, a few decode steps of one sequence per worker size, each probe their median time
over the fitted model's (`perf.step_profile.measure_speed`). A `SpeedPath` is one simulated
run's way through it: blocks of `BLOCK_S` seconds cut from the trace at random offsets (seeded)
and laid end to end, so a run meets the stretches, their lengths and the share of time in each
as the machine showed them (a block bootstrap), without a model of the host's behaviour. An
`AlignedPath` reads a trace in time instead: one probed beside a measured run (the run's 0 at a
known point of it), for checking the step model against a run with the machine's speed over it
known, apart from what a profile taken before the run can know. The simulator multiplies the
steps that move with the memory bandwidth (`follows_speed`: those whose matrix products have a
few rows, as the probes' do) by the path's ratio at the step's start.
"""

from __future__ import annotations

import bisect
import random
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

from pdserve.planner.step_model import StepModel, StepShape

BLOCK_S = 30.0  # a path's blocks: long enough to keep the stretches a trace shows
NARROW_ROWS = 16  # a step of this many rows reads the weights as a decode step does


@dataclass(frozen=True)
class SpeedTrace:
    """Decode-bound probes in time order: (seconds from the first, measured / fitted time)."""

    points: tuple[tuple[float, float], ...]

    def __post_init__(self) -> None:
        if len(self.points) < 2:
            raise ValueError("a speed trace needs at least two probes")
        if any(b[0] <= a[0] for a, b in zip(self.points, self.points[1:])):
            raise ValueError("a speed trace's probes must be in time order")
        if any(r <= 0 for _, r in self.points):
            raise ValueError("a speed trace's ratios must be positive")

    @property
    def seconds(self) -> float:
        return self.points[-1][0] - self.points[0][0]

    @cached_property
    def _times(self) -> list[float]:
        return [p[0] - self.points[0][0] for p in self.points]

    def ratio_at(self, t: float) -> float:
        """The ratio of the last probe at or before `t` seconds into the trace."""
        return self.points[max(0, bisect.bisect_right(self._times, t) - 1)][1]

    def path(self, rng: random.Random) -> SpeedPath:
        return SpeedPath(self, rng)

    def aligned(self, offset_s: float) -> AlignedPath:
        return AlignedPath(self, offset_s)

    def describe(self) -> str:
        ratios = sorted(r for _, r in self.points)
        q = lambda p: ratios[int(p * (len(ratios) - 1))]  # noqa: E731
        median = q(0.5)
        apart = sum(abs(r / median - 1) > 0.15 for r in ratios) / len(ratios)
        return (
            f"{len(ratios)} probes over {self.seconds:.0f} s at x{q(0.1):.2f} / x{median:.2f} / "
            f"x{q(0.9):.2f} the fitted time (p10 / p50 / p90), {apart:.0%} of them more than 15% "
            "from the median"
        )

    def to_dict(self) -> list:
        return [list(p) for p in self.points]

    @classmethod
    def from_dict(cls, d: Sequence) -> SpeedTrace:
        return cls(tuple((float(t), float(r)) for t, r in d))


class SpeedPath:
    """One simulated run's ratio over its clock: blocks of `BLOCK_S` (the trace's length where
    shorter) from random offsets of the trace, end to end. `ratio(t)` for any t >= 0."""

    def __init__(self, trace: SpeedTrace, rng: random.Random, block_s: float = BLOCK_S) -> None:
        self.trace, self.rng = trace, rng
        self.block_s = min(block_s, trace.seconds)
        self.starts: list[float] = []  # each block's start on the simulated clock
        self.offsets: list[float] = []  # where in the trace it was cut

    def ratio(self, t: float) -> float:
        while not self.starts or self.starts[-1] + self.block_s <= t:
            self.starts.append(len(self.starts) * self.block_s)
            self.offsets.append(self.rng.uniform(0.0, self.trace.seconds - self.block_s))
        i = bisect.bisect_right(self.starts, t) - 1
        return self.trace.ratio_at(self.offsets[i] + t - self.starts[i])


class AlignedPath:
    """A run's ratio over its clock read straight from a trace probed beside it: `ratio(t)` is
    the trace's at `offset_s + t` seconds from its first probe (the first probe's before it, the
    last one's after it)."""

    def __init__(self, trace: SpeedTrace, offset_s: float) -> None:
        self.trace, self.offset_s = trace, offset_s

    def ratio(self, t: float) -> float:
        return self.trace.ratio_at(self.offset_s + t)


def follows_speed(shape: StepShape, model: StepModel) -> bool:
    """Whether a step moves with the machine's memory bandwidth as the trace's probes do: one
    whose matrix products have at most the few rows of `model`'s narrow decode kernel (a split
    model's `wide_rows`: one pass over the weights for all of them, bound by the bandwidth),
    decode or not; where the model fits no wide batches apart, a decode-only step or one of at
    most `NARROW_ROWS` rows. Past the kernel's tile the products do more arithmetic per byte
    read: on a 2-core Zen 4, decode batches of 1 and 4 ran at x1.18-1.56 their fit in the slow
    stretches and x0.8-1.0 in the fast ones, batches of 8 at x0.87-1.11 in both (one probe of 18
    at x1.30). Prompt steps of 2-16 tokens over a cached prefix (a conversation's next turn),
    served on both cores, ran at x0.98 and x1.21 of the two-thread fit at the median in two runs
    where the decode steps right after them ran at x0.93 and x1.22."""
    wide_rows = getattr(model, "wide_rows", 0) if getattr(model, "wide_decode", None) else 0
    if wide_rows:
        return sum(shape.q_lens) <= wide_rows
    return shape.is_decode or sum(shape.q_lens) <= NARROW_ROWS
