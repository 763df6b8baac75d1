"""`pdserve bench` end to end against a fake server: the summary is what the raw records say,
sweeps and plots are written, Ctrl-C saves the results so far, and user errors are one line."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from pdserve.bench.fake_server import FakeServer, FakeServerConfig
from pdserve.cli import main

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def server(stories_path):
    config = FakeServerConfig(
        ttft_s=0.02, itl_s=0.004, model_root=stories_path, faults={2: "http500", 5: "drop_mid"}
    )
    with FakeServer(config) as s:
        yield s


def recompute(requests: list[dict], slo: dict) -> dict:
    """The summary figures, derived again from the raw records with the documented definitions."""
    sent = [r for r in requests if r["status"] != "cancelled"]
    ok = [r for r in sent if r["status"] == "completed"]
    duration = max(r["t_end"] for r in sent) - min(r["t_arrive"] for r in sent)

    def n_out(r):
        return (
            r["completion_tokens"] if r["completion_tokens"] is not None else len(r["token_times"])
        )

    def n_in(r):
        return r["prompt_tokens"] if r["prompt_tokens"] is not None else r["prompt_len"]

    ttft = [r["t_first"] - r["t_arrive"] for r in ok]
    itl = [b - a for r in ok for a, b in zip(r["token_times"], r["token_times"][1:])]
    tpot = [(r["t_end"] - r["t_first"]) / (n_out(r) - 1) for r in ok if n_out(r) > 1]
    e2e = [r["t_end"] - r["t_arrive"] for r in ok]

    def meets(r):
        tp = (r["t_end"] - r["t_first"]) / (n_out(r) - 1) if n_out(r) > 1 else 0.0
        return (
            (r["t_first"] - r["t_arrive"]) * 1000 <= slo.get("ttft_ms", np.inf)
            and tp * 1000 <= slo.get("tpot_ms", np.inf)
            and (r["t_end"] - r["t_arrive"]) * 1000 <= slo.get("e2e_ms", np.inf)
        )

    def stats(values):
        ms = np.array(values) * 1000
        return {
            "mean": ms.mean(),
            **dict(zip(("p50", "p90", "p99"), np.percentile(ms, [50, 90, 99]))),
        }

    meeting = sum(meets(r) for r in ok)
    return {
        "completed": len(ok),
        "failed": len(sent) - len(ok),
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "input_throughput": sum(n_in(r) for r in ok) / duration,
        "output_throughput": sum(n_out(r) for r in ok) / duration,
        "ttft_ms": stats(ttft),
        "itl_ms": stats(itl),
        "tpot_ms": stats(tpot),
        "e2e_ms": stats(e2e),
        "num_meeting_slo": meeting,
        "goodput": meeting / duration,
        "slo_attainment": meeting / len(sent),
    }


def test_every_summary_figure_equals_the_one_recomputed_from_the_raw_records(
    server, tmp_path, capsys
):
    out = tmp_path / "run.json"
    argv = ["bench", "--base-url", server.url, "--num-requests", "12", "--request-rate", "50",
            "--input-len", "40", "--output-len", "6", "--length-dist", "uniform",
            "--slo", "ttft_ms=25,tpot_ms=6", "--output", str(out)]  # fmt: skip
    assert main(argv) == 0
    data = json.loads(out.read_text())
    summary, requests = data["summary"], data["requests"]
    assert len(requests) == 12 and summary["errors"] == {"HTTP 500": 1, "connection dropped": 1}
    expected = recompute(requests, summary["slo"])
    for key, value in expected.items():
        if isinstance(value, dict):
            for stat, v in value.items():
                assert summary[key][stat] == pytest.approx(v, rel=1e-9), (key, stat)
        else:
            assert summary[key] == pytest.approx(value, rel=1e-9), key
    table = capsys.readouterr().out
    assert "Completed requests              10" in table
    assert f"{summary['goodput']:.2f}" in table
    # The prompts were sized with the served model's tokenizer (found through /v1/models).
    assert data["config"]["tokenizer"] == server.config.model_root
    assert all(r["prompt_len"] == r["input_len"] for r in requests)


def test_a_sweep_reports_goodput_per_rate_and_writes_plots(server, tmp_path, capsys):
    out, plots = tmp_path / "sweep.json", tmp_path / "plots"
    argv = ["bench", "--base-url", server.url, "--num-requests", "8", "--input-len", "20",
            "--output-len", "4", "--sweep-rates", "inf,40", "--slo", "ttft_ms=1000",
            "--target-attainment", "0.5", "--output", str(out), "--plot", str(plots),
            "--endpoint", "/v1/chat/completions"]  # fmt: skip
    assert main(argv) == 0
    sweep = json.loads(out.read_text())["sweep"]
    assert [run["request_rate"] for run in sweep["runs"]] == [40.0, "inf"]
    assert sweep["max_rate_meeting_target"] == "inf"  # 6 or 7 of 8 meet at each rate
    assert all(len(run["requests"]) == 8 for run in sweep["runs"])
    assert sorted(p.name for p in plots.iterdir()) == [
        "goodput_vs_rate.png", "latency_vs_rate.png", "tpot_cdf.png", "ttft_cdf.png"
    ]  # fmt: skip
    assert "highest rate with SLO attainment >= 50%: inf req/s" in capsys.readouterr().out


def test_a_trace_replays_with_scaled_lengths(server, tmp_path):
    trace = tmp_path / "t.jsonl"
    rows = [{"timestamp": 10 * i, "input_length": 2000, "output_length": 300,
             "hash_ids": [0, 1, 2, 3 + i]} for i in range(4)]  # fmt: skip
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "run.json"
    argv = ["bench", "--base-url", server.url, "--trace", str(trace), "--length-scale", "0.05",
            "--max-output-len", "5", "--output", str(out)]  # fmt: skip
    assert main(argv) == 0
    requests = json.loads(out.read_text())["requests"]
    assert [(r["input_len"], r["output_len"]) for r in requests] == [(100, 5)] * 4
    assert [r["t_scheduled"] for r in requests] == pytest.approx([0.0, 0.01, 0.02, 0.03])
    words = [b["prompt"].split() for b in server.bodies[1:]]  # the first is the probe
    shared = 3 * round(512 * 0.05)  # hash ids 0, 1, 2 in every request, in scaled blocks
    assert len({" ".join(w[:shared]) for w in words}) == 1
    assert len({" ".join(w[shared:]) for w in words}) == 4


def run_cli(*args: str, **kw) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "bench", *args],
        capture_output=True, text=True, timeout=60, env=env, cwd=ROOT, **kw,
    )  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--trace", "{tmp}/missing.csv"], "trace file not found"),
        (["--trace", "{tmp}/bad.csv"], "unknown columns ['when', 'prompt']"),
        (["--trace", "{tmp}/bad.jsonl"], "line 1: not valid JSON"),
        (["--base-url", "http://127.0.0.1:{port}"], "cannot reach the server"),
        (["--slo", "ttft=3"], "--slo item"),
        (["--sweep-rates", "1,fast"], "--sweep-rates item"),
        (["--extra-body", "[1]"], "--extra-body"),
    ],
)
def test_user_errors_exit_2_with_one_line_and_no_traceback(tmp_path, args, message):
    (tmp_path / "bad.csv").write_text("when,prompt\n1,2\n")
    (tmp_path / "bad.jsonl").write_text("{nope\n")
    args = [a.format(tmp=tmp_path, port=free_port()) for a in args]
    result = run_cli(*args)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith("pdserve bench: error: ")
    assert message in result.stderr and "Traceback" not in result.stderr


def test_ctrl_c_prints_and_saves_the_results_so_far(stories_path, tmp_path):
    out = tmp_path / "partial.json"
    config = FakeServerConfig(ttft_s=0.01, itl_s=0.05, model_root=stories_path)
    with FakeServer(config) as server:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        proc = subprocess.Popen(
            [sys.executable, "-m", "pdserve.cli", "bench", "--base-url", server.url,
             "--num-requests", "100", "--request-rate", "20", "--output-len", "10",
             "--input-len", "16", "--output", str(out)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT,
        )  # fmt: skip
        deadline = time.monotonic() + 60
        while server.num_finished < 4 and time.monotonic() < deadline:  # probe + 3
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 130, stderr
    assert "interrupted" in stderr and "Traceback" not in stderr
    data = json.loads(out.read_text())
    assert data["interrupted"] is True and len(data["requests"]) == 100
    statuses = {r["status"] for r in data["requests"]}
    assert "cancelled" in statuses and data["summary"]["completed"] >= 1
    assert f"Completed requests              {data['summary']['completed']}" in stdout


@pytest.mark.parametrize("args", [["--help"], ["compare", "--help"]])
def test_help_pages_print(args, capsys):
    with pytest.raises(SystemExit) as info:
        main(["bench", *args])
    assert info.value.code == 0 and "--sweep-rates" in capsys.readouterr().out
