"""Per-request bounds, checked on the parsed body before any work is done.

Every count a client controls (completions, prompts, stop strings, logprobs, messages) is held to
a configurable `RequestLimits` here, and every string must be valid Unicode (a lone surrogate
cannot be encoded, so it would fail deep inside the tokenizer or the response). Each failure is
an `APIError(400)` naming the field, the value and the setting that allows more.
"""

from __future__ import annotations

import json
import re

from pydantic import BaseModel

from pdserve.config import RequestLimits
from pdserve.config.settings import option
from pdserve.frontend.errors import APIError
from pdserve.frontend.protocol import ChatCompletionRequest, CompletionRequest


def check_request(
    body: CompletionRequest | ChatCompletionRequest, raw: bytes, limits: RequestLimits
) -> None:
    """All of this module's checks; `raw` is the body as received (for the Unicode check)."""
    check_unicode(body, raw)
    n = body.n
    _at_most("n", n, limits, "max_n")
    best_of = getattr(body, "best_of", None)
    if best_of is not None:
        _at_most("best_of", best_of, limits, "max_n")
    stop = body.stop_list
    _at_most("stop", len(stop), limits, "max_stop", what="stop strings")
    longest = max((len(s) for s in stop), default=0)
    _at_most("stop", longest, limits, "max_stop_chars", what="characters in a stop string")
    num_stop_ids = len(body.stop_token_ids or ())
    _at_most("stop_token_ids", num_stop_ids, limits, "max_stop_token_ids", what="stop token ids")
    if body.prompt_logprobs is not None:
        _at_most("prompt_logprobs", body.prompt_logprobs, limits, "max_logprobs")
    for name in (
        "response_format",
        "guided_json",
        "guided_regex",
        "guided_choice",
        "guided_grammar",
    ):
        value = getattr(body, name)
        if value is not None:
            size = len(value) if isinstance(value, str) else len(json.dumps(value))
            _at_most(name, size, limits, "max_grammar_chars", what="characters of constraint")
    if isinstance(body, CompletionRequest):
        if body.logprobs is not None:
            _at_most("logprobs", body.logprobs, limits, "max_logprobs")
        num_prompts = _num_prompts(body.prompt)
        _at_most("prompt", num_prompts, limits, "max_prompts", what="prompts")
    else:
        if body.top_logprobs is not None:
            _at_most("top_logprobs", body.top_logprobs, limits, "max_logprobs")
        _at_most("messages", len(body.messages), limits, "max_messages", what="messages")
        if body.tools:
            _at_most("tools", len(body.tools), limits, "max_tools", what="tools")
            size = len(json.dumps([t.model_dump(exclude_none=True) for t in body.tools]))
            _at_most("tools", size, limits, "max_grammar_chars", what="characters of tools")
        num_prompts = 1
    _at_most("n", num_prompts * n, limits, "max_sequences", what="completions (prompts x n)")


def _num_prompts(prompt) -> int:
    if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int):
        return 1
    return len(prompt)


def _at_most(
    field: str, value: int, limits: RequestLimits, limit_name: str, what: str | None = None
) -> None:
    """400 unless `value` is within the limit `limit_name`; the message names its flag."""
    limit = getattr(limits, limit_name)
    if value <= limit:
        return
    subject = f"{value} {what}" if what else f"{field}={value}"
    flag = option(RequestLimits, limit_name).flag
    raise APIError(
        400,
        f"invalid {field}: {subject} is over this server's limit of {limit} (raise it with {flag})",
        param=field,
        code="limit_exceeded",
    )


# A surrogate can only enter a parsed body through a JSON escape (raw surrogate bytes are not
# valid UTF-8 and fail parsing): bodies without one need no walk.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def check_unicode(body: BaseModel, raw: bytes) -> None:
    """400 naming the field if any string in the body holds a lone surrogate (`"\\ud800"`)."""
    if not _SURROGATE_ESCAPE.search(raw):
        return
    stack: list[tuple[str, object]] = [("", body)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            if not value.isascii() and not _encodable(value):
                raise APIError(
                    400,
                    f"invalid '{path}': the text holds a lone UTF-16 surrogate (not valid Unicode)",
                    param=path,
                    code="invalid_value",
                )
        elif isinstance(value, BaseModel):
            items = {**value.__dict__, **(value.model_extra or {})}
            stack.extend((_join(path, k), v) for k, v in items.items())
        elif isinstance(value, dict):
            for k, v in value.items():
                stack.append((path, k))  # a key is text too
                stack.append((_join(path, str(k) if _encodable(str(k)) else "?"), v))
        elif isinstance(value, (list, tuple)):
            stack.extend((f"{path}[{i}]", v) for i, v in enumerate(value))


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
