"""Scrapes of /metrics and windows over them: what counters grew, histogram quantiles, gauges."""

from __future__ import annotations

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from pdserve.frontend.metrics import LATENCY_BUCKETS, ServerMetrics
from pdserve.planner.observation import from_window
from pdserve.planner.scrape import Scrape, Window


def scrape(registry, t: float) -> Scrape:
    return Scrape.of_families(registry.collect(), t)


def test_text_and_registry_give_the_same_samples():
    m = ServerMetrics()
    m.ttft.labels("both", "0").observe(0.3)
    m.requests.labels("both", "0", "stop").inc()
    from_registry = scrape(m.registry, 0.0)
    from_text = Scrape.parse(m.render().decode(), 0.0)
    names = [n for n in from_registry.by_name if n.startswith("pdserve_")]
    assert names
    for name in names:
        assert from_text.series(name) == from_registry.series(name), name


def test_text_that_is_not_prometheus_is_a_value_error():
    with pytest.raises(ValueError, match="not Prometheus text"):
        Scrape.parse("pdserve_x{le=0.1 oops\n", 0.0)


def test_histogram_quantiles_fall_in_the_bucket_of_the_true_quantile():
    r = CollectorRegistry()
    h = Histogram("lat_seconds", "x", buckets=LATENCY_BUCKETS, registry=r)
    h.observe(100.0)  # before the window: not counted
    before = scrape(r, 0.0)
    values = np.random.default_rng(0).lognormal(-2.0, 1.0, 2000)
    for v in values:
        h.observe(float(v))
    hist = Window([before, scrape(r, 10.0)]).histogram("lat_seconds")
    assert hist.count == 2000
    assert hist.mean == pytest.approx(values.mean())
    edges = (0.0, *LATENCY_BUCKETS, float("inf"))
    for q in (0.5, 0.9, 0.99):
        true = float(np.quantile(values, q))
        i = np.searchsorted(edges, true)
        assert edges[i - 1] <= hist.quantile(q) <= edges[i], (q, true, hist.quantile(q))


def test_an_empty_histogram_has_no_quantile():
    r = CollectorRegistry()
    Histogram("lat_seconds", "x", registry=r)
    hist = Window([scrape(r, 0.0), scrape(r, 1.0)]).histogram("lat_seconds")
    assert hist.quantile(0.5) is None and hist.mean is None


def test_a_restarted_series_counts_from_zero_and_labels_select():
    r = CollectorRegistry()
    c = Counter("steps", "x", ("worker",), registry=r)
    c.labels("0").inc(10)
    c.labels("1").inc(5)
    first = scrape(r, 0.0)
    c.labels("0").inc(3)
    c.remove("1")  # worker 1 restarted: its counter starts again
    c.labels("1").inc(2)
    w = Window([first, scrape(r, 1.0)])
    assert w.increase("steps_total", worker="0") == 3
    assert w.increase("steps_total", worker="1") == 2
    assert w.increases_by("steps_total", "worker") == {"0": 3, "1": 2}


def test_gauges_average_or_peak_over_the_scrapes():
    r = CollectorRegistry()
    g = Gauge("running", "x", ("worker",), registry=r)
    scrapes = []
    for t, (a, b) in enumerate([(1, 2), (3, 4), (5, 0)]):
        g.labels("0").set(a)
        g.labels("1").set(b)
        scrapes.append(scrape(r, float(t)))
    w = Window(scrapes)
    assert w.gauge("running") == pytest.approx((3 + 7 + 5) / 3)
    assert w.gauge("running", how="max") == 7
    assert w.gauge_by("running", "worker") == {"0": 3, "1": 2}
    assert w.gauge("absent") is None


def test_an_observation_reads_the_servers_own_metric_names():
    """Everything the advisor reads of a window comes from ServerMetrics' real names."""
    m = ServerMetrics()
    lab = ("both", "0")
    m.workers_by_role.labels("both").set(1)
    scrapes = [scrape(m.registry, 0.0)]
    for t in range(1, 11):
        for _ in range(4):  # 4 decode steps of 50 ms a second, 8 sequences each
            m.step.labels(*lab, "decode").observe(0.05)
            m.scheduled.labels(*lab, "decode").inc(8)
        m.step.labels(*lab, "prefill").observe(0.3)
        m.scheduled.labels(*lab, "prefill").inc(512)
        m.ttft.labels(*lab).observe(0.4)
        m.tpot.labels(*lab).observe(0.055)
        m.queue.labels(*lab).observe(0.1)
        m.prefill.labels(*lab).observe(0.3)
        m.requests.labels(*lab, "length").inc()
        m.running.labels(*lab).set(8)
        m.kv_usage.labels(*lab).set(0.1 * t)
        scrapes.append(scrape(m.registry, float(t)))
    obs = from_window(Window(scrapes), 2.0, 0.15)
    assert obs.num_finished == 10 and obs.request_rate == pytest.approx(1.0)
    assert obs.busy == {"both/0": pytest.approx(0.5)}
    assert obs.step_mean_s == {"decode": pytest.approx(0.05), "prefill": pytest.approx(0.3)}
    assert obs.phase_share("prefill") == pytest.approx(0.6)
    assert obs.decode_batch_mean == pytest.approx(8)
    assert obs.prefill_tokens_per_s == pytest.approx(512)
    assert obs.queue_mean_s == pytest.approx(0.1) and obs.prefill_mean_s == pytest.approx(0.3)
    assert 0.3 <= obs.ttft_p50_s <= 0.5 and 0.05 <= obs.tpot_p90_s <= 0.06
    assert obs.running_mean == pytest.approx(8)  # over the scrapes that have the gauge
    assert obs.kv_usage_max == pytest.approx(1.0)
    assert obs.workers == {"both": 1}
    assert obs.frontend_cpu_cores is not None and obs.frontend_cpu_cores >= 0
    assert b"process_cpu_seconds_total" in generate_latest(m.registry)
