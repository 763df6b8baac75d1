"""The simulator drives the real scheduler: deterministic, every block returned, handoffs and
the P:D controller work on simulated time; step models fit and predict (no torch)."""

from __future__ import annotations

import dataclasses
import random
import subprocess
import sys

import pytest

from pdserve.bench.metrics import COMPLETED, Slo, summarize
from pdserve.bench.workload import RequestSpec
from pdserve.config import DisaggConfig, EngineArgs
from pdserve.perf.cost import ModelShape
from pdserve.planner.profile import Profile, ServingCosts, TransferModel, WakeCost
from pdserve.planner.simulator import Simulation, prompt_ids
from pdserve.planner.step_model import (
    AnalyticStepModel,
    LinearStepModel,
    SplitStepModel,
    StepNoise,
    StepShape,
    noise_kind,
    step_model_from_dict,
)

ONE = LinearStepModel(0.040, 0.0010, 1e-8, 1e-7, 0.0005)  # one thread
TWO = LinearStepModel(0.030, 0.0006, 1e-8, 1e-7, 0.0003)  # two threads
PROFILE = Profile(
    "measured", "synthetic", 36864, 12, {1: ONE, 2: TWO}, {"shm": TransferModel(0.001, 5e9)}
)


def requests(n=40, gap=1.0, input_len=400, output_len=48):
    return [RequestSpec(i, i * gap, input_len + 7 * (i % 5), output_len) for i in range(n)]


def simulate(disagg=None, threads=1, **engine):
    args = EngineArgs(model="m", **engine)
    sim = Simulation(PROFILE, args, disagg, max_model_len=2048, threads_per_worker=threads)
    return sim, sim.run(requests())


def test_the_planner_is_torch_free():
    modules = "pdserve.planner.simulator, pdserve.planner.plan, pdserve.perf.datasheets"
    commands = "pdserve.commands.simulate, pdserve.commands.plan"
    code = f"import sys, {modules}, {commands}; sys.exit(int('torch' in sys.modules))"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_a_colocated_run_completes_every_request_and_returns_every_block():
    sim, res = simulate(threads=2, max_num_batched_tokens=256)
    assert len(res.records) == 40 and all(r.status == COMPLETED for r in res.records)
    for r, spec in zip(res.records, requests()):
        assert r.completion_tokens == spec.output_len == len(r.token_times)
        assert r.t_arrive == spec.send_at_s and r.t_first > r.t_arrive
    for w in sim.workers:
        assert not w.scheduler.has_unfinished
        w.scheduler.kv.pool.check_whole()
    # a 400-token prompt in 256-token chunks: two steps before its first token
    first = res.records[0]
    chunk = TWO.predict(StepShape.of([256], [256], 0))
    assert first.ttft >= chunk


def test_same_inputs_same_result():
    _, a = simulate(threads=2, max_num_batched_tokens=256)
    _, b = simulate(threads=2, max_num_batched_tokens=256)
    assert [r.to_dict() for r in a.records] == [r.to_dict() for r in b.records]


def test_disaggregated_runs_hand_off_through_the_real_remote_kv():
    disagg = DisaggConfig(num_prefill_workers=1, num_decode_workers=1)
    sim, res = simulate(disagg)
    assert all(r.status == COMPLETED for r in res.records)
    prefill, decode = sim.workers
    for w in sim.workers:
        w.scheduler.kv.pool.check_whole()
        assert not w.scheduler.remote.quarantine
    # the decode worker never computed a prompt: every step of it is decodes only
    decode_steps = [s for s in res.steps if s.worker_id == decode.worker_id]
    assert decode_steps and all(n == 1 for s in decode_steps for _, n in s.scheduled)
    prefill_steps = [s for s in res.steps if s.worker_id == prefill.worker_id]
    assert sum(n for s in prefill_steps for _, n in s.scheduled) == sum(
        r.prompt_len for r in res.records
    )
    # the second token waits for the KV: at least the exposed transfer after the first
    gap = min(r.token_times[1] - r.token_times[0] for r in res.records)
    assert gap >= PROFILE.transfers["shm"].latency_s


def test_short_prompts_stay_on_the_decode_worker():
    disagg = DisaggConfig(num_prefill_workers=1, num_decode_workers=1, min_prompt_tokens=10_000)
    sim, res = simulate(disagg)
    assert all(r.status == COMPLETED for r in res.records)
    assert not [s for s in res.steps if s.worker_id == 0]  # the prefill worker did nothing


def test_auto_split_follows_the_load_in_simulated_time():
    """Decode-heavy interference on two colocated workers with a tight TPOT: the real
    controller splits them, and the run still completes every request."""
    disagg = DisaggConfig(
        num_decode_workers=2, pd_ratio="auto", slo="ttft_ms=5000,tpot_ms=60", pd_min_dwell_s=5
    )
    args = EngineArgs(model="m", max_num_batched_tokens=512)
    sim = Simulation(PROFILE, args, disagg, max_model_len=4096, threads_per_worker=1)
    load = [RequestSpec(i, i * 0.5, 900, 96) for i in range(80)]
    res = sim.run(load)
    assert all(r.status == COMPLETED for r in res.records)
    assert res.decisions and res.decisions[0]["new"] == [1, 1]
    for w in sim.workers:
        w.scheduler.kv.pool.check_whole()


