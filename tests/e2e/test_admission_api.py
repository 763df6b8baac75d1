"""The chat profile through the API: over-long prompts keep their last tokens (and say so in
`usage`), a request predicted to miss its deadline is refused at once with 503 + Retry-After, and
the SLO attainment gauges and rejection counter are exported."""

from __future__ import annotations

import json
import threading

import httpx
import pytest
from server_harness import start_server, wait_until

pytestmark = pytest.mark.slow  # a server of its own: keeps the default run under 5 minutes
CONTEXT = 512  # stories260K
BOS = 1


@pytest.fixture(scope="module")
def chat_server(stories_path):
    # one running request at a time: a test can hold requests in the queue
    s = start_server(
        stories_path, "--served-model-name", "stories", "--profile", "chat", "--max-num-seqs", "1"
    )
    yield s
    s.stop()


def complete(server, **body) -> httpx.Response:
    body = {"model": "stories", "temperature": 0, **body}
    return httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)


def test_an_over_long_prompt_keeps_its_last_tokens_and_reports_the_cut(chat_server):
    long_prompt = [BOS] + [3 + i % 500 for i in range(599)]  # 600 tokens: over the context
    r = complete(chat_server, prompt=long_prompt, max_tokens=8, echo=True)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    kept = CONTEXT - 8  # room left for max_tokens
    assert usage["prompt_tokens"] == kept
    assert usage["prompt_tokens_details"]["truncated_tokens"] == 600 - kept
    # the same as sending the BOS and the most recent tokens ourselves
    cut = [BOS] + long_prompt[-(kept - 1) :]
    expected = complete(chat_server, prompt=cut, max_tokens=8, echo=True)
    assert expected.json()["usage"]["prompt_tokens"] == kept
    assert "truncated_tokens" not in expected.json()["usage"]["prompt_tokens_details"]
    assert r.json()["choices"][0]["text"] == expected.json()["choices"][0]["text"]


def test_truncation_applies_to_chat_and_streams_report_it_too(chat_server):
    words = " ".join(f"word{i}" for i in range(400))  # far more than 512 tokens
    body = {
        "model": "stories",
        "messages": [{"role": "user", "content": words}],
        "max_tokens": 4,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", f"{chat_server.url}/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line.startswith("data: {")]
    usage = json.loads(lines[-1][6:])["usage"]
    assert usage["prompt_tokens"] <= CONTEXT - 4
    assert usage["prompt_tokens_details"]["truncated_tokens"] > 0


def test_a_request_predicted_past_its_deadline_is_refused_at_once(chat_server):
    prompt = [BOS] + [3 + i % 500 for i in range(400)]
    assert complete(chat_server, prompt=prompt, max_tokens=2).status_code == 200  # a rate now
    # A request with nothing queued ahead is always admitted (refusing it helps nobody).
    alone = complete(chat_server, prompt=prompt[:-1] + [8], max_tokens=2, deadline_ms=1)
    assert alone.status_code == 200, alone.text
    # Hold requests in the queue: one long generation runs, seven wait behind it (on the fused
    # decode step each takes a fraction of a second: enough of them keep a queue for a while).
    long_run = {"prompt": [BOS, 5], "max_tokens": 500, "ignore_eos": True}
    threads = [
        threading.Thread(target=complete, args=(chat_server,), kwargs=long_run) for _ in range(8)
    ]
    for t in threads:
        t.start()
    wait_until(lambda: chat_server.metric("pdserve_num_requests_waiting") >= 2, "a queue")
    # 401 prompt tokens behind a queue cannot get their first token within a millisecond
    r = complete(chat_server, prompt=prompt[:-1] + [9], max_tokens=2, deadline_ms=1)
    assert r.status_code == 503, r.text
    err = r.json()["error"]
    assert err["code"] == "ttft_slo_unattainable" and "predicted" in err["message"]
    assert int(r.headers["retry-after"]) >= 1
    ok = complete(chat_server, prompt=prompt[:-1] + [10], max_tokens=2, deadline_ms=600_000)
    assert ok.status_code == 200
    for t in threads:
        t.join()
    metrics = httpx.get(f"{chat_server.url}/metrics").text
    assert 'pdserve_requests_rejected_total{reason="slo"} 1.0' in metrics
    assert 'pdserve_slo_attainment_ratio{phase="ttft"}' in metrics
    assert 'pdserve_slo_attainment_ratio{phase="tpot"}' in metrics


def test_priority_and_deadline_fields_are_checked(chat_server):
    for bad in ({"priority": "high"}, {"priority": 2**31}, {"deadline_ms": 0}):
        r = complete(chat_server, prompt="Once", max_tokens=1, **bad)
        assert r.status_code == 400, bad
        assert r.json()["error"]["param"] == next(iter(bad))
    assert complete(chat_server, prompt="Once", max_tokens=1, priority=-3).status_code == 200
