"""Specification of the benchmark client against a fake streaming server with known delays."""

from __future__ import annotations

import asyncio
import socket

import pytest

from pdserve.bench.client import ClientConfig, resolve_target, run_requests
from pdserve.bench.errors import BenchError
from pdserve.bench.fake_server import FakeServer, FakeServerConfig
from pdserve.bench.metrics import CANCELLED, COMPLETED, FAILED, summarize
from pdserve.bench.workload import BenchRequest

TTFT_S, ITL_S = 0.08, 0.02
# The client sees a little more than the injected delay (connection setup, scheduling); a
# loaded machine adds more to single requests, so per-request bounds are looser than medians.
MEDIAN_SLACK_S, WORST_SLACK_S = 0.025, 0.1


@pytest.fixture
def server():
    with FakeServer(FakeServerConfig(ttft_s=TTFT_S, itl_s=ITL_S)) as s:
        yield s


def make_requests(n: int, output_len: int = 10, gap_s: float = 0.02) -> list[BenchRequest]:
    return [BenchRequest(i, i * gap_s, 8, output_len, "one two three", 8) for i in range(n)]


def run(server: FakeServer, requests, **kw):
    stop = kw.pop("stop_after_s", None)
    max_concurrency = kw.pop("max_concurrency", None)
    cfg = ClientConfig(server.url, "fake-model", **kw)

    async def main():
        event = asyncio.Event()
        if stop is not None:
            asyncio.get_running_loop().call_later(stop, event.set)
        return await run_requests(requests, cfg, max_concurrency, event)

    return asyncio.run(main())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_measured_ttft_and_itl_match_the_injected_delays(server, endpoint):
    records = run(server, make_requests(8, output_len=20), endpoint=endpoint)
    assert all(r.status == COMPLETED for r in records)
    for r in records:
        assert TTFT_S <= r.ttft <= TTFT_S + WORST_SLACK_S
        assert len(r.token_times) == r.num_output_tokens == 20
    summary = summarize(records)
    assert TTFT_S * 1000 <= summary["ttft_ms"]["p50"] <= (TTFT_S + MEDIAN_SLACK_S) * 1000
    assert summary["itl_ms"]["mean"] == pytest.approx(ITL_S * 1000, abs=3)
    assert summary["itl_ms"]["p50"] == pytest.approx(ITL_S * 1000, abs=5)
    assert summary["tpot_ms"]["p50"] == pytest.approx(ITL_S * 1000, abs=3)


def test_failed_requests_are_counted_and_the_run_goes_on():
    faults = {1: "http500", 2: "http400", 3: "drop", 4: "drop_mid"}
    with FakeServer(FakeServerConfig(ttft_s=0.01, itl_s=0.002, faults=faults)) as server:
        records = run(server, make_requests(10, gap_s=0.01))
    summary = summarize(records)
    assert (summary["completed"], summary["failed"]) == (6, 4)
    assert summary["errors"] == {"connection dropped": 2, "HTTP 500": 1, "HTTP 400": 1}
    bad = [r for r in records if r.status == FAILED]
    assert all(r.t_end is not None and r.error_detail for r in bad)
    assert any("injected http500" in r.error_detail for r in bad)


def test_requests_ask_for_streaming_usage_and_a_forced_output_length(server):
    run(server, make_requests(1, output_len=3), extra_body={"top_k": 5})
    run(server, make_requests(1, output_len=4), endpoint="chat", force_output_len=False)
    completion, chat = server.bodies
    assert completion["prompt"] == "one two three" and completion["max_tokens"] == 3
    assert completion["stream"] and completion["stream_options"] == {"include_usage": True}
    assert completion["ignore_eos"] and completion["min_tokens"] == 3 and completion["top_k"] == 5
    assert chat["messages"] == [{"role": "user", "content": "one two three"}]
    assert "ignore_eos" not in chat and "min_tokens" not in chat


def test_token_counts_come_from_usage_when_sent_else_from_the_stream():
    with FakeServer(FakeServerConfig(ttft_s=0.005, itl_s=0.001)) as server:
        (with_usage,) = run(server, make_requests(1, output_len=5))
    with FakeServer(FakeServerConfig(ttft_s=0.005, itl_s=0.001, send_usage=False)) as server:
        (without,) = run(server, make_requests(1, output_len=5))
    assert (with_usage.completion_tokens, with_usage.prompt_tokens) == (5, 4)
    assert without.completion_tokens is None and without.num_output_tokens == 5
    assert without.num_input_tokens == without.prompt_len == 8


def test_max_concurrency_caps_the_requests_in_flight(server):
    records = run(server, make_requests(6, output_len=3, gap_s=0.0), max_concurrency=2)
    events = sorted([(r.t_arrive, 1) for r in records] + [(r.t_end, -1) for r in records])
    in_flight = peak = 0
    for _, step in events:
        in_flight += step
        peak = max(peak, in_flight)
    assert peak == 2 and all(r.status == COMPLETED for r in records)


def test_a_stop_cancels_what_is_in_flight_and_keeps_what_finished(server):
    short = BenchRequest(0, 0.0, 8, 2, "a", 8)  # done in ~0.1 s
    long = [BenchRequest(i, 0.05, 8, 100, "a", 8) for i in (1, 2, 3)]  # ~2 s each
    late = [BenchRequest(i, 5.0, 8, 2, "a", 8) for i in (4, 5)]  # due after the stop
    records = run(server, [short, *long, *late], stop_after_s=0.5)
    assert [r.status for r in records] == [COMPLETED] + [CANCELLED] * 5
    assert all(r.t_arrive is not None for r in records[:4])  # sent, then cancelled
    assert all(r.t_arrive is None for r in records[4:])  # never sent
    assert summarize(records)["completed"] == 1 and summarize(records)["failed"] == 0


def test_an_unreachable_server_is_a_one_line_error():
    with pytest.raises(BenchError, match="cannot reach the server") as info:
        resolve_target(f"http://127.0.0.1:{free_port()}", None, None, None)
    assert "\n" not in str(info.value)


def test_requests_to_a_dead_server_fail_without_raising():
    cfg = ClientConfig(f"http://127.0.0.1:{free_port()}", "m")
    records = asyncio.run(run_requests(make_requests(3), cfg))
    assert {r.error for r in records} == {"connect error"}


def test_model_and_tokenizer_are_resolved_from_v1_models(tmp_path):
    config = FakeServerConfig(model="org/model", model_root=str(tmp_path))
    with FakeServer(config) as server:
        assert resolve_target(server.url, None, None, None) == ("org/model", str(tmp_path))
        assert resolve_target(server.url, "x", "/tok", None) == ("x", "/tok")
    with (
        FakeServer(FakeServerConfig(model="org/model")) as server,
        pytest.raises(BenchError, match="pass --tokenizer"),
    ):
        resolve_target(server.url, None, None, None)
