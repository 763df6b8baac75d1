"""The harness's fault injection (tests/e2e/faults/sitecustomize.py) acts where it is meant to:
the steps of a worker of the named role are slowed, no other process is touched."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from server_harness import FAULT_BOTH_DELAY, FAULT_DECODE_DELAY, FAULT_PREFILL_DELAY, FAULTS_DIR

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


def probe(model: str, role: str, fault: str, delay: str) -> dict:
    env = {**os.environ, fault: delay}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(FAULTS_DIR), env.get("PYTHONPATH")]))
    argv = [sys.executable, "-c", PROBE, model, "pdserve.engine.worker", "--role", role]
    out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize(
    "role, fault",
    [("prefill", FAULT_PREFILL_DELAY), ("decode", FAULT_DECODE_DELAY), ("both", FAULT_BOTH_DELAY)],
)
def test_a_delay_slows_only_the_workers_of_its_role(stories_path, role, fault):
    slow = probe(stories_path, role, fault, "0.3")
    assert slow["delay"] == 0.3
    assert slow["seconds"] >= 5 * 0.3  # every chunk of the prompt waited
    for other in {"prefill", "decode", "both"} - {role}:
        assert probe(stories_path, other, fault, "0.3")["delay"] is None
