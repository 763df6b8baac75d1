"""What a request asks its output to look like, as one llguidance grammar (no torch here).

Sources, each a way users of OpenAI or vLLM ask for it:
- `response_format`: `{"type": "json_object"}` (any JSON object) or `{"type": "json_schema",
  "json_schema": {"schema": {...}}}`; `{"type": "text"}` is no constraint.
- vLLM's extras: `guided_json` (a schema), `guided_regex`, `guided_choice` (one of some strings),
  `guided_grammar` (a Lark grammar).
- tool calling with `tool_choice` "required" or a named function (`pdserve.frontend.tools`).

A request may ask for one of them. The grammar travels to the engine in `SamplingParams.grammar`
(llguidance's own JSON form); `check` compiles it once in the frontend so a bad schema, regex or
grammar is a 400 naming the field, not a failure inside the engine.
"""

from __future__ import annotations

import json
from typing import Any

import llguidance

# What the engine will build, per request: bounded, so a hostile grammar cannot take a worker's
# memory or time (llguidance's defaults; the lexer state count lowered from 250k).
PARSER_LIMITS = dict(max_lexer_states=50_000, max_grammar_size=200_000)


# JSON is written on one line, `{"a": 1, "b": [2, 3]}`: with free whitespace a model can loop on
# newlines forever. A schema's own "x-guidance" options override this.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class SpecError(ValueError):
    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"invalid {field}: {message}")
        self.field = field


def json_schema_grammar(schema: Any, field: str) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise SpecError(field, f"not valid JSON ({e})") from None
    if not isinstance(schema, (dict, bool)):
        raise SpecError(field, "a JSON schema must be an object")
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_STYLE)
    except ValueError as e:
        raise SpecError(field, str(e)) from None


def regex_grammar(regex: str) -> str:
    return llguidance.LLMatcher.grammar_from_regex(regex)


def choice_grammar(choices: list[str], field: str = "guided_choice") -> str:
    if not choices or not all(isinstance(c, str) and c for c in choices):
        raise SpecError(field, "needs a list of non-empty strings")
    alternatives = " | ".join(json.dumps(c) for c in choices)
    return llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}")


def lark_grammar(lark: str) -> str:
    return llguidance.LLMatcher.grammar_from_lark(lark)


def response_format_grammar(response_format: dict | None) -> str | None:
    """The grammar of an OpenAI `response_format`, or None for free text."""
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return json_schema_grammar({"type": "object"}, "response_format")
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise SpecError("response_format", "json_schema needs a 'schema'")
        return json_schema_grammar(spec["schema"], "response_format.json_schema.schema")
    raise SpecError("response_format", f"unknown type {kind!r} (text, json_object, json_schema)")


def check(grammar: str, field: str, tokenizer: llguidance.LLTokenizer | None = None) -> None:
    """Compile `grammar` (against `tokenizer` when given) under the engine's limits."""
    limits = llguidance.LLParserLimits(**PARSER_LIMITS)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
        grammar, tokenizer, limits=limits
    )
    if is_error:
        raise SpecError(field, messages[0] if messages else "the grammar does not compile")
