"""Specification of `pdserve.bench.report` and deployment files: tables, JSON, plots."""

from __future__ import annotations

import json
import math
import sys

import pytest

from pdserve.bench.compare import load_deployment
from pdserve.bench.errors import BenchError
from pdserve.bench.metrics import COMPLETED, FAILED, RequestRecord, Slo, summarize
from pdserve.bench.report import (
    comparison_table,
    plot_cdfs,
    plot_sweeps,
    summary_table,
    sweep_table,
    write_json,
)
from pdserve.bench.runner import RunResult


def records(ttft_s: float = 0.1) -> list[RequestRecord]:
    ok = [
        RequestRecord(
            i,
            10,
            3,
            10,
            i * 0.1,
            i * 0.1,
            i * 0.1 + ttft_s,
            [i * 0.1 + ttft_s + k * 0.02 for k in range(3)],
            i * 0.1 + ttft_s + 0.04,
            COMPLETED,
        )  # fmt: skip
        for i in range(10)
    ]
    bad = RequestRecord(10, 10, 3, 10, 1.0, 1.0, t_end=1.1, status=FAILED, error="HTTP 500")
    return [*ok, bad]


SLO = Slo(ttft_ms=150, tpot_ms=30)


def test_summary_table_shows_counts_errors_latencies_and_goodput():
    text = summary_table(summarize(records(), SLO), "title line")
    assert text.splitlines()[0] == "title line"
    assert "Completed requests              10" in text
    assert "(HTTP 500: 1)" in text
    assert "ttft_ms<=150, tpot_ms<=30" in text
    ttft_row = next(line for line in text.splitlines() if line.startswith("TTFT"))
    assert ttft_row.split()[1:] == ["100.00"] * 4
    assert "90.9% (10 of 11)" in text


def test_comparison_table_has_a_column_per_deployment():
    text = comparison_table({"fast": summarize(records(0.1), SLO), "gone": None})
    header, *rows = text.splitlines()
    assert header.split() == ["fast", "gone"]
    ttft_p50 = next(r for r in rows if r.startswith("TTFT p50"))
    assert ttft_p50.split()[-2:] == ["100.00", "-"]


def test_sweep_table_names_the_highest_rate_meeting_the_target():
    runs = [RunResult(records(), summarize(records(), SLO), request_rate=r) for r in (1.0, 2.0)]
    text = sweep_table(runs, 0.9, 2.0)
    assert "highest rate with SLO attainment >= 90%: 2 req/s" in text
    assert len(text.splitlines()) == 4


def test_json_keeps_one_line_per_request_and_writes_infinity_as_a_string(tmp_path):
    run = RunResult(records(), summarize(records(), SLO), request_rate=math.inf)
    path = write_json(tmp_path / "out" / "r.json", {"run": run.to_dict()})
    data = json.loads(path.read_text())
    assert data["format_version"] == 1 and data["run"]["request_rate"] == "inf"
    assert [RequestRecord.from_dict(r) for r in data["run"]["requests"]] == records()
    assert sum('"index":' in line for line in path.read_text().splitlines()) == 11


def test_plots_are_written_as_png(tmp_path):
    runs = [
        RunResult(records(), summarize(records(), SLO), request_rate=r) for r in (1.0, math.inf)
    ]
    paths = plot_cdfs(tmp_path, {"a": records(), "b": records(0.2)}, SLO)
    paths += plot_sweeps(tmp_path, {"a": runs})
    names = sorted(p.name for p in paths)
    assert names == ["goodput_vs_rate.png", "latency_vs_rate.png", "tpot_cdf.png", "ttft_cdf.png"]
    assert all(p.read_bytes()[:4] == b"\x89PNG" for p in paths)


def test_deployment_files_in_json_and_yaml(tmp_path):
    (tmp_path / "a.json").write_text(
        json.dumps(
            {
                "serve": "pdserve serve --model 'my dir' --port 8011",
                "base_url": "http://127.0.0.1:8011/v1/",
                "env": {"X": 1},
            }
        )  # fmt: skip
    )
    dep = load_deployment(tmp_path / "a.json")
    assert dep.name == "a" and dep.base_url == "http://127.0.0.1:8011"
    assert dep.serve == ("pdserve", "serve", "--model", "my dir", "--port", "8011")
    assert dep.env == {"X": "1"} and dep.health_url == "http://127.0.0.1:8011/health"
    pytest.importorskip("yaml")
    (tmp_path / "b.yaml").write_text(
        "name: disagg\nserve: [pdserve, serve]\nbase_url: http://h:1\nstartup_timeout_s: 5\n"
    )
    dep = load_deployment(tmp_path / "b.yaml")
    assert (dep.name, dep.serve, dep.startup_timeout_s) == ("disagg", ("pdserve", "serve"), 5.0)


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("a.json", '{"serve": "x"}', "missing base_url"),
        ("a.json", '{"base_url": "http://h:1", "port": 1}', "unknown keys"),
        ("a.json", '{"base_url": "h:1"}', "must start with http"),
        ("a.json", "[1]", "expected a mapping"),
        ("a.json", "{oops", "not valid JSON"),
        ("a.json", '{"base_url": "http://h:1", "serve": 3}', "serve must be"),
        ("a.yaml", "base_url: [unclosed", "not valid YAML"),
    ],
)
def test_bad_deployment_files_raise_one_line_errors(tmp_path, name, text, message):
    if name.endswith(".yaml"):
        pytest.importorskip("yaml")
    (tmp_path / name).write_text(text)
    with pytest.raises(BenchError, match=message) as info:
        load_deployment(tmp_path / name)
    assert "\n" not in str(info.value)


def test_yaml_without_pyyaml_asks_for_json(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "yaml", None)  # as if PyYAML were not installed
    (tmp_path / "a.yaml").write_text("base_url: http://h:1\n")
    with pytest.raises(BenchError, match="PyYAML is not installed; write the file as JSON"):
        load_deployment(tmp_path / "a.yaml")
    with pytest.raises(BenchError, match="not found"):
        load_deployment(tmp_path / "missing.json")


def test_progress_bar_draws_only_when_enabled():
    import io

    from pdserve.bench.progress import Progress

    ok, bad = records()[0], records()[-1]
    shown = io.StringIO()
    bar = Progress(2, "run", enabled=True, stream=shown)
    bar.update(ok)
    bar.update(bad)
    bar.close()
    assert "run [" in shown.getvalue() and "2/2 (1 failed)" in shown.getvalue()
    hidden = io.StringIO()  # not a terminal: nothing drawn by default
    bar = Progress(2, stream=hidden)
    bar.update(ok)
    bar.close()
    assert hidden.getvalue() == ""
