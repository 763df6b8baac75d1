"""The host offload tier behind the server: two colocated workers share one arena in the
deployment's private shared-memory directory; returning turns whose history left the KV cache
load it back (usage's cached tokens, /metrics), answer as the offline engine does, and every
block comes back."""

from __future__ import annotations

import os
import stat

import httpx
import numpy as np
import pytest
from server_harness import start_server

from pdserve import LLM, SamplingParams

CMPL = "/v1/completions"
POOL = ("--num-kv-blocks", "24", "--block-size", "8", "--max-num-seqs", "2")


def turns(seed: int, n: int = 4) -> tuple[list[list[int]], list[list[int]]]:
    rng = np.random.default_rng(seed)
    first = [rng.integers(3, 500, 80).tolist() for _ in range(n)]
    return first, [p + rng.integers(3, 500, 9).tolist() for p in first]


def complete(s, prompt: list[int]) -> dict:
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    r = httpx.post(s.url + CMPL, json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.slow  # a deployment of its own
def test_returning_turns_load_their_history_from_the_shared_host_tier(stories_path):
    first, second = turns(0)
    others, _ = turns(1)
    offline = LLM(stories_path)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = [o.outputs[0].text for o in offline.generate(second, params)]
    s = start_server(stories_path, *POOL, "--decode-workers", "2",
                     "--kv-offload", "cpu:64MiB", "--kv-offload-reload", "always")  # fmt: skip
    try:
        shm = [
            os.path.join(d, f)
            for d in _shm_dirs(s)
            for f in os.listdir(d)
            if f.startswith("kvtier-")
        ]
        assert len(shm) == 1  # one arena for both workers
        assert stat.S_IMODE(os.stat(shm[0]).st_mode) == 0o600
        for p in first + others:  # the others push the first turns out of the pools
            complete(s, p)
        outs = [complete(s, p) for p in second]
        cached = [o["usage"]["prompt_tokens_details"]["cached_tokens"] for o in outs]
        assert cached == [80] * len(second)  # each 80-token history, from a pool or the tier
        assert [o["choices"][0]["text"] for o in outs] == want
        assert s.metric("pdserve_kv_tier_hits") > 0
        assert s.metric("pdserve_kv_offload_loaded_blocks") > 0
        assert s.metric("pdserve_kv_tier_capacity_bytes") > 0
        s.wait_idle()
    finally:
        s.stop()


def _shm_dirs(s) -> list[str]:
    """The deployment's shared-memory directories (named in its workers' environment)."""
    out = set()
    for pid in s.worker_pids().values():
        with open(f"/proc/{pid}/environ", "rb") as f:
            for item in f.read().split(b"\0"):
                if item.startswith(b"PDSERVE_RUNTIME_SHM_DIR="):
                    out.add(item.split(b"=", 1)[1].decode())
    return sorted(out)
