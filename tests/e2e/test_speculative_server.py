"""Speculative decoding behind the server: on the decode worker of a 1P+1D deployment, greedy
outputs equal the offline engine's plain decoding, and the proposals show in `timings` and in
/metrics."""

from __future__ import annotations

import httpx
import pytest
from server_harness import start_server

from pdserve import LLM, SamplingParams

CMPL = "/v1/completions"
STORY = (
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the "
    "park. One day, she saw a big, red ball. Once upon a time, there was a little girl named"
)


@pytest.mark.slow  # a deployment of its own
@pytest.mark.parametrize(
    "method", [["ngram"], ["draft", "--draft-layers", "4"]], ids=["ngram", "self-draft"]
)
def test_disaggregated_decode_worker_speculates_losslessly(method, stories_path):
    """The decode worker's draft reads the KV the prefill worker sent (self-speculation shares
    those layers)."""
    want = LLM(stories_path).generate([STORY], SamplingParams(temperature=0, max_tokens=60))
    s = start_server(stories_path, "--prefill-workers", "1", "--decode-workers", "1",
                     "--speculative-method", *method, "--no-speculative-adaptive")  # fmt: skip
    try:
        body = {"prompt": STORY, "max_tokens": 60, "temperature": 0}
        r = httpx.post(s.url + CMPL, json=body, timeout=120)
        assert r.status_code == 200, r.text
        got = r.json()
        assert got["choices"][0]["text"] == want[0].outputs[0].text
        t = got["timings"]
        assert t["spec_proposed_tokens"] > 0
        assert 0 <= t["spec_accepted_tokens"] <= t["spec_proposed_tokens"]
        assert s.metric("pdserve_spec_proposed_tokens_total") == t["spec_proposed_tokens"]
        assert s.metric("pdserve_spec_accepted_tokens_total") == t["spec_accepted_tokens"]
        assert 0 < t["spec_steps"] <= t["spec_proposed_tokens"]
        assert s.metric("pdserve_spec_verify_steps_total") == t["spec_steps"]
        assert t["spec_acceptance_rate"] == t["spec_accepted_tokens"] / t["spec_proposed_tokens"]
        assert t["spec_mean_accepted_length"] == t["spec_accepted_tokens"] / t["spec_steps"]
        assert s.metric("pdserve_spec_acceptance_rate_count") == 1
        s.wait_idle()
    finally:
        s.stop()
