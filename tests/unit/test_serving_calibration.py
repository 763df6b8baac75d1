"""The in-process side of the served-step factors (`perf/serving_costs.py`): every calibration
request is computed whole, as the served one was."""

from __future__ import annotations

from pdserve.config import EngineArgs
from pdserve.perf.serving_costs import _generate, _in_process_engine


def test_each_in_process_calibration_request_computes_its_whole_prompt(stories_path):
    core = _in_process_engine(EngineArgs(model=stories_path, dtype="float32"), threads=1)
    free = core.scheduler.kv.num_free_blocks()
    for _ in range(2):  # the same length twice: no prefix of the first may serve the second
        steps = _generate(core, 40, 3)
        shapes = [shape for shape, _ in steps]
        assert shapes[0].q_lens == (40,) and shapes[0].ctx_lens == (40,)
        assert [s.q_lens for s in shapes[1:]] == [(1,), (1,)]
        assert all(seconds > 0 for _, seconds in steps)
    assert core.scheduler.kv.num_free_blocks() == free  # every block back
