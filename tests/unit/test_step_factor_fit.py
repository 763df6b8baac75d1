"""The step factors fitted under load: the simulator replays a measured run and finds the
factors that reproduce it (no torch)."""

from __future__ import annotations

import dataclasses
import random

import pytest

from pdserve.bench.metrics import COMPLETED, RequestRecord
from pdserve.bench.workload import RequestSpec
from pdserve.config import EngineArgs
from pdserve.planner.calibrate import fit_step_factors, replayed_specs, targets
from pdserve.planner.profile import Profile, ServingCosts, TransferModel
from pdserve.planner.simulator import Simulation
from pdserve.planner.step_model import LinearStepModel

TWO = LinearStepModel(0.030, 0.0006, 1e-8, 1e-7, 0.0003)
COSTS = ServingCosts(2, 0.0003, 0.0002, 0.015)
PROFILE = Profile(
    "measured", "synthetic", 36864, 12, {2: TWO}, {"shm": TransferModel(0.001, 5e9)}, [], COSTS
)
ENGINE = EngineArgs(model="m", max_num_batched_tokens=256)


def served_run(decode: float, prefill: float) -> list[RequestRecord]:
    """What a server whose steps take these factors would have measured: the simulator stands
    in for it, with a steady load of overlapping requests (Poisson arrivals, 2 a second)."""
    costs = dataclasses.replace(COSTS, decode_step_factor=decode, prefill_step_factor=prefill)
    truth = dataclasses.replace(PROFILE, serving=costs)
    rng, t, specs = random.Random(0), 0.0, []
    for i in range(96):
        t += rng.expovariate(2.0)
        specs.append(RequestSpec(i, t, 200 + rng.randrange(120), rng.randrange(32, 96)))
    sim = Simulation(truth, ENGINE, max_model_len=2048, threads_per_worker=2, local_client=True)
    return sim.run(specs).records


def fit(records, costs=COSTS):
    profile = dataclasses.replace(PROFILE, serving=costs)
    return fit_step_factors(profile, ENGINE, records, max_model_len=2048, threads_per_worker=2)


@pytest.mark.parametrize("decode, prefill", [(1.3, 0.8), (0.8, 1.3), (2.0, 1.5)])
def test_the_fit_finds_the_factors_a_run_was_made_with(decode, prefill):
    records = served_run(decode, prefill)
    got = fit(records)
    assert got.converged and got.simulations > 1  # it started from 1.0 and moved
    assert got.decode_step_factor == pytest.approx(decode, rel=0.03)
    assert got.prefill_step_factor == pytest.approx(prefill, rel=0.03)
    assert got.simulated == pytest.approx(got.measured, rel=0.01)
    # where the profile is already right, the first simulation says so
    right = dataclasses.replace(COSTS, decode_step_factor=decode, prefill_step_factor=prefill)
    again = fit(records, right)
    assert again.simulations == 1 and again.converged
    assert (again.decode_step_factor, again.prefill_step_factor) == (decode, prefill)


def test_the_replay_keeps_send_times_and_lengths_of_completed_requests_only():
    records = served_run(decode=1.0, prefill=1.0)
    records[3] = dataclasses.replace(records[3], status="failed")
    specs = replayed_specs(records)
    assert [s.index for s in specs] == [r.index for r in records if r.index != 3]
    for s in specs:
        r = records[s.index]
        assert (s.send_at_s, s.input_len) == (r.t_arrive, r.prompt_tokens)
        assert s.output_len == r.completion_tokens == len(r.token_times) >= 32


def test_nothing_to_fit_is_an_error():
    failed = [dataclasses.replace(r, status="failed") for r in served_run(1.0, 1.0)]
    with pytest.raises(ValueError, match="no completed request"):
        targets(failed)
    with pytest.raises(ValueError, match="no completed request"):
        fit(failed)
    with pytest.raises(ValueError, match="no serving costs"):
        fit_step_factors(dataclasses.replace(PROFILE, serving=None), ENGINE, [], max_model_len=64)
    assert all(r.status == COMPLETED for r in served_run(1.0, 1.0))
