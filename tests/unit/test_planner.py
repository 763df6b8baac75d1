"""The planner picks the known best deployment on constructed cases (no torch)."""

from __future__ import annotations

import pytest

from pdserve.bench.metrics import Slo
from pdserve.bench.workload import RequestSpec
from pdserve.planner.plan import Candidate, candidates, goodput, rank, scaled
from pdserve.planner.profile import Profile, TransferModel
from pdserve.planner.step_model import LinearStepModel

SLO = Slo.parse("ttft_ms=1500,tpot_ms=100")


def profile(one: LinearStepModel, two: LinearStepModel) -> Profile:
    return Profile("measured", "constructed", 36864, 12, {1: one, 2: two},
                   {"shm": TransferModel(0.0005, 5e9)})  # fmt: skip


def load(n=60, rate=1.0, input_len=300, output_len=40):
    return [RequestSpec(i, i / rate, input_len, output_len) for i in range(n)]


def best(prof: Profile, requests, slo: Slo) -> Candidate:
    cands = candidates("m", 2, chunk_sizes=(256,))
    return rank(prof, requests, slo, cands, max_model_len=2048)[0].candidate


def test_prompts_on_threads_that_add_nothing_favour_two_colocated_workers():
    """Long prompts, short answers, and a second thread that does not speed a step up: two
    colocated workers prefill on both cores, where one worker uses one core's worth and a P:D
    split leaves all prefill to one core."""
    step = LinearStepModel(0.02, 0.0004, 0.0, 1e-7, 0.0)
    requests = load(input_len=1000, output_len=4)
    slo = Slo.parse("ttft_ms=3000,tpot_ms=200")
    assert best(profile(step, step), requests, slo).name.startswith("2 colocated")


def test_a_tight_tpot_that_only_two_threads_meet_favours_one_worker_on_both():
    """A step takes half the time on two threads: only a worker on both cores decodes within a
    50 ms TPOT (one thread takes over 60 ms a step, whatever the split)."""
    one = LinearStepModel(0.06, 0.0008, 0.0, 1e-7, 0.0)
    two = LinearStepModel(0.03, 0.0004, 0.0, 1e-7, 0.0)
    slo = Slo.parse("ttft_ms=3000,tpot_ms=50")
    assert best(profile(one, two), load(), slo).name.startswith("1 colocated x 2 cores")


def test_goodput_is_the_largest_rate_within_the_target():
    """A synthetic run that meets the SLO below a known scale and misses it above."""
    from pdserve.bench.metrics import COMPLETED, RequestRecord

    def run(scale: float):
        ttft = 0.1 if scale <= 2.5 else 5.0
        return [
            RequestRecord(i, 10, 5, 10, 0.0, t_arrive=0.0, t_first=ttft, t_end=ttft + 0.2,
                          token_times=[ttft + 0.05 * k for k in range(5)], status=COMPLETED)
            for i in range(10)
        ]  # fmt: skip

    scale, summary = goodput(run, SLO, 0.9)
    assert scale == pytest.approx(2.5, rel=0.05) and scale <= 2.5
    assert summary["slo_attainment"] == 1.0


def test_scaled_requests_arrive_faster():
    reqs = load(n=3, rate=1.0)
    assert [r.send_at_s for r in scaled(reqs, 2.0)] == [0.0, 0.5, 1.0]


def test_the_serve_flags_of_a_candidate_make_that_deployment():
    from pdserve.cli import parse_args
    from pdserve.commands.flags import from_args
    from pdserve.commands.serve import disagg_config_from
    from pdserve.config import EngineArgs

    for c in candidates("m", 2, chunk_sizes=(256, 2048), max_num_seqs=(32,)):
        _, args = parse_args(["serve", "--model", "m", *c.serve_flags()])
        assert from_args(EngineArgs, args) == c.engine, c.name
        d = disagg_config_from(args)
        assert (d.num_prefill_workers, d.num_decode_workers) == (
            c.disagg.num_prefill_workers,
            c.disagg.num_decode_workers,
        ), c.name