def test_merged_workers_run_on_every_cpu_and_lend_them_only_when_idle():
    """--pd-merge: one worker runs both workers' CPUs (its steps take the two-thread model's
    time); after a split the parked worker prefills again on its own CPU, and the decode
    worker goes back to one thread."""
    disagg = DisaggConfig(
        num_decode_workers=2, decode_cpus=("0", "1"), pd_ratio="auto", pd_merge=True,
        slo="ttft_ms=5000,tpot_ms=60", pd_min_dwell_s=5,
    )  # fmt: skip
    args = EngineArgs(model="m", max_num_batched_tokens=512)
    sim = Simulation(PROFILE, args, disagg, max_model_len=4096)
    host, parked = sim.workers
    assert (host.role, parked.role, host.size, parked.size) == ("both", "parked", 2, 1)
    first = sim.run([RequestSpec(0, 0.0, 900, 4)]).steps[0]
    assert first.duration_s == pytest.approx(TWO.predict(StepShape.of([512], [512], 0)))
    sim = Simulation(PROFILE, args, disagg, max_model_len=4096)
    res = sim.run([RequestSpec(i, i * 0.5, 900, 96) for i in range(80)])
    assert all(r.status == COMPLETED for r in res.records)
    assert res.decisions[0]["reason"] == "start (--pd-merge)"
    assert res.decisions[1]["new"] == [1, 1]  # interference: split
    # idle at the end: merged, the host on both CPUs; split, each worker on its own
    merged = any(w.role == "parked" for w in sim.workers)
    assert sorted(w.size for w in sim.workers) == ([1, 2] if merged else [1, 1])
    for w in sim.workers:
        w.scheduler.kv.pool.check_whole()


def test_prefix_sharing_from_trace_hash_ids_hits_the_cache():
    shared = [RequestSpec(i, i * 2.0, 1024, 8, hash_ids=(7, 100 + i)) for i in range(5)]
    assert prompt_ids(shared[0], 4096)[:512] == prompt_ids(shared[1], 4096)[:512]
    assert prompt_ids(shared[0], 4096)[512:] != prompt_ids(shared[1], 4096)[512:]
    sim = Simulation(PROFILE, EngineArgs(model="m"), max_model_len=4096)
    sim.run(shared)
    stats = sim.workers[0].scheduler.kv.stats
    assert stats.hits == 4 * 512  # every request after the first finds the shared block


def test_linear_fit_recovers_the_coefficients_and_stays_non_negative():
    shapes = [StepShape.of([q], [q + c], 1) for q in (1, 16, 64, 256, 1024) for c in (0, 512)]
    shapes += [StepShape.of([1] * b, [300] * b, b) for b in (2, 8, 32)]
    times = [ONE.predict(s) for s in shapes]
    fit = LinearStepModel.fit(shapes, times)
    for s, t in zip(shapes, times):
        assert fit.predict(s) == pytest.approx(t, rel=1e-6)
    noisy = LinearStepModel.fit(shapes, [t * (1.3 if i % 2 else 0.7) for i, t in enumerate(times)])
    assert all(c >= 0 for c in noisy.coefficients)
    assert step_model_from_dict(fit.to_dict()) == fit


def test_serving_costs_slow_the_steps_that_share_the_frontends_cores():
    costs = ServingCosts(cpus=2, frontend_cpu_per_token_s=0.002, client_cpu_per_token_s=0.001,
                         frontend_latency_s=0.005)  # fmt: skip
    served = dataclasses.replace(PROFILE, serving=costs)
    one = [RequestSpec(0, 0.0, 64, 20)]

    def run(profile, disagg=None, threads=2, **kw):
        sim = Simulation(profile, EngineArgs(model="m"), disagg, max_model_len=2048,
                         threads_per_worker=threads, **kw)  # fmt: skip
        return sim.run(one)

    base = run(PROFILE)
    slow = run(served)
    # each decode step emits one token: 2 ms of frontend CPU on the worker's (all) cores
    for a, b in zip(base.steps[1:], slow.steps[1:]):
        assert b.duration_s == pytest.approx(a.duration_s + 0.002)
    # the client sees every token 5 ms after its step; TTFT includes it, the pace does not
    (r0,), (r1,) = base.records, slow.records
    assert r1.ttft == pytest.approx(r0.ttft + 0.005 + 0.002)  # the first step samples too
    with_client = run(served, local_client=True)
    assert with_client.steps[-1].duration_s == pytest.approx(base.steps[-1].duration_s + 0.003)
    # a worker on one core of two leaves the other to the frontend: no slowdown
    spare = run(served, threads=1)
    assert spare.steps[-1].duration_s == pytest.approx(run(PROFILE, threads=1).steps[-1].duration_s)
    assert Profile.from_dict(served.to_dict()) == served


def test_served_steps_take_their_measured_factor_per_kind_of_step():
    costs = ServingCosts(cpus=2, frontend_cpu_per_token_s=0.002, client_cpu_per_token_s=0.0,
                         frontend_latency_s=0.0, decode_step_factor=1.2,
                         prefill_step_factor=1.5)  # fmt: skip
    served = dataclasses.replace(PROFILE, serving=costs)
    plain = dataclasses.replace(PROFILE, serving=dataclasses.replace(
        costs, decode_step_factor=1.0, prefill_step_factor=1.0))  # fmt: skip

    def steps(profile):
        sim = Simulation(profile, EngineArgs(model="m"), max_model_len=2048, threads_per_worker=2)
        return sim.run([RequestSpec(0, 0.0, 64, 20)]).steps

    prompt, *decodes = steps(served)
    base_prompt, *base_decodes = steps(plain)
    # the factor scales the step model's time; the frontend's CPU per token comes on top
    assert prompt.duration_s - 0.002 == pytest.approx(1.5 * (base_prompt.duration_s - 0.002))
    assert len(decodes) == 19
    for a, b in zip(base_decodes, decodes, strict=True):
        assert b.duration_s - 0.002 == pytest.approx(1.2 * (a.duration_s - 0.002))
    assert Profile.from_dict(served.to_dict()) == served
    # a profile written before the factors existed reads as 1.0
    old = served.to_dict()
    del old["serving"]["decode_step_factor"], old["serving"]["prefill_step_factor"]
    assert Profile.from_dict(old).serving == dataclasses.replace(
        costs, decode_step_factor=1.0, prefill_step_factor=1.0
    )


