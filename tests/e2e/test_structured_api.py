"""The API fields real clients send: structured output, tool calls, echo and prompt logprobs.

Completions run on the real tiny model (the shared server); chat and tools on a random Qwen3
whose chat template shows tools Hermes-style, so its calls come out through the `hermes` parser.
"""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest
from server_harness import start_server

from pdserve import LLM, SamplingParams

CMPL = "/v1/completions"
CHAT = "/v1/chat/completions"
STORY = "Once upon a time, there was a little girl named Lily. She loved to play"
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 10}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}, "additionalProperties": False}}}  # fmt: skip


def post(server, path, body) -> dict:
    r = httpx.post(server.url + path, json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def stream_events(server, path, body) -> list[dict]:
    events = []
    with httpx.stream("POST", server.url + path, json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                events.append(json.loads(line[6:]))
    return events


# ---- structured output on /v1/completions ---------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "check"),
    [
        ({"guided_json": PERSON}, lambda t: set(json.loads(t)) == {"name", "age"}),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}},
            lambda t: 0 <= json.loads(t)["age"] <= 99,
        ),
        ({"response_format": {"type": "json_object"}}, lambda t: t.startswith("{")),
        ({"guided_regex": r"(yes|no), [a-z ]{1,20}\."}, lambda t: re.fullmatch(r"(yes|no), [a-z ]{1,20}\.", t)),
        ({"guided_choice": ["happy", "sad"]}, lambda t: t in ("happy", "sad")),
        ({"guided_grammar": 'start: "The " ("cat" | "dog") " ran."'}, lambda t: t in ("The cat ran.", "The dog ran.")),
    ],
)  # fmt: skip
def test_completions_follow_the_requested_structure(server, fields, check):
    body = {"prompt": "Lily", "max_tokens": 60, "temperature": 0, **fields}
    text = post(server, CMPL, body)["choices"][0]["text"]
    assert check(text), text
    streamed = "".join(c["text"] for e in stream_events(server, CMPL, body) for c in e["choices"])
    assert streamed == text


def test_structured_sampling_with_n_and_a_batch_of_prompts(server):
    regex = r"[A-Z][a-z]{2,8} (ran|sat|sang)\."
    body = {"prompt": ["Lily", "Tim went"], "n": 3, "max_tokens": 30, "temperature": 1.0,
            "seed": 1, "guided_regex": regex}  # fmt: skip
    choices = post(server, CMPL, body)["choices"]
    assert len(choices) == 6 and all(re.fullmatch(regex, c["text"]) for c in choices)
    server.wait_idle()


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"guided_regex": "([a-"}, "guided_regex"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_json": {"type": "string"}, "guided_regex": "a"}, "guided_regex"),
        ({"response_format": {"type": "yaml"}}, "response_format"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_grammar": "start: undefined_rule"}, "guided_grammar"),
        ({"guided_regex": "a" * 70_000}, "guided_regex"),
    ],
)
def test_a_bad_constraint_is_a_400_naming_its_field(server, fields, param):
    r = httpx.post(server.url + CMPL, json={"prompt": "Lily", "max_tokens": 5, **fields})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


# ---- echo, logprobs of the prompt, max_tokens 0 ------------------------------------------------


@pytest.fixture(scope="module")
def offline(stories_path):
    return LLM(stories_path)


def test_echo_with_logprobs_scores_the_prompt(server, offline):
    ref = offline.generate([STORY], SamplingParams(max_tokens=0, prompt_logprobs=1))[0]
    body = {"prompt": STORY, "max_tokens": 0, "echo": True, "logprobs": 1, "temperature": 0}
    choice = post(server, CMPL, body)["choices"][0]
    assert choice["text"] == STORY and choice["finish_reason"] == "length"
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(ref.prompt_token_ids) and lp["token_logprobs"][0] is None
    want = [x.logprob for x in ref.prompt_logprobs[1:]]
    assert lp["token_logprobs"][1:] == pytest.approx(want, abs=1e-5)
    assert all(len(t) == 1 for t in lp["top_logprobs"][1:])

    with_output = post(server, CMPL, {**body, "max_tokens": 3})["choices"][0]
    assert with_output["text"].startswith(STORY) and len(with_output["logprobs"]["tokens"]) == len(ref.prompt_token_ids) + 3  # fmt: skip


def test_streamed_echo_sends_the_prompt_first(server):
    body = {"prompt": STORY, "max_tokens": 4, "echo": True, "logprobs": 0, "temperature": 0}
    events = stream_events(server, CMPL, body)
    first = events[0]["choices"][0]
    assert first["text"].startswith(STORY) and first["logprobs"]["token_logprobs"][0] is None
    whole = post(server, CMPL, body)["choices"][0]["text"]
    assert "".join(c["text"] for e in events for c in e["choices"]) == whole


