"""Specification of `pdserve.bench.metrics` and `sweep`: latencies, goodput and attainment on
hand-built records, edge cases included."""

from __future__ import annotations

import pytest

from pdserve.bench.metrics import (
    CANCELLED,
    COMPLETED,
    FAILED,
    RequestRecord,
    Slo,
    latency_stats,
    summarize,
)
from pdserve.bench.sweep import max_rate_meeting, parse_rates


def done(t_arrive: float, chunks: list[float], t_end: float | None = None, **kw) -> RequestRecord:
    """A completed request whose token chunks arrived at `chunks` (seconds)."""
    return RequestRecord(
        index=kw.pop("index", 0), input_len=10, output_len=len(chunks), prompt_len=10,
        t_scheduled=t_arrive, t_arrive=t_arrive, t_first=chunks[0], token_times=list(chunks),
        t_end=chunks[-1] if t_end is None else t_end, status=COMPLETED, **kw,
    )  # fmt: skip


def failed(t_arrive: float, t_end: float, error: str = "HTTP 500") -> RequestRecord:
    return RequestRecord(0, 10, 5, 10, t_arrive, t_arrive, t_end=t_end, status=FAILED, error=error)


def test_latencies_follow_the_definitions():
    r = done(1.0, [1.2, 1.25, 1.4, 1.5], t_end=1.6)
    assert r.ttft == pytest.approx(0.2)
    assert r.itl == pytest.approx([0.05, 0.15, 0.1])
    assert r.tpot == pytest.approx((1.6 - 1.2) / 3)
    assert r.e2e == pytest.approx(0.6)


def test_output_tokens_come_from_usage_when_present_else_from_chunks():
    r = done(0.0, [0.1, 0.2], t_end=0.5)
    assert r.num_output_tokens == 2 and r.tpot == pytest.approx(0.4)
    r.completion_tokens = 5  # several tokens per chunk
    assert r.num_output_tokens == 5 and r.tpot == pytest.approx(0.1)
    r.prompt_tokens = 12
    assert r.num_input_tokens == 12


def test_one_output_token_has_no_tpot_and_meets_any_tpot_slo():
    r = done(0.0, [0.1])
    assert r.tpot is None and r.itl == []
    assert Slo(ttft_ms=200, tpot_ms=0.001).met_by(r)
    assert not Slo(ttft_ms=50, tpot_ms=0.001).met_by(r)


def test_slo_targets_are_inclusive_and_failed_requests_never_meet():
    r = done(0.0, [0.2, 0.3], t_end=0.3)
    assert Slo(ttft_ms=200, tpot_ms=100, e2e_ms=300).met_by(r)
    assert not Slo(e2e_ms=299).met_by(r)
    assert not Slo().met_by(failed(0.0, 0.1))


def test_max_itl_target_catches_a_pause_that_tpot_averages_away():
    # 11 tokens 50 ms apart except one 600 ms pause: TPOT 105 ms, longest gap 600 ms
    times = [0.1 + 0.05 * i for i in range(5)] + [0.9 + 0.05 * i for i in range(6)]
    r = done(0.0, times)
    assert r.tpot == pytest.approx(0.105)
    assert Slo(tpot_ms=110).met_by(r)
    assert not Slo(tpot_ms=110, max_itl_ms=599).met_by(r)
    assert Slo(max_itl_ms=600).met_by(r)
    assert Slo(max_itl_ms=1).met_by(done(0.0, [0.1]))  # one token: no gap to bound
    assert Slo.parse("max_itl_ms=500") == Slo(max_itl_ms=500)
    assert not Slo(max_itl_ms=500).is_empty