def test_step_factors_compare_served_requests_with_the_model():
    from pdserve.bench.metrics import RequestRecord
    from pdserve.perf.serving_costs import step_factors

    model = SplitStepModel(decode=TWO, prefill=ONE)
    cpu = 0.001  # per token, on top of the factor
    records = []
    for i, p in enumerate((250, 256, 262)):
        first = 1.3 * model.predict(StepShape.of([p], [p], 1)) + cpu
        times = [first]
        for k in range(30):  # token k + 2 ends the step at context p + k + 2
            times.append(times[-1] + 1.1 * model.predict(StepShape.of([1], [p + k + 2], 1)) + cpu)
        records.append(RequestRecord(
            index=i, input_len=p, output_len=31, prompt_len=p, t_scheduled=0.0, t_arrive=0.0,
            t_first=first,
            token_times=times, t_end=times[-1], status=COMPLETED, prompt_tokens=p,
            completion_tokens=31, server_timings={"ttft_ms": first * 1e3},
        ))  # fmt: skip
    factors = step_factors(records, model, cpu)
    assert factors["prefill_step_factor"] == pytest.approx(1.3, rel=1e-3)
    assert factors["decode_step_factor"] == pytest.approx(1.1, rel=1e-3)
    assert step_factors([], model, cpu) == {}  # nothing measured: the defaults stand


def test_step_factors_take_the_in_process_time_of_the_same_step_where_measured():
    from pdserve.bench.metrics import RequestRecord
    from pdserve.perf.serving_costs import served_steps
    from pdserve.planner.profile import step_factors

    cpu, p = 0.001, 256
    own = [0.2] + [0.01 + 0.0001 * k for k in range(20)]  # in-process: prompt, then decodes
    times = [1.25 * own[0] + cpu]
    for k in range(19):  # token k + 2 comes after the in-process run's decode k + 1
        times.append(times[-1] + 1.1 * own[k + 1] + cpu)
    record = RequestRecord(
        index=0, input_len=p, output_len=20, prompt_len=p, t_scheduled=0.0, t_arrive=0.0,
        t_first=times[0], token_times=times, t_end=times[-1], status=COMPLETED, prompt_tokens=p,
        completion_tokens=20, server_timings={"ttft_ms": times[0] * 1e3},
    )  # fmt: skip
    steps = served_steps([record], [own])
    assert steps[0] == [[p], [p], pytest.approx(times[0]), own[0]]
    assert steps[1][:2] == [[1], [p + 2]] and steps[1][3] == own[1] and len(steps) == 20
    wrong = SplitStepModel(decode=TWO, prefill=ONE)  # far off: it must not be what counts
    factors = step_factors(steps, wrong, cpu)
    assert factors["prefill_step_factor"] == pytest.approx(1.25, rel=1e-6)
    assert factors["decode_step_factor"] == pytest.approx(1.1, rel=1e-3)
    # without the in-process times, the model's predictions stand in for them
    assert len(served_steps([record])[1]) == 3
    assert step_factors(served_steps([record]), wrong, cpu) != factors


def test_one_long_context_makes_every_decode_of_the_step_pay_for_its_length():
    padded = LinearStepModel(0.01, 0.0, 0.0, 0.0, 0.0, per_padded_kv_token=1e-5)
    uniform = StepShape.of([1] * 8, [64] * 8, 8)
    one_long = StepShape.of([1] * 8, [1024] + [64] * 7, 8)
    assert padded.predict(uniform) == pytest.approx(0.01 + 8 * 64 * 1e-5)
    assert padded.predict(one_long) == pytest.approx(0.01 + 8 * 1024 * 1e-5)
    # a prefill chunk pays nothing for it
    assert padded.predict(StepShape.of([256], [1024], 1)) == pytest.approx(0.01)


def test_split_fit_models_decode_steps_apart_from_prompt_steps():
    decode_truth = LinearStepModel(0.03, 0.004, 0.0, 0.0, 0.0, 1e-6)  # small-row products: dear
    prefill_truth = LinearStepModel(0.01, 0.001, 1e-8, 0.0, 0.0)
    decodes = [StepShape.of([1] * b, [c] * b, b) for b in (1, 4, 16, 32) for c in (64, 512)]
    prompts = [StepShape.of([q], [q + c], 1) for q in (16, 128, 512, 1024) for c in (0, 512)]
    shapes = decodes + prompts
    times = [(decode_truth if s.is_decode else prefill_truth).predict(s) for s in shapes]
    split = SplitStepModel.fit(shapes, times)
    for s, t in zip(shapes, times):
        assert split.predict(s) == pytest.approx(t, rel=1e-6)
    one_line = LinearStepModel.fit(shapes, times)
    worst = max(abs(one_line.predict(s) / t - 1) for s, t in zip(shapes, times))
    assert worst > 0.1  # which one line through both cannot do
    assert step_model_from_dict(split.to_dict()) == split


def test_split_fit_puts_wide_decode_batches_apart_where_they_fit_better():
    # a product over a few rows streams the weights once; past its tile of rows it changes
    narrow = LinearStepModel(0.012, 0.0, 3e-6, 0.0, 0.0)
    wide = LinearStepModel(0.017, 0.0012, 1e-6, 0.0, 0.0)
    prefill = LinearStepModel(0.01, 0.001, 1e-8, 0.0, 0.0)
    decodes = [
        StepShape.of([1] * b, [c] * b, b) for b in (1, 2, 4, 6, 8, 16, 32) for c in (64, 512)
    ]
    prompts = [StepShape.of([q], [q + c], 1) for q in (16, 128, 512) for c in (0, 512)]

    def truth(s):
        if not s.is_decode:
            return prefill.predict(s)
        return (narrow if len(s.q_lens) <= 6 else wide).predict(s)

    shapes = decodes + prompts
    times = [truth(s) for s in shapes]
    split = SplitStepModel.fit(shapes, times)
    assert split.wide_rows == 6 and split.wide_decode is not None
    for s, t in zip(shapes, times):
        assert split.predict(s) == pytest.approx(t, rel=1e-6)
    assert step_model_from_dict(split.to_dict()) == split
    # asked not to, or where one line fits every decode step, the fit does not split
    one_line = SplitStepModel.fit(shapes, times, split_decode=False)
    assert one_line.wide_decode is None
    assert max(abs(one_line.predict(s) / t - 1) for s, t in zip(shapes, times)) > 0.1
    straight = [wide.predict(s) if s.is_decode else t for s, t in zip(shapes, times)]
    assert SplitStepModel.fit(shapes, straight).wide_decode is None
    # a profile fitted before the split reads as one without it
    old = split.to_dict()
    del old["wide_decode"], old["wide_rows"]
    assert step_model_from_dict(old) == SplitStepModel(split.decode, split.prefill)


