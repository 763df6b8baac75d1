"""The official `openai` client against a live server on the real tiny model."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from pdserve import LLM, SamplingParams

PROMPT = "Once upon a time, Lily"


@pytest.fixture(scope="module")
def offline(stories_path):
    return LLM(stories_path)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")


def test_greedy_completion_equals_offline_llm(client, offline, server):
    want = offline.generate([PROMPT], SamplingParams(temperature=0, max_tokens=40))[0]
    r = client.completions.create(model="stories", prompt=PROMPT, max_tokens=40, temperature=0)
    assert r.choices[0].text == want.text
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(want.prompt_token_ids)
    assert r.usage.completion_tokens == 40
    assert r.usage.total_tokens == r.usage.prompt_tokens + 40
    server.wait_idle()


def test_streaming_completion_equals_offline_llm(client, offline):
    want = offline.generate([PROMPT], SamplingParams(temperature=0, max_tokens=40))[0]
    stream = client.completions.create(
        model="stories",
        prompt=PROMPT,
        max_tokens=40,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == want.text
    assert chunks[-1].usage.completion_tokens == 40
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_token_id_prompts_and_batches(client, offline):
    ids = offline.tokenizer.encode(PROMPT)
    want = offline.generate([ids, [1]], SamplingParams(temperature=0, max_tokens=12))
    r = client.completions.create(model="stories", prompt=[ids, [1]], max_tokens=12, temperature=0)
    assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == [w.text for w in want]


def test_async_client_streaming_and_not(server, offline):
    want = offline.generate(["Tim had a"], SamplingParams(temperature=0, max_tokens=20))[0].text

    async def go():
        c = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none")
        r = await c.completions.create(
            model="stories", prompt="Tim had a", max_tokens=20, temperature=0
        )
        s = await c.completions.create(
            model="stories", prompt="Tim had a", max_tokens=20, temperature=0, stream=True
        )
        streamed = "".join([ch.choices[0].text async for ch in s if ch.choices])
        await c.close()
        return r.choices[0].text, streamed

    assert asyncio.run(go()) == (want, want)


def test_chat_completion_uses_the_template(client, offline):
    r = client.chat.completions.create(
        model="stories",
        messages=[{"role": "user", "content": "Lily saw a cat."}],
        max_tokens=16,
        temperature=0,
    )
    # The stories template joins contents with newlines; the server adds the model's BOS.
    ids = [1, *offline.tokenizer.encode("Lily saw a cat.\n", add_special_tokens=False)]
    want = offline.generate([ids], SamplingParams(temperature=0, max_tokens=16))[0]
    assert r.choices[0].message.content == want.text
    assert r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 16


def test_chat_streaming_with_usage(client):
    stream = client.chat.completions.create(
        model="stories",
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].choices == []


def test_n2_with_seed_is_reproducible(client):
    kw = dict(model="stories", prompt=PROMPT, max_tokens=20, temperature=1.0, n=2, seed=42)
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    ta = [c.text for c in sorted(a.choices, key=lambda c: c.index)]
    tb = [c.text for c in sorted(b.choices, key=lambda c: c.index)]
    assert ta == tb and len(ta) == 2 and ta[0] != ta[1]
    assert a.usage.completion_tokens == 40


def test_logprobs_completion_and_chat(client):
    r = client.completions.create(
        model="stories", prompt=PROMPT, max_tokens=5, temperature=0, logprobs=2
    )
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 5 and len(lp.token_logprobs) == 5
    assert all(len(t) == 2 for t in lp.top_logprobs)
    assert "".join(lp.tokens).strip() == r.choices[0].text.strip()
    c = client.chat.completions.create(
        model="stories",
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = c.choices[0].logprobs.content
    assert len(content) == 4 and all(len(x.top_logprobs) == 3 for x in content)


def test_echo_and_stop(client, offline):
    r = client.completions.create(
        model="stories", prompt=PROMPT, max_tokens=10, temperature=0, echo=True
    )
    assert r.choices[0].text.startswith(PROMPT)
    full = offline.generate([PROMPT], SamplingParams(temperature=0, max_tokens=40))[0].text
    stop = full.split()[3]
    r = client.completions.create(
        model="stories", prompt=PROMPT, max_tokens=40, temperature=0, stop=[stop]
    )
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == full[: full.index(stop)]


def test_models_version_health_metrics(server):
    models = httpx.get(f"{server.url}/v1/models").json()
    assert models["data"][0]["id"] == "stories"
    assert httpx.get(f"{server.url}/version").json()["version"]
    assert httpx.get(f"{server.url}/health").status_code == 200
    text = httpx.get(f"{server.url}/metrics").text
    for name in (
        "pdserve_time_to_first_token_seconds",
        "pdserve_inter_token_latency_seconds",
        "pdserve_time_per_output_token_seconds",
        "pdserve_e2e_request_latency_seconds",
        "pdserve_request_queue_time_seconds",
        "pdserve_request_prefill_time_seconds",
        "pdserve_request_decode_time_seconds",
        "pdserve_step_time_seconds",
        "pdserve_prompt_tokens_total",
        "pdserve_generation_tokens_total",
        "pdserve_requests_total",
        "pdserve_preemptions",
        "pdserve_prefix_cache_queries_tokens",
        "pdserve_prefix_cache_hits_tokens",
        "pdserve_num_requests_running",
        "pdserve_num_requests_waiting",
        "pdserve_kv_cache_usage_ratio",
    ):
        assert name in text, name
    assert 'role="both",worker="0"' in text


def test_phase_timings_in_body_and_headers(server):
    r = httpx.post(
        f"{server.url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    )
    t = r.json()["timings"]
    assert t["ttft_ms"] == pytest.approx(t["queue_ms"] + t["prefill_ms"], abs=0.01)
    assert t["e2e_ms"] == pytest.approx(t["ttft_ms"] + t["decode_ms"], abs=0.01)
    assert float(r.headers["x-pdserve-ttft-ms"]) == pytest.approx(t["ttft_ms"], abs=0.01)


def test_cached_prompt_tokens_reported_streaming_and_not(client):
    prompt = "Lily and Tim went to the park to play with a big red ball. " * 3
    client.completions.create(model="stories", prompt=prompt, max_tokens=2, temperature=0)
    r = client.completions.create(model="stories", prompt=prompt, max_tokens=2, temperature=0)
    cached = r.usage.prompt_tokens_details.cached_tokens
    assert cached >= 16 and cached % 16 == 0
    chunks = list(
        client.completions.create(
            model="stories",
            prompt=prompt,
            max_tokens=2,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == cached