def test_vllm_prompt_logprobs_field(server):
    body = {"prompt": STORY, "max_tokens": 1, "prompt_logprobs": 2, "temperature": 0}
    plp = post(server, CMPL, body)["choices"][0]["prompt_logprobs"]
    assert plp[0] is None
    for entry in plp[1:]:
        ranks = sorted(v["rank"] for v in entry.values() if v["rank"] is not None)
        assert len(ranks) == 1 and 2 <= len(entry) <= 3  # the token itself + the top 2


def test_openai_client_scores_like_lm_eval(server):
    """What lm-evaluation-harness's `local-completions` sends for a log-likelihood request:
    token ids, echo, logprobs=1, max_tokens=0."""
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
    ids = [[1, 403, 407, 378, 261, 600 % 512], [1, 403, 407]]
    r = client.completions.create(model="stories", prompt=ids, echo=True, logprobs=1,
                                  max_tokens=0, temperature=0)  # fmt: skip
    assert [len(c.logprobs.token_logprobs) for c in r.choices] == [6, 3]
    assert r.choices[1].logprobs.token_logprobs[1:] == pytest.approx(
        r.choices[0].logprobs.token_logprobs[1:3], abs=1e-5
    )


# ---- chat and tools ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen(tiny_models):
    s = start_server(tiny_models["qwen3"], "--served-model-name", "q")
    yield s
    s.stop()


def chat(**kw) -> dict:
    return {"messages": [{"role": "user", "content": "What is the weather in Oslo?"}],
            "max_tokens": 80, "temperature": 0, **kw}  # fmt: skip


def test_chat_response_format_json_schema(qwen):
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}
    r = post(qwen, CHAT, chat(response_format=fmt))
    data = json.loads(r["choices"][0]["message"]["content"])
    assert set(data) == {"name", "age"}


def test_a_named_function_is_called_with_valid_arguments(qwen):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r = post(qwen, CHAT, chat(tools=[WEATHER, CLOCK], tool_choice=choice))["choices"][0]
    assert r["finish_reason"] == "tool_calls" and r["message"]["content"] is None
    (call,) = r["message"]["tool_calls"]
    assert call["type"] == "function" and call["function"]["name"] == "get_weather"
    assert set(json.loads(call["function"]["arguments"])) == {"city"}


def test_required_tool_choice_with_the_openai_client_streaming_and_not(qwen):
    client = openai.OpenAI(base_url=f"{qwen.url}/v1", api_key="none")
    kw = dict(model="q", messages=chat()["messages"], tools=[WEATHER, CLOCK],
              tool_choice="required", parallel_tool_calls=False, max_tokens=80, temperature=0)  # fmt: skip
    r = client.chat.completions.create(**kw)
    calls = r.choices[0].message.tool_calls
    assert len(calls) == 1 and calls[0].function.name in ("get_weather", "get_time")
    json.loads(calls[0].function.arguments)
    chunks = list(client.chat.completions.create(**kw, stream=True))
    streamed = [tc for ch in chunks for c in ch.choices for tc in (c.delta.tool_calls or [])]
    assert [(t.function.name, t.function.arguments) for t in streamed] == [
        (calls[0].function.name, calls[0].function.arguments)
    ]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_a_conversation_with_tool_results_renders_and_auto_returns_text(qwen):
    messages = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12 C, rain"},
    ]  # fmt: skip
    r = post(
        qwen, CHAT, {"messages": messages, "tools": [WEATHER], "max_tokens": 8, "temperature": 0}
    )
    message = r["choices"][0]["message"]
    assert message["role"] == "assistant" and "tool_calls" not in message  # random text: no call
    none = post(qwen, CHAT, chat(tools=[WEATHER], tool_choice="none", max_tokens=8))
    assert "tool_calls" not in none["choices"][0]["message"]


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tool_choice": "required"}, "tool_choice"),  # no tools
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools.0.function.name"),
        ({"tools": [WEATHER] * 129}, "tools"),
        ({"tools": [WEATHER], "tool_choice": "required", "guided_regex": "a"}, "tool_choice"),
        ({"functions": [WEATHER["function"]]}, "functions"),  # the old API: not implemented
    ],
)  # fmt: skip
def test_bad_tool_requests_are_a_400_naming_the_field(qwen, fields, param):
    r = httpx.post(qwen.url + CHAT, json=chat(**fields))
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


# ---- the frontend process -------------------------------------------------------------------


def maps_torch(pid: int) -> bool:
    with open(f"/proc/{pid}/maps") as f:
        return any("libtorch" in line or "/torch/" in line for line in f)


def test_the_frontends_never_load_torch(server, qwen):
    """Tokenizing, chat templates, grammars, tool calls and detokenizing leave torch out of the
    frontend (`pdserve serve`'s own process); its workers have it."""
    post(qwen, CHAT, chat(tools=[WEATHER], tool_choice="required", max_tokens=20))
    post(server, CMPL, {"prompt": STORY, "max_tokens": 8, "guided_json": PERSON, "logprobs": 2})
    for s in (server, qwen):
        assert not maps_torch(s.proc.pid)
        assert s.worker_pids() and all(maps_torch(pid) for pid in s.worker_pids().values())