def test_refit_fits_the_kept_steps_again_and_their_served_factors():
    from pdserve.planner.profile import refit

    narrow = LinearStepModel(0.012, 0.0, 3e-6, 0.0, 0.0)
    wide = LinearStepModel(0.017, 0.0012, 1e-6, 0.0, 0.0)
    prefill = LinearStepModel(0.01, 0.001, 1e-8, 0.0, 0.0)
    truth = SplitStepModel(narrow, prefill, wide, 6)
    shapes = [StepShape.of([1] * b, [c] * b, b) for b in (1, 2, 4, 6, 8, 16, 32) for c in (64, 512)]
    shapes += [StepShape.of([q], [q + c], 1) for q in (16, 128, 512) for c in (0, 512)]
    samples = [[list(s.q_lens), list(s.ctx_lens), s.num_sampled, truth.predict(s)] for s in shapes]
    cpu = 0.002  # per token, frontend and client together
    calibration = [[[256], [256], 1.25 * truth.predict(StepShape.of([256], [256], 1)) + cpu]]
    calibration += [
        [[1], [256 + k], 1.1 * truth.predict(StepShape.of([1], [256 + k], 1)) + cpu]
        for k in range(2, 40)
    ]
    costs = ServingCosts(2, 0.0015, 0.0005, 0.01, 1.0, 1.0, calibration)
    old = Profile("measured", "synthetic", 36864, 12, {2: TWO}, serving=costs, samples={2: samples})
    new = refit(Profile.from_dict(old.to_dict()))  # what it kept survives the JSON
    model = new.step_model(2)
    assert model.wide_rows == 6
    assert all(model.predict(s) == pytest.approx(truth.predict(s), rel=1e-6) for s in shapes)
    assert new.serving.decode_step_factor == pytest.approx(1.1, rel=1e-6)
    assert new.serving.prefill_step_factor == pytest.approx(1.25, rel=1e-6)
    assert "refitted, 2 thread(s)" in new.notes[-1]
    assert refit(old, split_decode=False).step_model(2).wide_decode is None
    with pytest.raises(ValueError, match="kept its steps"):
        refit(PROFILE)  # nothing kept


def test_analytic_model_is_a_roofline():
    shape = ModelShape(4096, 32, 32, 8, 128, 14336, 128256)  # a Llama 3 8B
    h100 = AnalyticStepModel(shape, peak_flops=989e12, bandwidth=3.35e12, mfu=0.5, mbu=0.7)
    decode = h100.predict(StepShape.of([1] * 8, [1024] * 8, 8))
    weights_s = 16e9 / (3.35e12 * 0.7)
    assert decode == pytest.approx(weights_s + 0.003, rel=0.1)  # bandwidth-bound: the weights
    prefill = h100.predict(StepShape.of([4096], [4096], 1))
    flops_s = 2 * 8e9 * 4096 / (989e12 * 0.5)
    assert prefill == pytest.approx(flops_s + 0.003, rel=0.15)  # compute-bound
    assert step_model_from_dict(h100.to_dict()) == h100


def test_profile_round_trips_through_json(tmp_path):
    path = tmp_path / "p.json"
    PROFILE.save(path)
    assert Profile.load(path) == PROFILE
    assert PROFILE.step_model(3) == TWO and PROFILE.step_model(1) == ONE


def test_simulated_records_summarize_like_measured_ones():
    _, res = simulate(threads=2, max_num_batched_tokens=256)
    s = summarize(res.records, Slo.parse("ttft_ms=2000,tpot_ms=150"))
    assert s["completed"] == 40 and s["ttft_ms"]["p50"] > 0 and s["goodput"] > 0


def test_prompt_steps_of_several_lengths_fit_a_fixed_cost_and_a_factor():
    from pdserve.planner.profile import step_factors

    cpu, model = 0.001, SplitStepModel(decode=TWO, prefill=ONE)
    own = {16: 0.03, 64: 0.09, 256: 0.3, 512: 0.62}  # in-process prompt steps
    steps = [[[p], [p], 0.012 + 0.95 * t + cpu, t] for p, t in own.items()]
    steps += [[[1], [p + 2], 1.1 * 0.015 + cpu, 0.015] for p in own]
    factors = step_factors(steps, model, cpu)
    assert factors["prefill_step_overhead_s"] == pytest.approx(0.012, rel=1e-6)
    assert factors["prefill_step_factor"] == pytest.approx(0.95, rel=1e-6)
    assert factors["decode_step_factor"] == pytest.approx(1.1, rel=1e-6)
    # prompts of one length cannot tell the two apart: a ratio, as before
    one = step_factors([s for s in steps if s[0] in ([256], [1])], model, cpu)
    assert "prefill_step_overhead_s" not in one
    assert one["prefill_step_factor"] == pytest.approx((0.012 + 0.95 * 0.3) / 0.3, rel=1e-6)
    # a served prompt faster than in-process by a fixed amount: no negative cost, a ratio line
    faster = [[[p], [p], 0.9 * t - 0.005 + cpu, t] for p, t in own.items()]
    fit = step_factors(faster, model, cpu)
    assert fit["prefill_step_overhead_s"] == 0.0 and 0.8 < fit["prefill_step_factor"] < 0.9


