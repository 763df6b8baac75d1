"""`pdserve bench` against a live `pdserve serve` (stories260K): the server sees the intended
lengths, the forced output lengths hold, and shared Mooncake hash ids become real cache hits."""

from __future__ import annotations

import json

import pytest

from pdserve.cli import main


@pytest.fixture(scope="module")
def live(server):
    return server  # the shared server, serving stories260K as "stories"


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_the_server_sees_the_intended_input_and_output_lengths(
    live, tmp_path, endpoint, stories_path
):
    out = tmp_path / "run.json"
    argv = ["bench", "--base-url", live.url, "--endpoint", endpoint, "--num-requests", "6",
            "--input-len", "60", "--output-len", "8", "--length-dist", "uniform",
            "--request-rate", "20", "--slo", "ttft_ms=60000", "--output", str(out)]  # fmt: skip
    assert main(argv) == 0
    data = json.loads(out.read_text())
    requests = data["requests"]
    assert data["summary"]["completed"] == 6 and data["summary"]["slo_attainment"] == 1.0
    assert [r["prompt_tokens"] for r in requests] == [r["input_len"] for r in requests]
    assert [r["completion_tokens"] for r in requests] == [r["output_len"] for r in requests]
    assert all(len(r["token_times"]) >= 1 for r in requests)
    # found through /v1/models: the served name, and the folder (its "root") for the tokenizer
    assert data["config"]["model"] == "stories"
    assert data["config"]["tokenizer"] == stories_path
    live.wait_idle()


def test_shared_hash_ids_are_prefix_cache_hits_on_the_server(live, tmp_path):
    rows = [
        {"timestamp": 0, "input_length": 2048, "output_length": 32, "hash_ids": [10, 11, 12, 13]},
        {"timestamp": 1, "input_length": 2048, "output_length": 32, "hash_ids": [10, 11, 14, 15]},
        {"timestamp": 2, "input_length": 2048, "output_length": 32, "hash_ids": [20, 21, 22, 23]},
    ]
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "run.json"
    argv = ["bench", "--base-url", live.url, "--trace", str(trace), "--length-scale", "0.0625",
            "--max-concurrency", "1", "--output", str(out)]  # fmt: skip
    assert main(argv) == 0
    first, sharing, other = json.loads(out.read_text())["requests"]
    assert first["prompt_tokens"] == sharing["prompt_tokens"] == other["prompt_tokens"] == 128
    block = 32  # 512 tokens per hash id, scaled by 1/16
    cached = [r["server_timings"]["cached_prompt_tokens"] for r in (first, sharing, other)]
    assert cached[0] == cached[2] == 0
    assert 0 < cached[1] <= 1 + 2 * block  # BOS + the two shared blocks at most
    live.wait_idle()
