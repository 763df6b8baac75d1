"""A fuzzer over the served request schema: bodies made of the schema's field names with
values from a hypothesis strategy, posted to both OpenAI endpoints."""

from __future__ import annotations

import json
from collections.abc import Callable

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

ENDPOINTS = {
    "CompletionRequest": "/v1/completions",
    "ChatCompletionRequest": "/v1/chat/completions",
}
# How many bodies each fuzz test sends: a quick run by default, a thorough one in the slow suite.
EXAMPLES = [pytest.param(50, id="quick"), pytest.param(400, id="thorough", marks=pytest.mark.slow)]


def fuzz_request_bodies(
    server, values: st.SearchStrategy, examples: int, prepare: Callable[[dict], dict]
) -> set[int]:
    """Every answer must be a 200, 400 or 404 with a message, and a 200 stream must end with
    [DONE]; returns the statuses seen. `prepare` adjusts a body before it is sent."""
    schemas = httpx.get(f"{server.url}/openapi.json").json()["components"]["schemas"]
    cases = [(path, list(schemas[name]["properties"])) for name, path in ENDPOINTS.items()]
    seen: set[int] = set()

    @settings(
        max_examples=examples,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        derandomize=True,
    )
    @given(
        st.sampled_from(cases).flatmap(
            lambda c: st.tuples(
                st.just(c[0]), st.dictionaries(st.sampled_from(c[1]), values, max_size=6)
            )
        )
    )
    def check(case):
        path, body = case
        body = prepare(body)
        raw = json.dumps(body)  # NaN and Infinity as Python writes them
        r = httpx.post(
            server.url + path,
            content=raw,
            headers={"content-type": "application/json"},
            timeout=60,
        )
        seen.add(r.status_code)
        assert r.status_code in (200, 400, 404), (r.status_code, raw[:300], r.text[:300])
        if r.status_code != 200:
            assert r.json()["error"]["message"]
        elif body.get("stream") is True:
            assert r.text.rstrip().endswith("data: [DONE]")

    check()
    return seen