def test_the_simulator_adds_the_fixed_cost_to_prompt_steps_only():
    costs = ServingCosts(2, 0.0, 0.0, 0.0, 1.0, 1.0)

    def one_request(overhead: float):
        served = dataclasses.replace(costs, prefill_step_overhead_s=overhead)
        sim = Simulation(dataclasses.replace(PROFILE, serving=served), EngineArgs(model="m"),
                         max_model_len=2048, threads_per_worker=2)  # fmt: skip
        return sim.run([RequestSpec(0, 0.0, 300, 20)]).records[0]

    with_cost, plain = one_request(0.25), one_request(0.0)
    assert with_cost.ttft == pytest.approx(plain.ttft + 0.25, abs=1e-9)  # the one prompt step
    gaps = [b - a for a, b in zip(with_cost.token_times, with_cost.token_times[1:])]
    plain_gaps = [b - a for a, b in zip(plain.token_times, plain.token_times[1:])]
    assert gaps == pytest.approx(plain_gaps, abs=1e-9)  # decode steps unchanged


def test_a_request_reaches_its_worker_the_first_tokens_extra_time_after_its_send():
    costs = ServingCosts(2, 0.0, 0.0, 0.0, 1.0, 1.0)

    def records(extra):
        served = dataclasses.replace(costs, first_token_extra_s=extra)
        sim = Simulation(dataclasses.replace(PROFILE, serving=served), EngineArgs(model="m"),
                         max_model_len=2048, threads_per_worker=2)  # fmt: skip
        return sim.run([RequestSpec(0, 0.0, 300, 20), RequestSpec(1, 0.001, 40, 5)]).records

    late, plain, unmeasured = records(0.004), records(0.0), records(None)
    assert [r.ttft for r in plain] == [r.ttft for r in unmeasured]
    assert late[0].t_arrive == plain[0].t_arrive == 0.0  # the client's clock: sent at 0
    assert late[0].ttft == pytest.approx(plain[0].ttft + 0.004, abs=1e-9)
    gaps = [b - a for a, b in zip(late[0].token_times, late[0].token_times[1:])]
    plain_gaps = [b - a for a, b in zip(plain[0].token_times, plain[0].token_times[1:])]
    assert gaps == pytest.approx(plain_gaps, abs=1e-9)  # the tokens after the first: unchanged
    # the second request waits behind the first's prompt step either way
    assert late[1].ttft > plain[0].ttft
    assert records(-0.001)[0].ttft == pytest.approx(plain[0].ttft, abs=1e-9)  # never earlier


def test_the_first_tokens_extra_time_comes_from_requests_that_go_on_decoding():
    from pdserve.bench.metrics import RequestRecord
    from pdserve.perf.serving_costs import _first_token_extra

    def record(ttft, out):
        times = [ttft + 0.01 * k for k in range(out)]
        return RequestRecord(
            index=0, input_len=64, output_len=out, prompt_len=64, t_scheduled=0.0,
            t_arrive=0.0, t_first=ttft, token_times=times, t_end=times[-1], status=COMPLETED,
            prompt_tokens=64, completion_tokens=out,
        )  # fmt: skip

    costs = ServingCosts(2, 0.0, 0.0, 0.003, 1.0, 1.0, prefill_step_overhead_s=0.001,
                         frontend_latency_alone_s=0.002, latency_streams=6)  # fmt: skip
    # three that went on decoding: 9, 7 and 8 ms outside their 20-ms prompt step; one with one
    # token out (its worker idle after the step: it left at once) and one without /metrics
    records = [record(0.029, 8), record(0.027, 8), record(0.028, 8), record(0.021, 1),
               record(0.050, 8)]  # fmt: skip
    steps = [0.020, 0.020, 0.020, 0.020, None]
    assert _first_token_extra(records, steps, costs) == pytest.approx(0.008 - 0.001 - 0.002)
    assert _first_token_extra(records[3:], steps[3:], costs) is None  # nothing to go on


SPLIT = DisaggConfig(num_prefill_workers=1, num_decode_workers=1)
PLAIN = dataclasses.replace(PROFILE, serving=ServingCosts(2, 0.0, 0.0, 0.0))


def _step_times(profile, disagg, threads, specs, keep) -> list[float]:
    """The simulated durations of the steps of `specs` whose first scheduled item
    (request id, new tokens) `keep` accepts."""
    sim = Simulation(profile, EngineArgs(model="m"), disagg, max_model_len=2048,
                     threads_per_worker=threads)  # fmt: skip
    return [s.duration_s for s in sim.run(specs).steps if keep(s.scheduled[0])]


def test_a_decode_worker_on_part_of_the_cpus_takes_its_own_factor():
    costs = ServingCosts(2, 0.0, 0.0, 0.0, decode_step_factor=1.2, prefill_step_factor=1.0,
                         part_decode_step_factor=0.95, part_cpus=1)  # fmt: skip
    served, plain, split = dataclasses.replace(PROFILE, serving=costs), PLAIN, SPLIT

    def decode_steps(profile, disagg, threads):  # one request: each step holds it alone
        return _step_times(profile, disagg, threads, [RequestSpec(0, 0.0, 64, 20)],
                           lambda item: item[1] == 1)  # fmt: skip

    # 1P+1D, one CPU each: the decode worker's steps take the part factor
    part, base = decode_steps(served, split, 1), decode_steps(plain, split, 1)
    assert len(part) == len(base) >= 18
    assert part == pytest.approx([0.95 * t for t in base])
    # one worker on both CPUs: the factor of the calibration that served on both
    whole, base = decode_steps(served, None, 2), decode_steps(plain, None, 2)
    assert whole == pytest.approx([1.2 * t for t in base])
    # a profile measured before the part factor: the one factor stands for every worker
    old = served.to_dict()
    for key in ("part_decode_step_factor", "part_cpus", "part_calibration_steps"):
        del old["serving"][key]
    assert Profile.from_dict(old).serving.decode_factor(1) == 1.2
    assert Profile.from_dict(served.to_dict()) == served


