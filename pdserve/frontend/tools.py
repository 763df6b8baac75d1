"""Tool calling: what the model is allowed to call, and the calls read back out of its text.

- `tool_choice` "none": the tools are shown to the model (through its chat template) and its
  text is returned as it is. "auto" (the default when tools are given): the text is parsed for
  calls in the format of the model's family. "required" or a named function: the output is
  constrained by a grammar (`pdserve.structured`) to a JSON list of calls, or to the named
  function's arguments, so any model returns well-formed calls.
- Parsers, one per family: `hermes` (Qwen 2/2.5/3, Hermes: `<tool_call>{"name": ...,
  "arguments": {...}}</tool_call>`), `llama3_json` (Llama 3.x: `{"name": ..., "parameters":
  {...}}`, optionally after `<|python_tag|>`, several separated by `;`), `mistral`
  (`[TOOL_CALLS] [{"name": ..., "arguments": {...}}]`). `parser_for` picks one from the model.
- `ToolStream` holds back streamed text from the point a call may begin, so a stream carries
  either content or, at its end, the calls.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from pdserve.frontend.protocol import ChatCompletionRequest
from pdserve.structured import spec


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI returns it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_openai(self, index: int | None = None) -> dict:
        function = {"name": self.name, "arguments": self.arguments}
        out = {"id": self.id, "type": "function", "function": function}
        return out if index is None else {"index": index, **out}


def _call(obj, args_key: str) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args))


class ToolParser:
    """Finds calls in a finished text; `start` is where one may begin (for streaming), anywhere
    in the text or, with `at_start_only`, only at its beginning."""

    name = ""
    start = ""
    at_start_only = False

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        raise NotImplementedError


class HermesParser(ToolParser):
    name, start = "hermes", "<tool_call>"
    _CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)

    def parse(self, text):
        if self.start not in text:
            return text, []
        calls = []
        for body in self._CALL.findall(text):
            try:
                call = _call(json.loads(body), "arguments")
            except json.JSONDecodeError:
                call = None
            if call is None:
                return text, []  # not a well-formed call: the text stays text
            calls.append(call)
        content = text[: text.index(self.start)].strip()
        return content or None, calls


class Llama3JsonParser(ToolParser):
    name, start, at_start_only = "llama3_json", "<|python_tag|>", True
    _TAG = "<|python_tag|>"

    def parse(self, text):
        body = text.strip()
        if body.startswith(self._TAG):
            body = body[len(self._TAG) :].strip()
        if not body.startswith("{"):
            return text, []
        calls = []
        decoder = json.JSONDecoder()
        pos = 0
        while pos < len(body):
            try:
                obj, end = decoder.raw_decode(body, pos)
            except json.JSONDecodeError:
                return text, []
            call = _call(obj, "parameters")
            if call is None:
                return text, []
            calls.append(call)
            pos = end
            while pos < len(body) and body[pos] in " \n\t;":
                pos += 1
        return None, calls


class MistralParser(ToolParser):
    name, start = "mistral", "[TOOL_CALLS]"

    def parse(self, text):
        if self.start not in text:
            return text, []
        head, _, body = text.partition(self.start)
        try:
            items = json.loads(body.strip())
        except json.JSONDecodeError:
            return text, []
        items = items if isinstance(items, list) else [items]
        calls = [_call(obj, "arguments") for obj in items]
        if not calls or None in calls:
            return text, []
        return head.strip() or None, calls


PARSERS = {p.name: p for p in (HermesParser(), Llama3JsonParser(), MistralParser())}


def parser_for(architecture: str, chat_template: str | None) -> ToolParser:
    """The family's format: Hermes when the template speaks it, else by architecture."""
    if chat_template and "<tool_call>" in chat_template:
        return PARSERS["hermes"]
    if architecture == "MistralForCausalLM":
        return PARSERS["mistral"]
    if architecture in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        return PARSERS["hermes"]
    return PARSERS["llama3_json"]


# ---- forced calls --------------------------------------------------------------------------


