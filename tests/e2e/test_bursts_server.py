"""A server with bursts (`--num-scheduler-steps 8`) against one without, on the real tiny model.

The same greedy text, streamed in fewer chunks (a burst's tokens travel together); a stop
string met inside a burst cuts the text where the one-step server cuts it; a client that leaves
in the middle of a stream frees everything it held. The engine side is
tests/model/test_burst_decode.py.
"""

from __future__ import annotations

import json

import httpx
import pytest
from server_harness import start_server

# A server of its own (seconds to start): the slow suite; the default run keeps the engine side.
pytestmark = pytest.mark.slow

CMPL = "/v1/completions"
PROMPT = "Once upon a time, there was a little girl named Lily. She"


@pytest.fixture(scope="module")
def bursts(stories_path):
    s = start_server(stories_path, "--served-model-name", "stories", "--num-scheduler-steps", "8")
    yield s
    s.stop()


def body(**kw) -> dict:
    return {"prompt": PROMPT, "max_tokens": 40, "temperature": 0, "ignore_eos": True, **kw}


def stream(server, **kw) -> tuple[str, int, dict]:
    """(the streamed text, how many chunks carried text, the usage)."""
    text, chunks, usage = "", 0, {}
    req = body(stream=True, stream_options={"include_usage": True}, **kw)
    with httpx.stream("POST", server.url + CMPL, json=req, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: ") :])
            if event.get("usage"):
                usage = event["usage"]
            for choice in event.get("choices", []):
                if choice.get("text"):
                    text += choice["text"]
                    chunks += 1
    return text, chunks, usage


def test_the_same_greedy_text_in_fewer_chunks(server, bursts):
    one_text, one_chunks, one_usage = stream(server)
    text, chunks, usage = stream(bursts)
    assert text == one_text and usage["completion_tokens"] == one_usage["completion_tokens"] == 40
    # one chunk per token without bursts; the first token, then bursts of up to 8
    assert chunks <= 1 + 39 // 8 + 1 < one_chunks
    bursts.wait_idle()


def test_a_stop_string_inside_a_burst_cuts_the_text_where_one_step_does(server, bursts):
    full = httpx.post(server.url + CMPL, json=body(), timeout=60).json()["choices"][0]["text"]
    stop = full[len(full) // 2 : len(full) // 2 + 6]  # somewhere inside a later burst
    a = httpx.post(server.url + CMPL, json=body(stop=[stop]), timeout=60).json()["choices"][0]
    b = httpx.post(bursts.url + CMPL, json=body(stop=[stop]), timeout=60).json()["choices"][0]
    assert b["text"] == a["text"] and b["finish_reason"] == a["finish_reason"] == "stop"
    assert stop not in b["text"] and full.startswith(b["text"])
    bursts.wait_idle()


def test_a_client_that_leaves_mid_stream_frees_everything(bursts):
    req = body(max_tokens=400, stream=True, n=4)
    with httpx.stream("POST", bursts.url + CMPL, json=req, timeout=30) as r:
        lines = r.iter_lines()
        for _ in range(6):
            next(lines)
    bursts.wait_idle(timeout_s=15)  # nothing running or waiting, every KV block back
    r = httpx.post(bursts.url + CMPL, json=body(max_tokens=4), timeout=60)
    assert r.status_code == 200


@pytest.mark.slow  # a disaggregated server of its own: seconds to start
def test_a_decode_pool_with_bursts_gives_the_same_text(server, stories_path):
    """1P+1D with bursts on the decode worker only (`--decode-num-scheduler-steps`): the
    prompts' KV crosses from the prefill worker as usual, the decodes run in bursts."""
    pd = start_server(stories_path, "--served-model-name", "stories", "--prefill-workers", "1",
                      "--decode-workers", "1", "--decode-num-scheduler-steps", "8")  # fmt: skip
    try:
        one_text, _, _ = stream(server)
        text, chunks, usage = stream(pd)
        assert text == one_text and usage["completion_tokens"] == 40
        assert chunks <= 1 + 39 // 8 + 1
        pd.wait_idle()
    finally:
        pd.stop()