def test_a_prefill_worker_on_part_of_the_cpus_takes_its_own_factor():
    from pdserve.planner.profile import worker_step_factor

    # its prompt steps by its own clock over the same prompts in-process: 0.11/0.10 at the median
    pairs = [[0.110, 0.100], [0.230, 0.200], [0.052, 0.050], [0.0, 0.04]]  # the last unmeasured
    assert worker_step_factor(pairs) == pytest.approx(0.110 / 0.100)
    assert worker_step_factor([[0.0, 0.1]]) is None
    costs = ServingCosts(2, 0.0, 0.0, 0.0, prefill_step_factor=0.9, part_cpus=1,
                         part_prefill_step_factor=worker_step_factor(pairs),
                         part_prompt_steps=pairs)  # fmt: skip
    served, plain, split = dataclasses.replace(PROFILE, serving=costs), PLAIN, SPLIT

    def prompt_steps(profile, disagg, threads):  # two prompts 5 s apart: a step each
        specs = [RequestSpec(0, 0.0, 300, 4), RequestSpec(1, 5.0, 200, 4)]
        return _step_times(profile, disagg, threads, specs, lambda item: item[1] > 1)

    part, base = prompt_steps(served, split, 1), prompt_steps(plain, split, 1)
    assert len(part) == len(base) == 2
    assert part == pytest.approx([1.1 * t for t in base])
    whole, base = prompt_steps(served, None, 2), prompt_steps(plain, None, 2)
    assert whole == pytest.approx([0.9 * t for t in base])
    assert Profile.from_dict(served.to_dict()) == served


def test_refit_recomputes_the_part_factor_from_its_own_steps():
    from pdserve.planner.profile import refit

    shapes = [StepShape.of([1] * b, [c] * b, b) for b in (1, 2, 4, 8) for c in (64, 512)]
    shapes += [StepShape.of([q], [q], 1) for q in (16, 128, 512, 1024)]
    samples = {n: [[list(s.q_lens), list(s.ctx_lens), s.num_sampled, m.predict(s)] for s in shapes]
               for n, m in ((1, ONE), (2, TWO))}  # fmt: skip
    cpu = 0.002  # per token; a worker on one CPU of two carries half of it

    def decode(model, factor, share):
        return [[[1], [300 + k], factor * model.predict(StepShape.of([1], [300 + k], 1)) + share]
                for k in range(30)]  # fmt: skip

    costs = ServingCosts(2, 0.0015, 0.0005, 0.0, calibration_steps=decode(TWO, 1.1, cpu),
                         part_cpus=1, part_calibration_steps=decode(ONE, 0.9, cpu / 2),
                         part_prefill_step_factor=1.1)  # fmt: skip
    old = Profile("measured", "synthetic", 36864, 12, {1: ONE, 2: TWO}, serving=costs,
                  samples=samples)  # fmt: skip
    new = refit(Profile.from_dict(old.to_dict()))
    assert new.serving.decode_step_factor == pytest.approx(1.1, rel=1e-3)
    assert new.serving.part_decode_step_factor == pytest.approx(0.9, rel=1e-3)
    assert new.serving.decode_factor(1) == new.serving.part_decode_step_factor
    # the prefill worker's factor is two measured times over each other: no model to refit to
    assert new.serving.prefill_factor(1) == 1.1


def test_the_prompt_line_is_not_pulled_by_one_outlier():
    from pdserve.planner.profile import step_factors

    cpu, model = 0.0, SplitStepModel(decode=TWO, prefill=ONE)
    own = {16: 0.03, 64: 0.09, 256: 0.3, 512: 0.62}
    steps = [[[p], [p], 0.01 + 0.95 * t, t] for p, t in own.items() for _ in range(2)]
    steps[0][2] = 3 * steps[0][2]  # one short prompt served three times slower than its twin
    factors = step_factors(steps, model, cpu)
    assert factors["prefill_step_overhead_s"] == pytest.approx(0.01, rel=1e-6)
    assert factors["prefill_step_factor"] == pytest.approx(0.95, rel=1e-6)


def test_calibration_drift_is_the_in_process_decode_over_the_model():
    from pdserve.planner.profile import calibration_drift

    def decode(model, slower):
        return [[[1], [300 + k], 0.05, slower * model.predict(StepShape.of([1], [300 + k], 1))]
                for k in range(9)]  # fmt: skip

    costs = ServingCosts(2, 0.0, 0.0, 0.0, calibration_steps=decode(TWO, 1.2)
                         + [[[256], [256], 0.5, 0.01]],  # a prompt step does not count
                         part_cpus=1, part_calibration_steps=decode(ONE, 1.2))  # fmt: skip
    profile = dataclasses.replace(PROFILE, serving=costs)
    assert calibration_drift(profile) == pytest.approx(1.2)
    assert calibration_drift(PROFILE) is None  # nothing measured
    unpaired = ServingCosts(2, 0.0, 0.0, 0.0, calibration_steps=[[[1], [300], 0.05]])
    assert calibration_drift(dataclasses.replace(PROFILE, serving=unpaired)) is None


def test_an_anchor_is_the_probe_steps_over_the_fitted_model_per_kind_of_step():
    from pdserve.planner.profile import Anchor

    decode = [[[1] * b, [200] * b, b, 1.25 * ONE.predict(StepShape.of([1] * b, [200] * b, b))]
              for b in (1, 4, 16)]  # fmt: skip
    prompt = [[[q], [q], 1, 0.9 * ONE.predict(StepShape.of([q], [q], 1))] for q in (64, 512)]
    anchor = Anchor.measure(ONE, decode + prompt, "2026-12-04T19:00:00+00:00")
    assert anchor.decode == pytest.approx(1.25) and anchor.prefill == pytest.approx(0.9)
    assert Anchor.measure(ONE, decode).prefill == 1.0  # a kind the probe did not run
    assert Anchor.measure(ONE, []).decode == 1.0