def mode(body: ChatCompletionRequest) -> str:
    """none | auto | required | named, after checking the request's tools and tool_choice."""
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none"):
            raise spec.SpecError("tool_choice", "needs tools")
        return "none"
    if choice is None or choice == "auto":
        return "auto"
    if choice in ("none", "required"):
        return choice
    names = [t.function.name for t in body.tools]
    if choice.function.name not in names:
        raise spec.SpecError(
            "tool_choice", f"no tool named {choice.function.name!r} (tools: {', '.join(names)})"
        )
    return "named"


def forced_grammar(body: ChatCompletionRequest) -> str | None:
    """The grammar of the calls when `tool_choice` forces them, else None."""
    m = mode(body)
    if m == "named":
        tool = next(t for t in body.tools if t.function.name == body.tool_choice.function.name)
        return spec.json_schema_grammar(_parameters(tool), "tools")
    if m != "required":
        return None
    calls = {
        "type": "array",
        "minItems": 1,
        "maxItems": None if body.parallel_tool_calls else 1,
        "items": {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {
                        "name": {"const": t.function.name},
                        "parameters": _parameters(t),
                    },
                    "required": ["name", "parameters"],
                    "additionalProperties": False,
                }
                for t in body.tools
            ]
        },
    }
    if calls["maxItems"] is None:
        del calls["maxItems"]
    return spec.json_schema_grammar(calls, "tools")


def _parameters(tool) -> dict:
    return tool.function.parameters or {"type": "object", "properties": {}}


def forced_calls(body: ChatCompletionRequest, text: str) -> list[ToolCall]:
    """The calls in the (grammar-constrained) text of a "required" or named request."""
    if mode(body) == "named":
        return [ToolCall(body.tool_choice.function.name, text)]
    try:
        items = json.loads(text)
    except json.JSONDecodeError:  # cut short (max_tokens): nothing complete to return
        return []
    return [ToolCall(i["name"], json.dumps(i["parameters"])) for i in items]


# ---- a choice's text, as content or calls -----------------------------------------------------


def split(body: ChatCompletionRequest, parser: ToolParser, text: str):
    """(content, calls) of one finished choice."""
    m = mode(body)
    if m in ("required", "named"):
        calls = forced_calls(body, text)
        return (None, calls) if calls else (text, [])
    if m == "auto":
        return parser.parse(text)
    return text, []


class ToolStream:
    """One streamed choice: text passes through until a call may have begun, then waits for the
    end, where `finish` says whether it was calls or text after all."""

    def __init__(self, body: ChatCompletionRequest, parser: ToolParser) -> None:
        self.body, self.parser = body, parser
        m = mode(body)
        self.active = m != "none"
        self.held = m in ("required", "named")  # all of it is a call
        self.buffer = ""

    def feed(self, delta: str) -> str:
        """The part of `delta` that can be streamed as content now."""
        if not self.active:
            return delta
        self.buffer += delta
        if self.held:
            return ""
        if self.parser.at_start_only:
            return self._feed_at_start()
        at = self.buffer.find(self.parser.start)
        if at >= 0:
            self.held = True
            out, self.buffer = self.buffer[:at], self.buffer[at:]
            return out
        cut = len(self.buffer) - _partial_suffix(self.buffer, self.parser.start)
        out, self.buffer = self.buffer[:cut], self.buffer[cut:]
        return out

    def _feed_at_start(self) -> str:
        head = self.buffer.lstrip()
        if not head or self.parser.start.startswith(head):
            return ""  # undecided: a call could still open the text
        if head.startswith(("{", self.parser.start)):
            self.held = True
            return ""
        self.active = False  # plain text: stream it all from now on
        out, self.buffer = self.buffer, ""
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(text still to stream as content, calls) at the end of the choice."""
        if not self.active:
            return "", []
        text, self.buffer = self.buffer, ""
        content, calls = split(self.body, self.parser, text)
        return (content or "") if calls else text, calls


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a beginning of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
