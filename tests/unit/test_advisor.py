"""The advisor's verdicts on constructed observations: each rule, its evidence and its actions."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pdserve.bench.metrics import COMPLETED, RequestRecord
from pdserve.planner.advisor import advise
from pdserve.planner.observation import Observation, from_records

SLO = {"slo_ttft_s": 2.0, "slo_tpot_s": 0.15}


def obs(**kw) -> Observation:
    """A colocated worker serving 2 req/s within its SLO, half busy; `kw` changes it."""
    base = Observation(
        window_s=30.0, num_finished=60, request_rate=2.0,
        ttft_p50_s=0.3, ttft_p90_s=0.6, tpot_p50_s=0.05, tpot_p90_s=0.08,
        queue_mean_s=0.05, prefill_mean_s=0.25, workers={"both": 1}, busy={"both/0": 0.5},
        step_time_s={"decode": 10.0, "mixed": 4.0, "prefill": 1.0},
        step_mean_s={"decode": 0.05, "mixed": 0.07, "prefill": 0.2},
        decode_batch_mean=4.0, running_mean=5.0, waiting_mean=0.0, kv_usage_max=0.2,
        frontend_cpu_cores=0.1, **SLO,
    )  # fmt: skip
    return replace(base, **kw)


def joined(verdict) -> str:
    return " | ".join(verdict.actions)


def test_no_load_is_idle():
    v = advise(obs(num_finished=0, request_rate=0.0, running_mean=0.0, busy={"both/0": 0.0}))
    assert v.bound == "idle"


def test_preemptions_make_it_kv_bound_with_concrete_limits():
    v = advise(obs(num_preemptions=12, tpot_p90_s=0.4), {"max_num_seqs": 64})
    assert v.bound == "kv" and "12 preemptions" in v.summary
    assert "--kv-cache-memory" in joined(v) and "--max-num-seqs 48" in joined(v)


def test_a_full_kv_cache_with_requests_waiting_is_kv_bound():
    assert advise(obs(kv_usage_max=0.97, waiting_mean=6.0)).bound == "kv"
    assert advise(obs(kv_usage_max=0.97, waiting_mean=0.0)).bound != "kv"  # full but coping


def test_a_saturated_frontend_with_idle_workers_is_frontend_bound():
    v = advise(obs(frontend_cpu_cores=0.97, busy={"both/0": 0.4}, ttft_p90_s=3.0))
    assert v.bound == "frontend" and "0.97 cores" in v.summary
    assert "--cpus" in joined(v)
    # the same frontend load with busy workers: the workers limit, not the frontend
    assert (
        advise(obs(frontend_cpu_cores=0.97, busy={"both/0": 0.95}, ttft_p90_s=3.0)).bound
        == "prefill"
    )


def test_time_outside_the_engine_is_frontend_bound_where_ttft_misses():
    v = advise(obs(ttft_p50_s=2.5, ttft_p90_s=3.0, outside_ttft_p50_s=1.5))
    assert v.bound == "frontend" and "outside the engine" in v.summary
    # within the TTFT target, time outside the engine is not what limits the deployment
    v = advise(obs(ttft_p50_s=0.2, outside_ttft_p50_s=0.12, tpot_p90_s=0.3))
    assert v.bound == "decode"


def test_slos_met_with_idle_workers_is_under_loaded():
    v = advise(obs(busy={"both/0": 0.1, "both/1": 0.2}, workers={"both": 2}))
    assert v.bound == "under-loaded"
    assert "fewer than 2 workers" in joined(v)


def test_slos_met_at_full_use_is_balanced_at_capacity_and_names_the_nearer_target():
    v = advise(obs(busy={"both/0": 0.95}, ttft_p90_s=1.8, tpot_p90_s=0.05))
    assert v.bound == "balanced" and "at capacity" in v.summary and "TTFT" in v.summary
    assert advise(obs(busy={"both/0": 0.6})).bound == "balanced"


def test_ttft_over_target_on_one_worker_asks_for_another_worker():
    v = advise(obs(ttft_p90_s=5.0, queue_mean_s=2.0, ttft_p50_s=3.0, busy={"both/0": 0.97}))
    assert v.bound == "prefill" and "5000 ms against 2000 ms" in v.summary
    assert "wait 2000 ms to be scheduled" in v.summary
    assert "--decode-workers 2" in joined(v) and "--profile chat" in joined(v)
    assert "--slo-admission" in joined(v)


def test_requests_queued_for_sequence_slots_ask_for_more_slots():
    v = advise(
        obs(ttft_p90_s=4.0, ttft_p50_s=2.5, queue_mean_s=2.0, running_mean=63.0),
        {"max_num_seqs": 64},
    )
    assert v.bound == "prefill" and "sequence slots" in v.summary
    assert "--max-num-seqs (to 96)" in joined(v)


def test_a_split_whose_decode_pool_idles_moves_a_worker_to_prefill():
    v = advise(obs(
        ttft_p90_s=6.0, workers={"prefill": 1, "decode": 2},
        busy={"prefill/0": 0.99, "decode/1": 0.3, "decode/2": 0.2},
    ))  # fmt: skip
    assert v.bound == "prefill"
    assert "--prefill-workers 2 --decode-workers 1" in joined(v)


def test_prompt_chunks_stalling_decodes_ask_for_smaller_chunks_or_a_split():
    v = advise(
        obs(
            tpot_p90_s=0.3, workers={"both": 2}, busy={"both/0": 0.9, "both/1": 0.9},
            step_time_s={"decode": 5.0, "mixed": 10.0},
            step_mean_s={"decode": 0.05, "mixed": 0.4},
        ),
        {"max_num_batched_tokens": 2048},
    )  # fmt: skip
    assert v.bound == "decode" and "stall" in v.summary
    assert "--max-num-batched-tokens 256" in joined(v) and "--prefill-workers 1" in joined(v)


def test_large_decode_batches_over_tpot_ask_for_fewer_streams():
    v = advise(obs(tpot_p90_s=0.3, decode_batch_mean=40.0, busy={"both/0": 0.95}))
    assert v.bound == "decode" and "batches of 40.0" in v.summary
    assert "--max-num-seqs 20" in joined(v)  # 40 x 150 / 300


def test_a_split_whose_prefill_worker_idles_goes_colocated():
    v = advise(obs(
        tpot_p90_s=0.4, workers={"prefill": 1, "decode": 1},
        busy={"prefill/0": 0.2, "decode/1": 0.99},
    ))  # fmt: skip
    assert v.bound == "decode" and "--decode-workers 2 without --prefill-workers" in joined(v)


def test_both_phases_over_says_more_devices_and_picks_the_worse():
    v = advise(obs(ttft_p90_s=3.0, tpot_p90_s=0.6, busy={"both/0": 0.99}))
    assert v.bound == "decode" and "more devices" in v.summary  # 4x over TPOT, 1.5x over TTFT


def test_evidence_carries_the_numbers():
    v = advise(obs(ttft_p90_s=5.0))
    text = v.text()
    assert "TTFT p50 300 ms, p90 5000 ms (target 2000 ms)" in text
    assert "both/0 50%" in text and "decode batch 4.0" in text


def record(i, ttft, tpot, n=33, server_ttft=None) -> RequestRecord:
    t0 = float(i)
    first = t0 + ttft
    timings = None if server_ttft is None else {"ttft_ms": server_ttft * 1e3, "queue_ms": 10.0}
    return RequestRecord(
        index=i, input_len=100, output_len=n, prompt_len=100, t_scheduled=t0, t_arrive=t0,
        t_first=first, token_times=[first + k * tpot for k in range(n)],
        t_end=first + (n - 1) * tpot, status=COMPLETED, completion_tokens=n,
        server_timings=timings,
    )  # fmt: skip


def test_bench_records_give_client_latencies_and_time_outside_the_engine():
    records = [record(i, ttft=2.5, tpot=0.2, server_ttft=0.1) for i in range(20)]
    o = from_records(records, 2.0, 0.15)
    assert o.num_finished == 20
    assert o.ttft_p50_s == pytest.approx(2.5) and o.tpot_p90_s == pytest.approx(0.2)
    assert o.outside_ttft_p50_s == pytest.approx(2.4)
    assert o.queue_mean_s == pytest.approx(0.01)
    # Little's law: each request lasts 8.9 s, one arrives a second
    assert o.running_mean == pytest.approx(20 * 8.9 / o.window_s)
    assert advise(o).bound == "frontend"  # 96% of the client's TTFT is outside the engine