def test_an_anchored_profile_scales_its_steps_and_keeps_its_fit(tmp_path):
    from pdserve.planner.profile import Anchor, calibration_drift

    anchored = PROFILE.anchored({1: Anchor(1.5, 0.8, [[[1], [10], 1, 0.1]])})
    decode, prompt = StepShape.of([1], [300], 1), StepShape.of([256], [256], 1)
    one = anchored.step_model(1)
    assert one.predict(decode) == pytest.approx(1.5 * ONE.predict(decode))
    assert one.predict(prompt) == pytest.approx(0.8 * ONE.predict(prompt))
    assert anchored.step_model(2) is TWO and anchored.fitted_step_model(1) is ONE
    path = tmp_path / "p.json"
    anchored.save(path)
    again = Profile.load(path)
    assert again.anchors == anchored.anchors
    assert again.step_model(1).predict(decode) == pytest.approx(one.predict(decode))
    with pytest.raises(ValueError, match="lacks"):
        PROFILE.anchored({4: Anchor(1.0, 1.0)})
    analytic = dataclasses.replace(PROFILE, kind="analytic")
    with pytest.raises(ValueError, match="measured"):
        analytic.anchored({1: Anchor(1.0, 1.0)})
    # the drift between the profile's steps and its calibration is the fitted model's, anchored
    # or not
    steps = [[[1], [300 + k], 0.05, 1.2 * ONE.predict(StepShape.of([1], [300 + k], 1))]
             for k in range(5)]  # fmt: skip
    costs = ServingCosts(1, 0.0, 0.0, 0.0, calibration_steps=steps)
    with_costs = dataclasses.replace(anchored, serving=costs)
    assert calibration_drift(with_costs) == pytest.approx(1.2)


def test_the_simulator_runs_an_anchored_profile_at_the_anchored_speed():
    from pdserve.planner.profile import Anchor

    args = EngineArgs(model="m")
    specs = requests(n=6, gap=5.0, output_len=32)  # one at a time: TPOT is the decode step

    def tpot(profile):
        sim = Simulation(profile, args, None, max_model_len=2048, threads_per_worker=1)
        s = summarize(sim.run(specs).records)
        assert s["completed"] == len(specs)
        return s["tpot_ms"]["p50"], s["ttft_ms"]["p50"]

    (tpot0, ttft0), (tpot1, ttft1) = tpot(PROFILE), tpot(PROFILE.anchored({1: Anchor(1.3, 0.7)}))
    assert tpot1 == pytest.approx(1.3 * tpot0, rel=1e-6)
    assert ttft1 == pytest.approx(0.7 * ttft0, rel=0.02)  # the prompt's step, and one decode


def test_refit_measures_the_anchors_again_against_the_new_models():
    from pdserve.planner.profile import Anchor, refit

    shapes = [StepShape.of([1] * b, [c] * b, b) for b in (1, 2, 4, 8) for c in (64, 512)] + [
        StepShape.of([q], [q], 1) for q in (16, 64, 256, 1024)
    ]
    samples = [[list(s.q_lens), list(s.ctx_lens), s.num_sampled, ONE.predict(s)] for s in shapes]
    probe = [[*row[:3], 1.1 * row[3]] for row in samples]
    stale = Anchor(3.0, 3.0, probe)  # factors that do not follow from its own steps
    old = Profile("measured", "synthetic", 36864, 12, {1: TWO}, samples={1: samples},
                  anchors={1: stale})  # fmt: skip
    new = refit(old)
    assert new.anchors[1].decode == pytest.approx(1.1, rel=1e-3)
    assert new.anchors[1].prefill == pytest.approx(1.1, rel=1e-3)
    assert new.anchors[1].steps == probe


def test_the_wake_cost_follows_the_measured_points_and_stays_at_the_last():
    wake = WakeCost(((0.1, 0.002), (0.5, 0.004), (2.0, 0.013)))
    assert wake.extra(0.0) == 0.0
    assert wake.extra(0.05) == pytest.approx(0.001)
    assert wake.extra(0.3) == pytest.approx(0.003)
    assert wake.extra(1.25) == pytest.approx(0.0085)
    assert wake.extra(2.0) == wake.extra(60.0) == wake.extra(float("inf")) == 0.013
    profile = dataclasses.replace(PROFILE, wake={2: wake})
    assert profile.wake_cost(2, 0.3) == profile.wake_cost(3, 0.3) == pytest.approx(0.003)
    assert PROFILE.wake_cost(2, 5.0) == 0.0  # a profile measured without it
    assert Profile.from_dict(profile.to_dict()) == profile


def test_a_step_after_an_idle_stretch_takes_the_wake_cost_and_the_next_does_not():
    wake = WakeCost(((0.5, 0.004), (2.0, 0.010)))
    woken = dataclasses.replace(PROFILE, wake={2: wake})

    # one request at 0 s (its server idled before), one 1 s after the first one ended
    def run(profile, second_at):
        sim = Simulation(profile, EngineArgs(model="m"), max_model_len=2048, threads_per_worker=2)
        return sim.run([RequestSpec(0, 0.0, 64, 4), RequestSpec(1, second_at, 64, 4)])

    base = run(PROFILE, 10.0)
    end = base.records[0].t_end
    base, slow = run(PROFILE, end + 1.0), run(woken, end + 1.0)
    first, second = (s for s in slow.steps if len(s.scheduled) == 1 and s.scheduled[0][1] == 64)
    by_start = {s.start_s: s.duration_s for s in base.steps}
    assert first.duration_s == pytest.approx(by_start[first.start_s] + 0.010)  # idle forever
    idle = second.start_s - max(s.start_s + s.duration_s for s in slow.steps if s != second
                                and s.start_s < second.start_s)  # fmt: skip
    assert 0.9 < idle < 1.0  # the first request ended 10 ms later than without the wake
    assert second.duration_s == pytest.approx(by_start[second.start_s] + wake.extra(idle))
    assert 0.004 < wake.extra(idle) < 0.010
    # the steps that follow another pay nothing
    assert len(base.steps) == len(slow.steps) > 2
    for a, b in zip(base.steps, slow.steps):
        if b not in (first, second):
            assert b.scheduled == a.scheduled and b.duration_s == pytest.approx(a.duration_s)


