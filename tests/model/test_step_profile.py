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


def test_prompts_that_hit_the_prefix_cache_compute_a_few_tokens_over_a_long_context(stories_path):
    driver = Driver(EngineCore(EngineArgs(model=stories_path, num_threads=1, num_kv_blocks=256)))
    driver.prefix_hits((128, 256), (0, 8), batch=2)
    shapes = [(s.q_lens, s.ctx_lens) for s, _ in driver.samples]
    # 128 cached tokens and 8 new beside the two decodes: the prompt's 8, over a context of 136
    assert any(q == (1, 1, 8) and c[2] == 136 for q, c in shapes), shapes
    assert any(q == (1, 1, 8) and c[2] == 264 for q, c in shapes), shapes
    # the same prompt again: all of it cached but what the engine computes again to sample
    again = [c[2] for q, c in shapes if len(q) == 3 and c[2] in (128, 256) and q[2] < 128]
    assert sorted(set(again)) == [128, 256], shapes
    assert not driver.core.scheduler.has_unfinished
    start = len(driver.samples)
    driver.prefix_hits((256,), (32,))  # alone
    assert ((32,), (288,)) in [(s.q_lens, s.ctx_lens) for s, _ in driver.samples[start:]]


def test_the_wake_cost_times_one_step_after_each_idle_stretch(stories_path, monkeypatch):
    from pdserve.perf import step_profile

    core = EngineCore(EngineArgs(model=stories_path, num_threads=1, num_kv_blocks=256))
    slept = []
    real_sleep = step_profile.time.sleep
    monkeypatch.setattr(step_profile.time, "sleep", lambda s: (slept.append(s), real_sleep(s)))
    wake = step_profile.measure_wake(core, idle_s=(0.05, 0.01), repeats=2)
    assert sorted(slept) == [0.0, 0.0, 0.01, 0.01, 0.05, 0.05]
    assert [g for g, _ in wake.points] == [0.01, 0.05]
    extras = [x for _, x in wake.points]
    assert 0.0 <= extras[0] <= extras[1]
    assert not core.scheduler.has_unfinished
