"""The served steps' factors under load: fit the simulator to a measured run of its own profile.

A served step takes longer than the profile's in-process step of the same shape: the worker's
loop between steps, and the frontend's and the client's processes taking one of its cores. How
much longer depends on the load: a decode of a batch shares the machine differently from a
decode of one sequence. `pdserve profile` measures a concurrent synthetic load through a real
server (`perf/serving_costs.py`); `fit_step_factors` replays the same requests (their send
times and lengths) in the simulator and moves its two factors, decode-only steps and steps with
prompt tokens, until the simulated run's mean TTFT and median gap between tokens are the
measured ones. The
factors then carry to any load the simulator is asked about: they are fitted on the profile's
own load, never on the load to be predicted.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from dataclasses import dataclass

from pdserve.bench.metrics import COMPLETED, RequestRecord
from pdserve.bench.workload import RequestSpec
from pdserve.config import DisaggConfig, EngineArgs
from pdserve.planner.profile import Profile

SWEEPS = 4  # rounds of fitting the prefill factor, then the decode factor
SOLVE_STEPS = 10  # simulations per one-factor solve, at most
TOLERANCE = 0.01  # each mean within 1% of the measured one
FACTOR_RANGE = (0.3, 3.0)  # a fit outside it says the profile is not this server's


@dataclass(frozen=True)
class Fit:
    decode_step_factor: float
    prefill_step_factor: float
    measured: tuple[float, float]  # mean TTFT, median inter-token gap (s)
    simulated: tuple[float, float]  # the same, simulated with the factors
    simulations: int  # runs of the simulator the fit took

    @property
    def converged(self) -> bool:
        return all(abs(math.log(s / m)) <= TOLERANCE for s, m in zip(self.simulated, self.measured))


def replayed_specs(records: list[RequestRecord]) -> list[RequestSpec]:
    """The completed requests as the simulator takes them: sent when they were sent, with the
    prompt length the server counted and the tokens it produced."""
    return [
        RequestSpec(r.index, r.t_arrive, r.num_input_tokens, r.num_output_tokens)
        for r in records
        if r.status == COMPLETED and r.t_arrive is not None and r.num_output_tokens >= 2
    ]


def targets(records: list[RequestRecord]) -> tuple[float, float]:
    """What the fit matches (seconds): the mean TTFT of the completed requests, which their
    prompt steps decide, and the median gap between two tokens of one request, which under a
    steady load is a decode-only step (most steps have no prompt in them). A mean, not a median,
    for TTFT: the median of a few dozen requests jumps as a factor moves a step's end past an
    arrival; TPOT is no target: a decode waits for the prompt steps between its own as much as
    for its own steps."""
    done = [r for r in records if r.status == COMPLETED and r.ttft is not None and r.itl]
    if not done:
        raise ValueError("no completed request with a TTFT and two tokens to fit the factors to")
    gaps = [g for r in done for g in r.itl]
    return statistics.fmean(r.ttft for r in done), statistics.median(gaps)


def fit_step_factors(
    profile: Profile,
    engine: EngineArgs,
    records: list[RequestRecord],
    *,
    max_model_len: int,
    disagg: DisaggConfig | None = None,
    threads_per_worker: int = 1,
) -> Fit:
    """Factors for `profile.serving` (which must hold the measured CPU per token and frontend
    latency) under which the simulation of `records` (a measured run of `engine` with a client
    on the same machine, its workers `threads_per_worker` threads each where they have no CPU
    set) has their `targets`: each sweep solves the prefill factor on the mean
    TTFT, then the decode factor on the median gap between tokens, from the profile's factors
    on (TTFT moves a little with the decode steps a prompt waits behind: hence the sweeps)."""
    if profile.serving is None:
        raise ValueError("the profile has no serving costs to fit the step factors of")
    replay = _Replay(profile, engine, disagg, max_model_len, threads_per_worker, records)
    factors = [profile.serving.decode_step_factor, profile.serving.prefill_step_factor]
    replay.run(factors)
    for _ in range(SWEEPS):
        if replay.close():
            break
        for factor, target in ((1, 0), (0, 1)):  # prefill factor on TTFT, decode on the gaps
            _solve(factors, factor, lambda target=target: replay.error(factors, target))
    return Fit(factors[0], factors[1], replay.measured, replay.last, replay.runs)


class _Replay:
    """The measured requests, simulated again under given step factors."""

    def __init__(self, profile, engine, disagg, max_model_len, threads, records) -> None:
        self.profile, self.engine, self.disagg = profile, engine, disagg
        self.max_model_len, self.threads = max_model_len, threads
        self.specs = replayed_specs(records)
        self.measured = targets(records)
        self.last = self.measured
        self.runs = 0

    def run(self, factors: list[float]) -> tuple[float, float]:
        from pdserve.planner.simulator import Simulation

        serving = dataclasses.replace(
            self.profile.serving, decode_step_factor=factors[0], prefill_step_factor=factors[1]
        )
        trial = dataclasses.replace(self.profile, serving=serving)
        sim = Simulation(
            trial,
            self.engine,
            self.disagg,
            max_model_len=self.max_model_len,
            threads_per_worker=self.threads,
            local_client=True,
        )
        self.last, self.runs = targets(sim.run(self.specs).records), self.runs + 1
        return self.last

    def error(self, factors: list[float], which: int) -> float:
        """log(simulated / measured) of target `which` (0: TTFT, 1: the gaps) under `factors`."""
        return math.log(self.run(factors)[which] / self.measured[which])

    def close(self) -> bool:
        return all(abs(math.log(s / m)) <= TOLERANCE for s, m in zip(self.last, self.measured))


def _solve(factors: list[float], i: int, error) -> None:
    """Move `factors[i]` until `error()` (the log of simulated over measured, rising with the
    factor) is within the tolerance: secant steps in the factor's logarithm, kept inside the
    bracket found so far (halving it when a step would leave it)."""
    lo, hi = (math.log(v) for v in FACTOR_RANGE)
    x, err = math.log(factors[i]), error()
    prev = None
    for _ in range(SOLVE_STEPS):
        if abs(err) <= TOLERANCE:
            return
        if err < 0:
            lo = x
        else:
            hi = x
        if prev is not None and prev[1] != err:
            nxt = x - err * (x - prev[0]) / (err - prev[1])
        else:
            nxt = x - err  # a slope of one to start
        if not lo < nxt < hi:
            nxt = (lo + hi) / 2
        prev = (x, err)
        x = nxt
        factors[i] = math.exp(x)
        err = error()