def test_the_time_outside_the_engine_grows_with_the_streams_in_flight():
    costs = ServingCosts(cpus=2, frontend_cpu_per_token_s=0.0, client_cpu_per_token_s=0.0,
                         frontend_latency_s=0.016, frontend_latency_alone_s=0.006,
                         latency_streams=6)  # fmt: skip
    assert costs.latency(1) == pytest.approx(0.006)
    assert costs.latency(3) == pytest.approx(0.010)
    assert costs.latency(6) == costs.latency(40) == pytest.approx(0.016)
    old = dataclasses.replace(costs, frontend_latency_alone_s=None, latency_streams=0)
    assert old.latency(1) == old.latency(6) == 0.016  # measured before the alone figure
    profile = dataclasses.replace(PROFILE, serving=costs)
    sim = Simulation(profile, EngineArgs(model="m"), max_model_len=2048, threads_per_worker=2)
    (alone,) = sim.run([RequestSpec(0, 0.0, 64, 4)]).records
    assert alone.token_times[0] - alone.t_arrive == pytest.approx(sim.steps[0].duration_s + 0.006)
    assert Profile.from_dict(profile.to_dict()) == profile


def test_bursts_run_several_decode_steps_per_schedule_in_simulated_time():
    """--num-scheduler-steps: the real scheduler plans bursts, a burst takes its steps' time,
    and every request still gets all its tokens and returns its blocks."""
    sim1, one = simulate(threads=2, max_num_batched_tokens=256)
    sim8, many = simulate(threads=2, max_num_batched_tokens=256, num_scheduler_steps=8)
    assert all(r.status == COMPLETED for r in many.records)
    for r, spec in zip(many.records, requests()):
        assert r.completion_tokens == spec.output_len == len(r.token_times)
    for w in sim8.workers:
        w.scheduler.kv.pool.check_whole()
    # 40 requests 1 s apart, each decoding alone most of the time: far fewer steps
    assert len(sim8.steps) < len(sim1.steps) / 3
    # the same steps' time in all, in fewer, longer records; a request's tokens arrive together
    busy1, busy8 = (sum(s.duration_s for s in sim.steps) for sim in (sim1, sim8))
    assert busy8 == pytest.approx(busy1, rel=0.05)
    times = [t for r in many.records for t in r.token_times]
    assert len(set(times)) < len(times) / 3


def noisy_profile(ratios=(0.8, 1.0, 1.5)):
    """PROFILE with kept steps of every kind at `ratios` of its two-thread model's time."""
    shapes = [([1], [300], 1), ([1, 1, 1], [200, 300, 400], 3),  # decode
              ([10, 1], [298, 200], 2), ([64], [64], 1),  # short: <= 64 prompt tokens
              ([256], [256], 0), ([400, 1], [400, 90], 2)]  # prompt  # fmt: skip
    rows = [[q, c, n, TWO.predict(StepShape.of(q, c, n)) * r] for q, c, n in shapes for r in ratios]
    return dataclasses.replace(PROFILE, samples={2: rows})


def test_step_noise_holds_each_kinds_measured_ratios_and_draws_only_them():
    assert noise_kind(StepShape.of([1, 1], [5, 9], 2)) == "decode"
    assert noise_kind(StepShape.of([64, 1], [900, 9], 2)) == "short"
    assert noise_kind(StepShape.of([65], [65], 1)) == "prompt"
    profile = noisy_profile()
    noise = profile.step_noise(2)
    assert set(noise.ratios) == {"decode", "short", "prompt"}
    for ratios in noise.ratios.values():
        assert ratios == pytest.approx((0.8, 0.8, 1.0, 1.0, 1.5, 1.5))
    assert profile.step_noise(3) == noise  # a worker of 3 threads takes the nearest size's
    assert profile.step_noise(1) is PROFILE.step_noise(2) is None  # no kept steps: no noise
    rng = random.Random(0)
    decode = StepShape.of([1], [9], 1)
    assert {noise.draw(decode, rng) for _ in range(200)} == {0.8, 1.0, 1.5}
    burst = [noise.draw(decode, rng, num_steps=8) for _ in range(200)]
    assert all(0.8 <= b <= 1.5 for b in burst) and len(set(burst)) > 3  # a mean of eight draws
    # a kind the profile never measured takes the ratios of every kind it did
    only_decodes = StepNoise.fit(TWO, [[[1], [9], 1, TWO.predict(decode) * 2]])
    assert only_decodes.ratios["prompt"] == only_decodes.ratios["decode"] == pytest.approx((2.0,))


def test_a_noisy_simulation_is_the_same_for_a_seed_and_each_step_takes_a_measured_ratio():
    profile = noisy_profile()

    def run(reqs, noise, seed=0, **engine):
        sim = Simulation(profile, EngineArgs(model="m", **engine), max_model_len=2048,
                         threads_per_worker=2, step_noise=noise, seed=seed)  # fmt: skip
        return sim.run(reqs)

    busy = requests(n=12, gap=0.3)
    a, b = run(busy, True, max_num_batched_tokens=256), run(busy, True, max_num_batched_tokens=256)
    other = run(busy, True, seed=1, max_num_batched_tokens=256)
    assert all(r.status == COMPLETED for r in a.records)
    assert [r.to_dict() for r in a.records] == [r.to_dict() for r in b.records]
    assert [r.to_dict() for r in a.records] != [r.to_dict() for r in other.records]
    # requests far apart are scheduled alike whatever the step times: each noisy step takes its
    # quiet twin's time times one of the measured ratios
    spaced = [RequestSpec(i, 5.0 * i, 300, 6) for i in range(6)]
    quiet, noisy = run(spaced, False), run(spaced, True)
    assert [s.scheduled for s in quiet.steps] == [s.scheduled for s in noisy.steps]
    got = {round(n.duration_s / q.duration_s, 9) for q, n in zip(quiet.steps, noisy.steps)}
    assert got == {0.8, 1.0, 1.5}


def test_a_replayed_step_log_takes_no_noise():
    sim = Simulation(noisy_profile(), EngineArgs(model="m"), max_model_len=2048,
                     threads_per_worker=2, step_time=lambda worker, shape: 0.01,
                     step_noise=True)  # fmt: skip
    result = sim.run([RequestSpec(i, 0.5 * i, 100, 5) for i in range(4)])
    assert {s.duration_s for s in result.steps} == {0.01}
