"""Bad input, overload, disconnects, a dead worker and shutdown: clear errors, nothing lost.

After every scenario the server still answers and the worker's KV pool is whole (no block is
referenced once no request runs), read from the server's own metrics.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import threading
import time

import httpx
import pytest
from fuzz import EXAMPLES, fuzz_request_bodies
from hypothesis import strategies as st
from server_harness import start_server

CMPL = "/v1/completions"
CHAT = "/v1/chat/completions"
OK_CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def cmpl(**kw):
    return {"prompt": "Once upon a time", "max_tokens": 4, **kw}


# (path, body or raw bytes, expected status, text the error message must contain)
MALFORMED = [
    (CMPL, b"not json", 400, "malformed JSON"),
    (CMPL, b"{", 400, "malformed JSON"),
    (CMPL, b"[]", 400, "invalid"),
    (CMPL, {"max_tokens": 4}, 400, "missing required field 'prompt'"),
    (CMPL, cmpl(prompt=123), 400, "prompt"),
    (CMPL, cmpl(prompt=""), 400, "empty"),
    (CMPL, cmpl(prompt=[]), 400, "empty"),
    (CMPL, cmpl(prompt=[[]]), 400, "empty"),
    (CMPL, cmpl(prompt=[1, "a"]), 400, "prompt"),
    (CMPL, cmpl(prompt=[-1]), 400, "outside the vocabulary"),
    (CMPL, cmpl(prompt=[999999]), 400, "outside the vocabulary"),
    (CMPL, cmpl(max_tokens="ten"), 400, "max_tokens"),
    (CMPL, cmpl(max_tokens=-5), 400, "max_tokens=-5"),
    (CMPL, cmpl(max_tokens=100000), 400, "max_tokens=100000"),
    (CMPL, cmpl(max_tokens=2.5), 400, "max_tokens"),
    (CMPL, cmpl(temperature=-1), 400, "temperature=-1"),
    (CMPL, cmpl(temperature="hot"), 400, "temperature"),
    (CMPL, cmpl(top_p=0), 400, "top_p=0"),
    (CMPL, cmpl(top_p=1.5), 400, "top_p=1.5"),
    (CMPL, cmpl(n=0), 400, "n=0"),
    (CMPL, cmpl(n="two"), 400, "'n'"),
    (CMPL, cmpl(stream="yes"), 400, "stream"),
    (CMPL, cmpl(stop=5), 400, "stop"),
    (CMPL, cmpl(stop=[""]), 400, "stop"),
    (CMPL, cmpl(logprobs=50), 400, "logprobs=50"),
    (CMPL, cmpl(presence_penalty=5), 400, "presence_penalty=5"),
    (CMPL, cmpl(frequency_penalty=-3), 400, "frequency_penalty=-3"),
    (CMPL, cmpl(top_k=-5), 400, "top_k=-5"),
    (CMPL, cmpl(min_p=2), 400, "min_p=2"),
    (CMPL, cmpl(repetition_penalty=0), 400, "repetition_penalty=0"),
    (CMPL, cmpl(min_tokens=10, max_tokens=4), 400, "min_tokens=10"),
    (CMPL, cmpl(seed="abc"), 400, "seed"),
    (CMPL, cmpl(suffix="x"), 400, "suffix"),
    (CMPL, cmpl(logit_bias={"5": 1.0}), 400, "logit_bias"),
    (CMPL, cmpl(truncate_prompt_tokens=0), 400, "truncate_prompt_tokens"),
    (CMPL, cmpl(stop_token_ids=[-1]), 400, "stop_token_ids"),
    (CMPL, cmpl(prompt="x " * 600), 400, "context"),
    (CMPL, cmpl(model="gpt-4"), 404, "gpt-4"),
    ("/v1/nothing", cmpl(), 404, "no route"),
    (CHAT, {"max_tokens": 4}, 400, "messages"),
    (CHAT, {"messages": []}, 400, "messages"),
    (CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "role"),
    (
        CHAT,
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        400,
        "text content",
    ),
    (CHAT, {"messages": "hi"}, 400, "messages"),
    (CHAT, {**OK_CHAT, "top_logprobs": 99, "logprobs": True}, 400, "invalid top_logprobs"),
    (CHAT, {**OK_CHAT, "top_logprobs": 2}, 400, "invalid top_logprobs: needs logprobs"),
    (CHAT, {**OK_CHAT, "tools": [{"type": "function"}]}, 400, "tools"),
    (CMPL, cmpl(stream_options={"include_usage": True}), 400, "only allowed when stream"),
    (CMPL, cmpl(frobnicate=1), 400, "unsupported field 'frobnicate'"),
    (
        CMPL,
        cmpl(stream_options={"include_usage": True, "x": 1}, stream=True),
        400,
        "'stream_options.x'",
    ),
]


@pytest.mark.parametrize(("path", "body", "status", "message"), MALFORMED)
def test_malformed_requests(server, path, body, status, message):
    if isinstance(body, bytes):
        r = httpx.post(
            server.url + path, content=body, headers={"content-type": "application/json"}
        )
    else:
        r = httpx.post(server.url + path, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert message in err["message"], err
    assert set(err) == {"message", "type", "param", "code"}


def test_wrong_method_and_oversized_body(server):
    assert httpx.get(server.url + CMPL).status_code == 405
    big = json.dumps(cmpl(prompt="a" * (17 << 20)))
    r = httpx.post(server.url + CMPL, content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413 and "limit" in r.json()["error"]["message"]


def test_truncate_prompt_tokens_accepts_long_prompts(server):
    r = httpx.post(server.url + CMPL, json=cmpl(prompt="x " * 600, truncate_prompt_tokens=100))
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 100


JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(10**6), 10**6)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=8,
)


def _short(body: dict) -> dict:
    body.setdefault("max_tokens", 3)  # keep each generated answer short
    return body


@pytest.mark.parametrize("examples", EXAMPLES)
def test_fuzzed_request_bodies_never_500(server, examples):
    """Bodies built from the served schema's field names with values of any JSON type."""
    seen = fuzz_request_bodies(server, JSON_VALUES, examples, _short)
    assert 400 in seen
    r = httpx.post(server.url + CMPL, json=cmpl(temperature=0))
    assert r.status_code == 200 and r.json()["choices"][0]["text"]
    server.wait_idle()


