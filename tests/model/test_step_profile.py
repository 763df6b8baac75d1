"""The profile's scenarios produce the step shapes they are named for, on the real tiny model."""

from __future__ import annotations

from pdserve.config import EngineArgs
from pdserve.engine.core import EngineCore
from pdserve.perf.step_profile import Driver


def test_prompts_run_beside_decodes_whole_or_in_chunks(stories_path):
    driver = Driver(EngineCore(EngineArgs(model=stories_path, num_threads=1, num_kv_blocks=256)))
    driver.beside_decodes(4, (300, 150), 4096)  # whole prompts, as an unchunked deployment
    whole = [s.q_lens for s, _ in driver.samples]
    assert (1, 1, 1, 1, 300, 150) in whole, whole[:3]
    start = len(driver.samples)
    driver.beside_decodes(2, (300,), 66, 64)  # in chunks of 64 beside the two decodes
    chunked = [s.q_lens for s, _ in driver.samples[start:]]
    assert (1, 1, 64) in chunked, chunked[:3]
    assert not driver.core.scheduler.has_unfinished
