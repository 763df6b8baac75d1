"""Tool calls read out of model text, per family format, whole and streamed."""

from __future__ import annotations

import json

import pytest

from pdserve.frontend import tools
from pdserve.frontend.protocol import ChatCompletionRequest
from pdserve.structured.spec import SpecError

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}


def body(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **kw)


def args(call) -> dict:
    return json.loads(call.arguments)


def test_hermes_calls_with_text_before_them():
    text = (
        'Let me look. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
        '</tool_call><tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    )
    content, calls = tools.PARSERS["hermes"].parse(text)
    assert content == "Let me look."
    assert [c.name for c in calls] == ["get_weather", "get_time"]
    assert args(calls[0]) == {"city": "Oslo"} and args(calls[1]) == {}
    assert calls[0].id != calls[1].id and calls[0].id.startswith("call_")


def test_llama3_json_calls_with_the_python_tag_and_semicolons():
    text = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}; {"name": "get_time", "parameters": {}}'
    content, calls = tools.PARSERS["llama3_json"].parse(text)
    assert content is None and [c.name for c in calls] == ["get_weather", "get_time"]
    assert args(calls[0]) == {"city": "Rome"}


def test_mistral_calls():
    text = '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Lima"}}]'
    content, calls = tools.PARSERS["mistral"].parse(text)
    assert content is None and args(calls[0]) == {"city": "Lima"}


@pytest.mark.parametrize(
    ("parser", "text"),
    [
        ("hermes", "No tools needed: the answer is 4."),
        ("hermes", "<tool_call>{not json}</tool_call>"),
        ("hermes", '<tool_call>{"arguments": {}}</tool_call>'),  # no name
        ("llama3_json", "The answer is {4}."),
        ("llama3_json", '{"city": "Oslo"}'),  # JSON, but not a call
        ("mistral", "[TOOL_CALLS] nope"),
    ],
)
def test_text_that_is_not_a_well_formed_call_stays_text(parser, text):
    assert tools.PARSERS[parser].parse(text) == (text, [])


def test_parser_follows_the_template_then_the_architecture():
    assert tools.parser_for("LlamaForCausalLM", "... <tool_call> ...").name == "hermes"
    assert tools.parser_for("Qwen3ForCausalLM", None).name == "hermes"
    assert tools.parser_for("MistralForCausalLM", None).name == "mistral"
    assert tools.parser_for("LlamaForCausalLM", None).name == "llama3_json"


def test_tool_choice_modes_and_their_errors():
    assert tools.mode(body()) == "none"
    assert tools.mode(body(tools=[WEATHER])) == "auto"
    assert tools.mode(body(tools=[WEATHER], tool_choice="required")) == "required"
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert tools.mode(body(tools=[WEATHER], tool_choice=named)) == "named"
    with pytest.raises(SpecError, match="no tool named 'nope'"):
        tools.mode(
            body(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}})
        )
    with pytest.raises(SpecError, match="needs tools"):
        tools.mode(body(tool_choice="required"))
    assert tools.forced_grammar(body(tools=[WEATHER])) is None
    assert tools.forced_grammar(body(tools=[WEATHER, TIME], tool_choice="required"))


def test_forced_calls_are_read_from_json():
    required = body(tools=[WEATHER, TIME], tool_choice="required")
    text = '[{"name": "get_time", "parameters": {}}, {"name": "get_weather", "parameters": {"city": "Bo"}}]'
    calls = tools.forced_calls(required, text)
    assert [c.name for c in calls] == ["get_time", "get_weather"] and args(calls[1]) == {
        "city": "Bo"
    }
    assert tools.forced_calls(required, '[{"name": "get_time", "param') == []  # cut short
    named = body(
        tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}}
    )
    (call,) = tools.forced_calls(named, '{"city": "Bo"}')
    assert call.name == "get_weather" and args(call) == {"city": "Bo"}


def stream_through(b, parser, pieces):
    s = tools.ToolStream(b, tools.PARSERS[parser])
    streamed = "".join(s.feed(p) for p in pieces)
    rest, calls = s.finish()
    return streamed + rest, calls


def test_stream_passes_text_and_holds_back_a_call():
    b = body(tools=[WEATHER])
    pieces = ["Sure", ", one moment. <tool", "_call>", '{"name": "get_weather", ', '"arguments": {}}', "</tool_call>"]  # fmt: skip
    text, calls = stream_through(b, "hermes", pieces)
    assert text == "Sure, one moment. " and [c.name for c in calls] == ["get_weather"]

    text, calls = stream_through(b, "hermes", ["Plain ", "answer <tool", " no call."])
    assert text == "Plain answer <tool no call." and calls == []

    text, calls = stream_through(
        b, "llama3_json", [" ", '{"name": "get_weather", ', '"parameters": {}}']
    )
    assert text == "" and [c.name for c in calls] == ["get_weather"]
    text, calls = stream_through(b, "llama3_json", [" Hello", " {x}"])
    assert text == " Hello {x}" and calls == []


def test_stream_with_tool_choice_none_is_plain_text():
    text, calls = stream_through(body(tools=[WEATHER], tool_choice="none"), "hermes",
                                 ["<tool_call>", '{"name": "get_weather", "arguments": {}}'])  # fmt: skip
    assert text == '<tool_call>{"name": "get_weather", "arguments": {}}' and calls == []