def completed(server) -> float:
    """Requests that ran to their max_tokens (an aborted one never counts here)."""
    return server.metric("pdserve_requests_total", 'finish_reason="length"')


def test_streaming_client_disconnect_aborts_and_frees_blocks(server):
    before = completed(server)
    with httpx.stream(
        "POST", server.url + CMPL, json=cmpl(max_tokens=400, ignore_eos=True, stream=True)
    ) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: {")  # generating: tokens are streaming
    server.wait_idle(timeout_s=10)
    assert completed(server) == before  # aborted, not run to its 400 tokens


def test_non_streaming_client_disconnect_aborts(server):
    before = completed(server)
    sock = server.open_request(CMPL, cmpl(max_tokens=450, ignore_eos=True))
    server.wait_for(
        lambda m: m("pdserve_num_requests_running") == 1, "the request to be generating"
    )
    sock.close()
    server.wait_idle(timeout_s=10)
    assert completed(server) == before


def test_200_concurrent_streaming_clients(server):
    async def one(client: httpx.AsyncClient, i: int) -> int:
        body = cmpl(
            prompt=f"Story {i}:",
            max_tokens=12,
            ignore_eos=True,
            stream=True,
            stream_options={"include_usage": True},
        )
        tokens = None
        async with client.stream("POST", server.url + CMPL, json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    if chunk.get("usage"):
                        tokens = chunk["usage"]["completion_tokens"]
        return tokens

    async def main():
        limits = httpx.Limits(max_connections=250, max_keepalive_connections=250)
        async with httpx.AsyncClient(limits=limits, timeout=120) as client:
            return await asyncio.gather(*(one(client, i) for i in range(200)))

    assert asyncio.run(main()) == [12] * 200
    server.wait_idle()


def _burst(url: str, n: int, body: dict) -> list[httpx.Response]:
    async def main():
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*(client.post(url + CMPL, json=body) for _ in range(n)))

    return asyncio.run(main())


@pytest.mark.slow
def test_overload_and_queue_timeout_503(stories_path):
    """One request runs, two may wait (and time out after 0.03 s: the running one's 450 tokens
    take longer even on the fused decode step, ~0.3 ms a token here), the rest are refused."""
    s = start_server(
        stories_path,
        "--max-num-seqs", "1", "--max-waiting-requests", "2", "--queue-timeout", "0.03",
    )  # fmt: skip
    try:
        rs = _burst(s.url, 10, cmpl(max_tokens=450, ignore_eos=True))
        codes = sorted(r.status_code for r in rs)
        assert 200 in codes and set(codes) <= {200, 503}
        messages = [r.json()["error"]["message"] for r in rs if r.status_code == 503]
        assert any("overloaded" in m for m in messages)
        assert any("queue timeout" in m for m in messages)
        assert all(r.headers["retry-after"] for r in rs if r.status_code == 503)
        s.wait_idle()
    finally:
        s.stop()


@pytest.mark.slow  # a server of its own
def test_a_request_the_worker_refuses_is_a_400_naming_the_reason(stories_path):
    """The frontend cannot know every engine limit (here the KV cache holds 64 tokens, less
    than the context): the worker's refusal reaches the client as a 400, not a 503."""
    s = start_server(stories_path, "--num-kv-blocks", "4", "--block-size", "16")
    try:
        r = httpx.post(s.url + CMPL, json=cmpl(prompt="once " * 30, max_tokens=60), timeout=30)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert "exceed the KV cache (64 tokens)" in err["message"]
        assert err["param"] == "max_tokens"
        ok = httpx.post(s.url + CMPL, json=cmpl(prompt="once", max_tokens=4), timeout=30)
        assert ok.status_code == 200  # the server serves on
        s.wait_idle()
    finally:
        s.stop()


@pytest.mark.slow  # seconds of its own: the default run stays short
def test_dead_worker_fails_requests_clearly_without_hanging(stories_path):
    s = start_server(stories_path)
    try:
        pid = s.worker_pid("both")
        result = {}

        first_token = threading.Event()

        def stream():
            with httpx.stream(
                "POST",
                s.url + CMPL,
                timeout=30,
                json=cmpl(max_tokens=450, ignore_eos=True, stream=True),
            ) as r:
                result["lines"] = []
                for line in r.iter_lines():
                    result["lines"].append(line)
                    first_token.set()

        t = threading.Thread(target=stream)
        t.start()
        assert first_token.wait(timeout=30)  # the worker is generating
        os.kill(pid, signal.SIGKILL)
        t.join(timeout=10)
        assert not t.is_alive()
        events = [json.loads(line[6:]) for line in result["lines"] if line.startswith("data: {")]
        assert "choices" in events[0]  # a token came before the death
        error = events[-1]["error"]  # then the stream ends with a 503 error event
        assert error["type"] == "service_unavailable" and "died" in error["message"]
        assert "engine unavailable" in error["message"]
        assert [e for e in events if "choices" in e and e["choices"][0]["finish_reason"]] == []
        assert result["lines"][-1] == "data: [DONE]" or result["lines"][-2] == "data: [DONE]"
        h = httpx.get(s.url + "/health")
        assert h.status_code == 503 and "died" in h.json()["error"]["message"]
        r = httpx.post(s.url + CMPL, json=cmpl(), timeout=10)
        assert r.status_code == 503 and "engine unavailable" in r.json()["error"]["message"]
    finally:
        s.stop()


@pytest.mark.slow  # seconds of its own: the default run stays short
def test_sigterm_shuts_down_cleanly(stories_path):
    s = start_server(stories_path)
    pid = s.worker_pid("both")
    done = {}
    first_token = threading.Event()

    def stream():
        try:
            with httpx.stream(
                "POST",
                s.url + CMPL,
                timeout=30,
                json=cmpl(max_tokens=200, ignore_eos=True, stream=True),
            ) as r:
                for _ in r.iter_lines():
                    first_token.set()
        except httpx.HTTPError as e:
            done["error"] = e

    t = threading.Thread(target=stream)
    t.start()
    assert first_token.wait(timeout=30)  # shut down while a request streams
    # uvicorn shuts down gracefully, then re-raises the signal: exit by SIGTERM is expected.
    assert s.stop() in (0, -signal.SIGTERM)
    t.join(timeout=10)
    assert not t.is_alive()
    with pytest.raises(ProcessLookupError):  # the worker is gone too
        for _ in range(50):
            os.kill(pid, 0)
            time.sleep(0.1)
    with socket.socket() as sock:  # nothing listens on the port any more (a restarted server,
        # like uvicorn, sets SO_REUSEADDR: closed client connections may sit in TIME_WAIT)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", s.port))
        sock.listen()
