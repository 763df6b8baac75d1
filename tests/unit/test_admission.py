"""SLO-aware admission's prediction: exactly the requests predicted past their target are
refused, priorities see only the queue ahead of them, and the rate is measured per worker."""

from __future__ import annotations

import pytest

from pdserve.frontend.admission import PrefillRate, TTFTPredictor


def test_admission_refuses_exactly_the_requests_predicted_past_the_slo():
    ttft = TTFTPredictor(ttft_slo_s=1.0)
    rate = 1000.0  # prompt tokens / s
    verdicts = []
    for i in range(5):  # 300 tokens each: 0.3, 0.6, 0.9 s admitted, then 1.2 s refused
        v = ttft.check(300, priority=0, deadline_s=None, rate=rate)
        verdicts.append(v)
        if v.admit:
            ttft.add(f"r{i}", 300, 0)
    assert [v.admit for v in verdicts] == [True, True, True, False, False]
    assert [round(v.predicted_s, 6) for v in verdicts] == [0.3, 0.6, 0.9, 1.2, 1.2]
    assert verdicts[3].target_s == 1.0 and verdicts[3].retry_after_s == 1
    # exactly at the target is admitted; one token more is not
    assert ttft.check(100, 0, None, rate).admit
    assert not ttft.check(101, 0, None, rate).admit
    ttft.remove("r0")  # a first token came: room again
    assert ttft.check(300, 0, None, rate).admit


def test_a_request_with_nothing_queued_ahead_is_always_admitted():
    """Refusing it would make nobody faster, and its prefill corrects a rate measured low."""
    ttft = TTFTPredictor(ttft_slo_s=1.0)
    alone = ttft.check(5000, 0, None, rate=1000.0)  # 5 s: late, but nobody is ahead
    assert alone.admit and alone.predicted_s == pytest.approx(5.0)
    ttft.add("lax", 10, priority=3)  # behind it in priority: still nobody ahead
    assert ttft.check(5000, 0, None, rate=1000.0).admit
    ttft.add("first", 10, priority=0)
    assert not ttft.check(5000, 0, None, rate=1000.0).admit


def test_a_more_urgent_priority_sees_only_the_queue_ahead_of_it():
    ttft = TTFTPredictor(ttft_slo_s=1.0)
    ttft.add("lax", 5000, priority=5)
    ttft.add("urgent-before", 1, priority=0)
    assert not ttft.check(100, priority=5, deadline_s=None, rate=1000.0).admit
    urgent = ttft.check(100, priority=0, deadline_s=None, rate=1000.0)
    assert urgent.admit and urgent.predicted_s == pytest.approx(0.101)


def test_margin_and_deadlines():
    ttft = TTFTPredictor(ttft_slo_s=1.0, margin=0.5)
    ttft.add("ahead", 1, 0)
    assert ttft.check(1400, 0, None, 1000.0).admit  # 1.4 s <= 1.5 s
    assert not ttft.check(1600, 0, None, 1000.0).admit
    assert not ttft.check(300, 0, deadline_s=0.1, rate=1000.0).admit  # the tighter target
    no_slo = TTFTPredictor(ttft_slo_s=None)
    no_slo.add("ahead", 1, 0)
    assert no_slo.check(10**6, 0, None, 1000.0).admit  # no target: everything admitted
    refused = no_slo.check(2000, 0, deadline_s=0.5, rate=1000.0)  # a deadline still counts
    assert not refused.admit and refused.retry_after_s == 2


def test_without_a_measured_rate_everything_is_admitted():
    ttft = TTFTPredictor(ttft_slo_s=0.001)
    ttft.add("ahead", 10**6, 0)
    v = ttft.check(10**6, 0, None, rate=None)
    assert v.admit and v.predicted_s is None


def test_prefill_rate_is_a_moving_average_per_worker_summed_over_prefilling_workers():
    rate = PrefillRate()
    assert rate.total([0, 1]) is None
    rate.observe(0, 500, 0.5)  # 1000 tok/s
    rate.observe(0, 0, 0.1)  # a decode-only step says nothing about prefill
    rate.observe(1, 200, 0.1)  # 2000 tok/s
    assert rate.total([0]) == pytest.approx(1000.0)
    assert rate.total([0, 1]) == pytest.approx(3000.0)
    rate.observe(0, 1000, 0.5)  # 2000 tok/s moves worker 0 a fifth of the way
    assert rate.total([0]) == pytest.approx(1200.0)
    assert rate.total([2]) is None
