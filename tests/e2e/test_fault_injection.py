"""The harness's fault injection (tests/e2e/faults/sitecustomize.py) acts where it is meant to:
a prefill worker's steps are slowed, no other process is touched."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from server_harness import FAULT_PREFILL_DELAY, FAULTS_DIR

# Runs in a process whose command line looks like a worker's (`pdserve.engine.worker --role R`):
# prefill a prompt in 8-token chunks offline, report whether EngineCore.execute was wrapped and
# how long the prefill took.
PROBE = """
import json, sys, time
from pdserve import LLM, SamplingParams
from pdserve.engine.core import EngineCore
llm = LLM(sys.argv[1], max_num_batched_tokens=8)
prompt = list(range(3, 43))  # 40 tokens: 5 chunks
t0 = time.perf_counter()
llm.generate([prompt], SamplingParams(max_tokens=1))
print(json.dumps({
    "delay": getattr(EngineCore.execute, "fault_delay_s", None),
    "seconds": time.perf_counter() - t0,
}))
"""


def probe(model: str, role: str, delay: str) -> dict:
    env = {**os.environ, FAULT_PREFILL_DELAY: delay}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(FAULTS_DIR), env.get("PYTHONPATH")]))
    argv = [sys.executable, "-c", PROBE, model, "pdserve.engine.worker", "--role", role]
    out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_prefill_delay_slows_only_prefill_workers(stories_path):
    slow = probe(stories_path, "prefill", "0.3")
    assert slow["delay"] == 0.3
    assert slow["seconds"] >= 5 * 0.3  # every chunk of the prompt waited
    assert probe(stories_path, "decode", "0.3")["delay"] is None
