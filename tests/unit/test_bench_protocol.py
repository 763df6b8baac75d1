"""Specification of the client's pure parts: SSE parsing, request bodies, URL and endpoint names."""

from __future__ import annotations

import json

import msgspec
import pytest

from pdserve.bench.client import (
    ClientConfig,
    endpoint_name,
    normalize_base_url,
    request_body,
)
from pdserve.bench.metrics import RequestRecord
from pdserve.bench.sse import StreamState
from pdserve.bench.workload import BenchRequest


def event(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def text_chunk(text: str, finish: str | None = None) -> bytes:
    return event({"choices": [{"index": 0, "text": text, "finish_reason": finish}]})


def feed(reads: list[tuple[float, bytes]], chat: bool = False) -> tuple[StreamState, RequestRecord]:
    state, record = StreamState(chat), RequestRecord(0, 1, 1, 1, 0.0, t_arrive=0.0)
    for now, data in reads:
        state.feed(data, now, record)
    return state, record


def test_each_read_with_text_is_one_token_chunk_stamped_with_its_arrival():
    a, b, c = text_chunk("a"), text_chunk("b"), text_chunk("c", "length")
    usage = event(
        {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 4,
                                  "prompt_tokens_details": {"cached_tokens": 3}}}
    )  # fmt: skip
    reads = [(0.1, a[:10]), (0.2, a[10:] + b[:5]), (0.3, b[5:] + c), (0.4, usage)]
    state, record = feed([*reads, (0.5, b"data: [DONE]\n\n")])
    assert record.t_first == 0.2  # the first event was complete only in the second read
    assert record.token_times == [0.2, 0.3, 0.3]
    assert (record.prompt_tokens, record.completion_tokens, record.cached_tokens) == (7, 4, 3)
    assert state.done and state.finished and state.last_read_s == 0.5


def test_chat_role_and_empty_chunks_are_not_tokens_but_reasoning_is():
    reads = [
        (0.1, event({"choices": [{"delta": {"role": "assistant", "content": ""}}]})),
        (0.2, event({"choices": [{"delta": {"reasoning_content": "hmm"}}]})),
        (0.3, event({"choices": [{"delta": {"content": "hi"}, "finish_reason": "stop"}]})),
    ]
    _, record = feed(reads, chat=True)
    assert record.token_times == [0.2, 0.3]


def test_sse_details_data_without_space_comments_and_crlf():
    data = b": keep-alive\r\n\r\ndata:" + json.dumps({"choices": [{"text": "x"}]}).encode()
    state, record = feed([(0.5, data + b"\r\n\r\ndata:[DONE]\r\n\r\n")])
    assert record.token_times == [0.5] and state.done


def test_error_events_and_bad_json_are_reported():
    state, _ = feed([(0.1, event({"error": {"message": "boom", "code": 500}}))])
    assert "boom" in state.error
    with pytest.raises(msgspec.DecodeError):
        feed([(0.1, b"data: {not json\n\n")])


def test_request_bodies():
    request = BenchRequest(0, 0.0, 10, 7, "hello there", 10)
    cfg = ClientConfig("http://h:1", "m", endpoint="chat", temperature=0.5, extra_body={"seed": 1})
    body = request_body(cfg, request)
    assert body == {
        "model": "m", "max_tokens": 7, "temperature": 0.5, "stream": True,
        "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": "hello there"}],
        "ignore_eos": True, "min_tokens": 7, "seed": 1,
    }  # fmt: skip
    assert cfg.url == "http://h:1/v1/chat/completions"
    assert ClientConfig("http://h:1", "m", api_key="k").headers()["Authorization"] == "Bearer k"


def test_endpoint_names_and_base_urls():
    assert endpoint_name("/v1/chat/completions") == endpoint_name("chat") == "chat"
    assert endpoint_name("v1/completions") == endpoint_name("completions") == "completions"
    assert normalize_base_url("http://h:8000/v1/") == "http://h:8000"
    with pytest.raises(ValueError):
        endpoint_name("/v1/embeddings")
    with pytest.raises(ValueError):
        normalize_base_url("h:8000")