def test_summary_on_hand_built_records():
    records = [
        done(0.0, [0.1, 0.2, 0.3], completion_tokens=3, prompt_tokens=7),  # ttft 100, tpot 100
        done(0.5, [0.9, 1.0], completion_tokens=2, prompt_tokens=9),  # ttft 400, tpot 100
        done(1.0, [1.1]),  # one token: ttft 100, no tpot
        failed(1.0, 2.0, "HTTP 500"),
        failed(1.5, 1.6, "connection dropped"),
        RequestRecord(9, 10, 5, 10, 3.0),  # never sent: cancelled
    ]
    s = summarize(records, Slo(ttft_ms=200, tpot_ms=150))
    assert (s["completed"], s["failed"]) == (3, 2)
    assert s["errors"] == {"HTTP 500": 1, "connection dropped": 1}
    assert s["duration_s"] == pytest.approx(2.0)  # first sent 0.0, last end 2.0
    assert s["request_throughput"] == pytest.approx(1.5)
    assert s["total_input_tokens"] == 7 + 9 + 10
    assert s["output_throughput"] == pytest.approx((3 + 2 + 1) / 2.0)
    assert s["ttft_ms"]["mean"] == pytest.approx(200.0)
    assert s["ttft_ms"]["p50"] == pytest.approx(100.0)
    assert s["tpot_ms"]["mean"] == pytest.approx(100.0)
    assert s["itl_ms"]["mean"] == pytest.approx(100.0)
    assert s["num_meeting_slo"] == 2  # the 400 ms TTFT misses
    assert s["goodput"] == pytest.approx(2 / 2.0)
    assert s["slo_attainment"] == pytest.approx(2 / 5)  # failed count, cancelled do not


def test_no_slo_means_every_completed_request_counts():
    records = [done(0.0, [0.1, 0.2]), failed(0.0, 1.0)]
    s = summarize(records)
    assert s["slo"] == {} and s["goodput"] == s["request_throughput"] == 1.0
    assert s["slo_attainment"] == 0.5


def test_no_completed_requests():
    s = summarize([failed(0.0, 0.5), failed(0.1, 1.0)], Slo(ttft_ms=100))
    assert s["completed"] == 0 and s["failed"] == 2
    assert s["goodput"] == 0.0 and s["slo_attainment"] == 0.0
    assert s["request_throughput"] == 0.0 and s["duration_s"] == pytest.approx(1.0)
    assert all(v is None for v in s["ttft_ms"].values())


def test_no_requests_at_all():
    s = summarize([], Slo(ttft_ms=100))
    assert s["duration_s"] == 0.0 and s["goodput"] == 0.0 and s["slo_attainment"] is None
    s = summarize([RequestRecord(0, 1, 1, 1, 0.0, status=CANCELLED)])
    assert s["completed"] == s["failed"] == 0 and s["slo_attainment"] is None


def test_percentiles_interpolate_linearly():
    stats = latency_stats([0.001 * v for v in range(1, 101)])
    assert stats["mean"] == pytest.approx(50.5)
    assert stats["p50"] == pytest.approx(50.5)
    assert stats["p90"] == pytest.approx(90.1)
    assert stats["p99"] == pytest.approx(99.01)


def test_slo_parsing():
    assert Slo.parse("ttft_ms=200, tpot_ms=50") == Slo(ttft_ms=200, tpot_ms=50)
    assert Slo.parse("e2e_ms=1e4") == Slo(e2e_ms=10000)
    assert Slo.parse(None).is_empty and Slo.parse("").is_empty
    for bad in ("ttft=200", "ttft_ms", "ttft_ms=fast", "tpot_ms=0", "tpot_ms=-5"):
        with pytest.raises(ValueError):
            Slo.parse(bad)


def test_records_round_trip_through_dicts():
    r = done(0.0, [0.1, 0.2], completion_tokens=2)
    assert RequestRecord.from_dict(r.to_dict() | {"unknown": 1}) == r


def test_max_rate_is_the_last_before_attainment_first_drops():
    points = [(1.0, 1.0), (2.0, 0.95), (4.0, 0.8), (8.0, 0.92)]
    assert max_rate_meeting(points, 0.9) == 2.0  # 8 passes by luck after 4 failed
    assert max_rate_meeting(points, 0.7) == 8.0
    assert max_rate_meeting([(1.0, 0.5)], 0.9) is None
    assert max_rate_meeting([(1.0, None)], 0.9) is None
    assert max_rate_meeting([], 0.9) is None


def test_rates_parse_sorted_and_validated():
    assert parse_rates("4, 1,2,inf,2") == [1.0, 2.0, 4.0, float("inf")]
    for bad in ("", "1,x", "0", "-1", "nan"):
        with pytest.raises(ValueError):
            parse_rates(bad)


def test_pure_benchmark_modules_do_not_import_torch():
    import subprocess
    import sys

    code = (
        "import sys; import pdserve.bench.traces, pdserve.bench.workload, pdserve.bench.metrics, "
        "pdserve.bench.sweep; print('torch' in sys.modules, 'transformers' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]
