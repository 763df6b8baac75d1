"""Prefill/decode disaggregation: outputs identical to colocated, and every failure ends cleanly.

Each server here runs separate prefill and decode worker processes. After each scenario the
server must be idle with no KV block referenced on any worker (read from its own metrics).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading

import httpx
import numpy as np
import pytest
from server_harness import (
    FAULT_DECODE_START_GATE,
    FAULT_PREFILL_DELAY,
    free_port,
    start_server,
    wait_until,
)

from pdserve import LLM, SamplingParams

CMPL = "/v1/completions"
STORY = (
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the "
    "park. One day, she saw a big, red ball. She wanted to play with it, but it was too high. "
    "Lily's mom said, let's go to the park. Lily was sad and did not know what to do."
)
PROMPTS = [STORY, "Tim and his dog", STORY[:120], "The sun was"]
# Each of these starts servers of its own: they run in the slow suite (`-m slow`, CI runs it).
SLOW = pytest.mark.slow
# Injected by the test harness (tests/e2e/faults): the prefill worker sleeps 0.1 s after each
# step, so with 8-token chunks STORY (98 tokens, 13 chunks) takes over 1.2 s to prefill whatever
# the machine, and a test can act while its KV transfer is under way.
SLOW_PREFILL = {FAULT_PREFILL_DELAY: "0.1"}
CHUNK = ("--prefill-max-num-batched-tokens", "8")
PREFILL_STEPS = "pdserve_step_time_seconds_count"


def completion(server, prompt, **kw) -> dict:
    body = {"prompt": prompt, "max_tokens": 32, "temperature": 0, **kw}
    r = httpx.post(server.url + CMPL, json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def stream_text(server, prompt, **kw) -> str:
    import json

    body = {"prompt": prompt, "max_tokens": 32, "temperature": 0, "stream": True, **kw}
    text = ""
    with httpx.stream("POST", server.url + CMPL, json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    text += c["text"]
    return text


@pytest.fixture(scope="module")
def offline(stories_path):
    return LLM(stories_path)


@pytest.fixture(scope="module")
def disagg(stories_path):
    s = start_server(stories_path, "--prefill-workers", "1", "--decode-workers", "1")
    yield s
    s.stop()


def expected(offline, prompt, **kw) -> list[str]:
    params = SamplingParams(**{"temperature": 0, "max_tokens": 32, **kw})
    return [c.text for c in offline.generate([prompt], params)[0].outputs]


def test_greedy_outputs_equal_colocated_streaming_and_not(disagg, offline):
    for prompt in PROMPTS:
        want = expected(offline, prompt)[0]
        assert completion(disagg, prompt)["choices"][0]["text"] == want
        assert stream_text(disagg, prompt) == want
    # Each prompt's first run is prefilled remotely; a repeat may be cached on the decode worker.
    assert disagg.metric("pdserve_router_decisions_total", 'decision="remote"') >= len(PROMPTS)
    assert disagg.metric("pdserve_router_decisions_total") == 2 * len(PROMPTS)
    assert disagg.metric("pdserve_kv_transfer_bytes_total") > 0
    disagg.wait_idle()


def test_deployment_names_each_workers_process(disagg):
    workers = httpx.get(disagg.url + "/deployment", timeout=10).json()["workers"]
    assert [w["placement"]["backend"] for w in workers] == ["local", "local"]
    assert {(w["role"], w["id"]): w["placement"]["pid"] for w in workers} == disagg.worker_pids()


def test_n2_seeded_sampling_equals_colocated(disagg, offline):
    want = expected(offline, STORY, n=2, temperature=1.0, seed=7, max_tokens=24)
    got = completion(disagg, STORY, n=2, temperature=1.0, seed=7, max_tokens=24)
    assert [c["text"] for c in sorted(got["choices"], key=lambda c: c["index"])] == want
    disagg.wait_idle()


def test_structured_output_and_prompt_scoring_across_the_split(disagg, offline):
    """The prefill worker masks the first token, the decode worker the rest (its matcher catches
    up on the token it received); a request that scores its prompt stays on the decode worker."""
    from pdserve.structured import spec

    regex = r"(yes|no), [a-z ]{1,30}\."
    grammar = spec.regex_grammar(regex)
    fresh = "A small red bird sat on a tree. It looked at the sky and sang a happy song. " * 2
    remote_before = disagg.metric("pdserve_router_decisions_total", 'decision="remote"')
    got = completion(disagg, fresh, guided_regex=regex, max_tokens=40)["choices"][0]["text"]
    assert got == expected(offline, fresh, grammar=grammar, max_tokens=40)[0]
    assert re.fullmatch(regex, got)
    assert disagg.metric("pdserve_router_decisions_total", 'decision="remote"') > remote_before

    scored = completion(disagg, STORY, max_tokens=0, echo=True, logprobs=0)["choices"][0]
    want = offline.generate([STORY], SamplingParams(max_tokens=0, prompt_logprobs=0))[0]
    got_lps = scored["logprobs"]["token_logprobs"]
    assert got_lps[0] is None
    assert got_lps[1:] == pytest.approx([lp.logprob for lp in want.prompt_logprobs[1:]], abs=1e-5)
    assert disagg.metric("pdserve_router_decisions_total", 'decision="local_only"') == 1
    assert disagg.metric("pdserve_kv_transfer_span_seconds_sum") >= disagg.metric(
        "pdserve_kv_transfer_seconds_sum"
    )
    disagg.wait_idle()


def test_decode_worker_with_cached_prefix_receives_only_the_rest(disagg, offline):
    longer = (
        "Max was a big brown dog who lived on a farm with a boy named Sam. Every morning they "
        "ran to the river and looked at the fish. One day Sam found a shiny stone in the water "
        "and showed it to his mom. She smiled and said it was a gift from the river."
    )
    completion(disagg, longer[:150], max_tokens=4)  # the decode worker now holds its blocks
    bytes_before = disagg.metric("pdserve_kv_transfer_bytes_total")
    got = completion(disagg, longer)
    assert got["choices"][0]["text"] == expected(offline, longer)[0]
    sent = disagg.metric("pdserve_kv_transfer_bytes_total") - bytes_before
    n_prompt = got["usage"]["prompt_tokens"]
    bytes_per_token = 5 * 2 * 4 * 8 * 4  # layers * (K, V) * kv heads * head dim * fp32
    assert 0 < sent < n_prompt * bytes_per_token
    # The repeated prompt is mostly cached on the decode worker: prefilled there, no transfer.
    local_before = disagg.metric("pdserve_router_decisions_total", 'decision="cached_on_decode"')
    completion(disagg, longer)
    assert (
        disagg.metric("pdserve_router_decisions_total", 'decision="cached_on_decode"')
        > local_before
    )
    disagg.wait_idle()


@SLOW
def test_tcp_transport_and_chunked_prefill_on_prefill_worker(stories_path, offline):
    s = start_server(
        stories_path,
        "--prefill-workers",
        "1",
        "--decode-workers",
        "1",
        "--kv-transport",
        "tcp",
        "--prefill-max-num-batched-tokens",
        "16",
    )
    try:
        for prompt in PROMPTS:
            assert completion(s, prompt)["choices"][0]["text"] == expected(offline, prompt)[0]
        assert s.metric("pdserve_kv_transfer_bytes_total") > 0
        assert s.metric("pdserve_step_time_seconds_count", 'role="prefill"') >= 8  # chunked
        s.wait_idle()
    finally:
        s.stop()


@SLOW
def test_random_weight_model_equals_colocated(tiny_models):
    path = tiny_models["qwen3"]
    offline = LLM(path)
    ids = list(range(5, 80))
    want = offline.generate([ids], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0]
    s = start_server(path, "--prefill-workers", "1", "--decode-workers", "1")
    try:
        got = completion(s, ids, max_tokens=24, ignore_eos=True)
        assert got["choices"][0]["text"] == want.text
        s.wait_idle()
    finally:
        s.stop()


@SLOW
def test_short_prompts_prefilled_on_the_decode_worker(stories_path, offline):
    s = start_server(stories_path, "--prefill-workers", "1", "--disagg-min-prompt-tokens", "20")
    try:
        assert completion(s, "Tim")["choices"][0]["text"] == expected(offline, "Tim")[0]
        assert s.metric("pdserve_router_decisions_total", 'decision="short_prompt"') == 1
        completion(s, STORY)
        assert s.metric("pdserve_router_decisions_total", 'decision="remote"') == 1
    finally:
        s.stop()


def num_chunks(offline, prompt: str) -> int:
    return -(-len(offline.tokenizer.encode(prompt)) // 8)


def wait_prefilling(s, chunks: int):
    """Wait until the prefill worker has run `chunks` chunks of a remote prefill; returns the
    metrics reader of that scrape."""
    return s.wait_for(
        lambda m: m(PREFILL_STEPS, 'role="prefill"') >= chunks,
        f"the prefill worker to run {chunks} chunk(s) of the prompt",
    )


@SLOW
def test_prefill_worker_killed_mid_transfer_recomputes_on_decode(stories_path, offline):
    # Equal, small pools: the decode worker's cache file is small enough to read.
    blocks = ("--prefill-num-kv-blocks", "64", "--decode-num-kv-blocks", "64")
    s = start_server(stories_path, "--prefill-workers", "1", *CHUNK, *blocks, env=SLOW_PREFILL)
    try:
        kv_file = s.shm_kv_file(s.worker_pid("decode"))
        assert not np.fromfile(kv_file, dtype=np.uint8).any()  # nothing written yet
        result = {}
        t = threading.Thread(target=lambda: result.update(completion(s, STORY)))
        t.start()
        m = wait_prefilling(s, 2)
        # The transfer is under way: the decode worker waits for the KV and already holds rows
        # the prefill worker wrote into its cache, and no transfer has completed.
        assert m(PREFILL_STEPS, 'role="prefill"') < num_chunks(offline, STORY)
        assert m("pdserve_num_requests_waiting", 'role="decode"') == 1
        assert m("pdserve_kv_transfer_bytes_total") == 0
        assert np.fromfile(kv_file, dtype=np.uint8).any()
        os.kill(s.worker_pid("prefill"), signal.SIGKILL)
        t.join(timeout=60)
        assert result["choices"][0]["text"] == expected(offline, STORY)[0]
        assert s.metric("pdserve_kv_transfer_fallbacks_total", 'reason="prefill_dead"') == 1
        assert s.metric("pdserve_kv_transfer_bytes_total") == 0  # it never completed
        health = httpx.get(s.url + "/health").json()
        assert health["status"] == "degraded"
        assert [(w["role"], w["alive"]) for w in health["workers"]] == [
            ("prefill", False),
            ("decode", True),
        ]
        # With no prefill worker left, new requests are prefilled on the decode worker.
        assert (
            completion(s, "The sun was")["choices"][0]["text"]
            == expected(offline, "The sun was")[0]
        )
        assert s.metric("pdserve_router_decisions_total", 'decision="no_prefill_worker"') == 1
        s.wait_idle()
    finally:
        s.stop()


@SLOW
def test_prefill_failure_can_fail_the_request(stories_path, offline):
    s = start_server(
        stories_path,
        "--prefill-workers",
        "1",
        *CHUNK,
        "--on-prefill-failure",
        "fail",
        env=SLOW_PREFILL,
    )
    try:
        box = {}

        def run():
            box["r"] = httpx.post(s.url + CMPL, json={"prompt": STORY, "max_tokens": 8}, timeout=60)

        t = threading.Thread(target=run)
        t.start()
        m = wait_prefilling(s, 1)
        assert m(PREFILL_STEPS, 'role="prefill"') < num_chunks(offline, STORY)
        os.kill(s.worker_pid("prefill"), signal.SIGKILL)
        t.join(timeout=30)
        assert box["r"].status_code == 503
        assert "prefill worker 0 died during the request" in box["r"].json()["error"]["message"]
        assert s.metric("pdserve_kv_transfer_fallbacks_total", 'reason="prefill_dead"') == 1
        assert s.metric("pdserve_requests_total") == 0  # the decode worker did not finish it
        assert httpx.get(s.url + "/health").json()["status"] == "degraded"
        s.wait_idle()
    finally:
        s.stop()


@SLOW
def test_transfer_timeout_falls_back_to_local_recompute(stories_path, offline):
    s = start_server(
        stories_path,
        "--prefill-workers",
        "1",
        "--prefill-max-num-batched-tokens",
        "32",  # STORY in 4 chunks, each step followed by a 0.5 s pause
        "--kv-transfer-timeout",
        "0.3",  # less than a step: the prefill worker reports no progress in time
        env={FAULT_PREFILL_DELAY: "0.5"},
    )
    try:
        got = completion(s, STORY)
        assert got["choices"][0]["text"] == expected(offline, STORY)[0]
        assert s.metric("pdserve_kv_transfer_fallbacks_total", 'reason="timeout"') == 1
        assert s.metric("pdserve_kv_transfer_bytes_total") == 0  # no transfer completed
        # The prefill worker is told to stop; once it has, no block is held on either side.
        s.wait_idle(timeout_s=30)
        assert httpx.get(s.url + "/health").json()["status"] == "ok"
    finally:
        s.stop()


@SLOW
def test_client_abort_during_transfer_frees_both_sides(stories_path, offline):
    s = start_server(stories_path, "--prefill-workers", "1", *CHUNK, env=SLOW_PREFILL)
    try:
        sock = s.open_request(CMPL, {"prompt": STORY, "max_tokens": 8})
        m = wait_prefilling(s, 2)
        assert m("pdserve_num_requests_waiting", 'role="decode"') == 1  # waiting for the KV
        assert m("pdserve_kv_transfer_bytes_total") == 0
        sock.close()  # the client goes away mid-transfer
        s.wait_idle(timeout_s=30)
        # Both workers ended it: the prefill stopped short of the whole prompt, no KV was
        # handed over, nothing was recomputed, and no request finished.
        assert s.metric(PREFILL_STEPS, 'role="prefill"') < num_chunks(offline, STORY)
        assert s.metric("pdserve_kv_transfer_bytes_total") == 0
        assert s.metric("pdserve_kv_transfer_fallbacks_total") == 0
        assert s.metric("pdserve_requests_total") == 0
        assert s.metric("pdserve_kv_cache_usage_ratio", 'role="decode"') == 0
        assert s.metric("pdserve_kv_cache_usage_ratio", 'role="prefill"') == 0
    finally:
        s.stop()


def served_by(s, worker_id: int) -> float:
    return s.metric("pdserve_requests_total", f'role="decode",worker="{worker_id}"')


@SLOW
def test_decode_worker_killed_fails_its_requests_and_restarts(stories_path, offline, tmp_path):
    gate = tmp_path / "hold-started-decode-workers"
    s = start_server(
        stories_path,
        "--prefill-workers",
        "1",
        "--decode-workers",
        "2",
        "--restart-workers",
        env={FAULT_DECODE_START_GATE: str(gate)},
    )
    try:
        gate.touch()  # a decode worker started from now on waits until the gate is removed
        pids = s.worker_pids()
        decode_ids = sorted(wid for role, wid in pids if role == "decode")
        box = {}

        def run():
            box["r"] = httpx.post(
                s.url + CMPL,
                timeout=60,
                json={"prompt": STORY, "max_tokens": 400, "ignore_eos": True},
            )

        t = threading.Thread(target=run)
        t.start()
        # Kill the decode worker that generates the request (400 tokens: it is far from done).
        m = s.wait_for(
            lambda m: m("pdserve_num_requests_running", 'role="decode"') == 1,
            "the request to decode",
        )
        (victim,) = [
            w for w in decode_ids if m("pdserve_num_requests_running", f'worker="{w}"') == 1
        ]
        (survivor,) = set(decode_ids) - {victim}
        os.kill(pids[("decode", victim)], signal.SIGKILL)
        t.join(timeout=30)
        assert box["r"].status_code == 503
        assert f"engine worker {victim} (decode) died" in box["r"].json()["error"]["message"]
        assert served_by(s, victim) == 0
        health = s.wait_health(lambda h: True, "/health")
        assert health["status"] == "degraded"
        alive = {w["id"]: w["alive"] for w in health["workers"]}
        assert alive == {0: True, victim: False, survivor: True}
        # It is started again (held at the gate), and new requests go to the live worker.
        wait_until(
            lambda: (
                s.worker_pids().get(("decode", victim), pids[("decode", victim)])
                != pids[("decode", victim)]
            ),
            "the frontend to start the worker again",
        )
        for _ in range(5):
            assert (
                completion(s, "Tim and his dog")["choices"][0]["text"]
                == expected(offline, "Tim and his dog")[0]
            )
        assert served_by(s, survivor) == 5 and served_by(s, victim) == 0
        assert httpx.get(s.url + "/health").json()["status"] == "degraded"

        gate.unlink()  # the restarted worker loads and rejoins
        s.wait_health(lambda h: h["status"] == "ok", "the restarted decode worker to rejoin")
        assert s.metric("pdserve_worker_up", f'role="decode",worker="{victim}"') == 1
        # With the other decode worker gone, the rejoined one serves (and receives KV).
        gate.touch()
        os.kill(s.worker_pids()[("decode", survivor)], signal.SIGKILL)
        s.wait_health(
            lambda h: not {w["id"]: w["alive"] for w in h["workers"]}[survivor],
            "the frontend to see the second death",
        )
        bytes_before = s.metric("pdserve_kv_transfer_bytes_total")
        assert completion(s, STORY)["choices"][0]["text"] == expected(offline, STORY)[0]
        assert served_by(s, victim) == 1
        assert s.metric("pdserve_kv_transfer_bytes_total") > bytes_before
        s.wait_idle()
    finally:
        gate.unlink(missing_ok=True)
        s.stop()


@SLOW
@pytest.mark.parametrize(
    "pool_size",
    [("--prefill-num-kv-blocks", "16"), ("--decode-num-kv-blocks", "64")],
    ids=["smaller-prefill-pool", "smaller-decode-pool"],
)
def test_pools_with_different_kv_cache_sizes_equal_colocated(stories_path, offline, pool_size):
    s = start_server(stories_path, "--prefill-workers", "1", *pool_size)
    try:
        for prompt in (STORY, PROMPTS[2] + " The end."):
            assert completion(s, prompt)["choices"][0]["text"] == expected(offline, prompt)[0]
        assert s.metric("pdserve_router_decisions_total", 'decision="remote"') == 2
        assert s.metric("pdserve_kv_transfer_fallbacks_total") == 0
        assert httpx.get(s.url + "/health").json()["status"] == "ok"
    finally:
        s.stop()


@SLOW
def test_mismatched_workers_fail_at_startup(stories_path):
    cmd = [
        sys.executable,
        "-m",
        "pdserve.cli",
        "serve",
        "--model",
        stories_path,
        "--port",
        str(free_port()),
        "--prefill-workers",
        "1",
        "--prefill-block-size",
        "32",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "disagree on the KV layout" in proc.stderr and "block_size 32 != 16" in proc.stderr


@SLOW
def test_int8_weights_disaggregated_equal_the_offline_engine(stories_path):
    """Both workers quantize at load; the KV that crosses between them is float as before."""
    params = SamplingParams(max_tokens=24, temperature=0)
    expect = LLM(stories_path, quantization="int8").generate([STORY], params)[0].outputs[0].text
    s = start_server(stories_path, "--quantization", "int8",
                     "--prefill-workers", "1", "--decode-workers", "1")  # fmt: skip
    try:
        assert completion(s, STORY, max_tokens=24)["choices"][0]["text"] == expect
        s.wait_idle()
    finally:
        s.stop()


@SLOW
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_int8_kv_cache_disaggregated_equals_the_offline_engine(stories_path, transport):
    """The transfer ships the quantized rows with their scales, over either transport."""
    params = SamplingParams(max_tokens=24, temperature=0)
    offline = LLM(stories_path, kv_cache_dtype="int8")
    expect = offline.generate([STORY], params)[0].outputs[0].text
    s = start_server(stories_path, "--kv-cache-dtype", "int8", "--kv-transport", transport,
                     "--prefill-workers", "1", "--decode-workers", "1")  # fmt: skip
    try:
        assert completion(s, STORY, max_tokens=24)["choices"][0]["text"] == expect
        assert s.metric("pdserve_kv_transfer_bytes_total") > 0  # it went through the connector
        s.wait_idle()
    finally:
        s.stop()


@SLOW
@pytest.mark.parametrize(
    ("transport", "prefill_tp", "decode_tp"),
    [("shm", 2, 1), ("shm", 1, 2), ("tcp", 2, 2)],
    ids=["shm-tp2-to-tp1", "shm-tp1-to-tp2", "tcp-tp2-to-tp2"],
)
def test_tensor_parallel_workers_hand_over_every_kv_head(
    stories_path, offline, transport, prefill_tp, decode_tp
):
    """The KV crosses with every head whatever each pool's tensor-parallel size: a split prefill
    worker gathers its followers' rows after each (chunked) step, a split decode worker takes
    each rank's heads into that rank's cache. Greedy outputs equal the one-rank offline engine;
    a mismatched head would change them (stories260K's 4 KV heads, 2 per rank)."""
    s = start_server(
        stories_path,
        "--prefill-workers", "1", "--decode-workers", "1", "--kv-transport", transport,
        "--prefill-tensor-parallel-size", str(prefill_tp),
        "--decode-tensor-parallel-size", str(decode_tp),
        *CHUNK,
    )  # fmt: skip
    try:
        for prompt in (STORY, PROMPTS[2] + " The end."):
            assert completion(s, prompt)["choices"][0]["text"] == expected(offline, prompt)[0]
        assert s.metric("pdserve_router_decisions_total", 'decision="remote"') == 2
        assert s.metric("pdserve_kv_transfer_fallbacks_total") == 0
        assert s.metric("pdserve_kv_transfer_bytes_total") > 0
        s.wait_idle()
    finally:
        s.stop()


@SLOW
def test_auto_transport_writes_rows_in_place_and_signals_on_tcp(stories_path, offline):
    """auto on one host: the decode worker's cache in shared memory, its channel a TCP stream;
    the prefill worker writes every row in place (the transfer metrics say shm)."""
    s = start_server(stories_path, "--prefill-workers", "1", "--kv-transport", "auto", *CHUNK)
    try:
        for prompt in (STORY, PROMPTS[2] + " The end."):
            assert completion(s, prompt)["choices"][0]["text"] == expected(offline, prompt)[0]
        shm_bytes = s.metric("pdserve_kv_transfer_bytes_total", 'path="shm"')
        assert shm_bytes > 0 and s.metric("pdserve_kv_transfer_bytes_total") == shm_bytes
        assert s.metric("pdserve_kv_transfer_fallbacks_total") == 0
        s.wait_idle()
    finally:
        s.stop()
