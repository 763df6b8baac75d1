"""Router decisions and the KV layout handshake (pure logic)."""

from __future__ import annotations

import pytest

from pdserve.disagg.protocol import KVLayout
from pdserve.disagg.router import Router

BS = 4


def make_router(**kw) -> Router:
    r = Router(BS, **kw)
    r.add_worker(0, "prefill", 100)
    r.add_worker(1, "prefill", 100)
    r.add_worker(2, "decode", 50)
    r.add_worker(3, "decode", 80)
    return r


def test_decode_worker_with_most_free_blocks():
    r = make_router()
    assert r.route(list(range(40))).decode_id == 3
    r.report(3, 10, 0)
    assert r.route(list(range(100, 140))).decode_id == 2


def test_prefill_worker_with_fewest_queued_tokens():
    r = make_router()
    r.report(0, 100, 5000)
    r.report(1, 100, 10)
    route = r.route(list(range(40)))
    assert route.prefill_id == 1 and route.reason == "remote"


def test_prefix_affinity_within_slack():
    r = make_router(affinity_slack_tokens=100)
    prompt = list(range(64))
    first = r.route(prompt).prefill_id
    r.report(first, 100, 50)  # a little busier than the other, within the slack
    other = 1 - first
    r.report(other, 100, 0)
    r.report(2, 50, 0)
    r.report(3, 10, 0)  # steer decode to worker 2, which has not seen the prompt
    assert r.route(prompt + [999] * 8).prefill_id == first
    r.report(first, 100, 500)  # beyond the slack: load wins over affinity
    assert r.route(prompt + [998] * 64).prefill_id == other  # half cached on decode: remote


def test_a_conversation_stays_with_the_colocated_worker_that_holds_its_history():
    r = Router(BS, affinity_slack_tokens=100)
    r.add_worker(0, "both", 50)
    r.add_worker(1, "both", 80)
    history = list(range(64))  # 16 blocks
    assert r.route(history).decode_id == 1  # the roomiest
    r.report(0, 60, 0)
    r.report(1, 40, 0)  # now the other has more room, but worker 1 saw the history
    assert r.route(history + [7] * 8).decode_id == 1
    assert r.route(list(range(500, 540))).decode_id == 0  # a new conversation: the roomiest
    r.report(1, 40, 300)  # its prompt queue beyond the slack: room and load win
    r.report(0, 60, 0)
    assert r.route(history + [8] * 8).decode_id == 0
    r.report(0, 60, 0)
    r.report(1, 10, 0)  # no room for the prompt (18 blocks): the roomiest again
    assert r.route(history + [9] * 8).decode_id == 0


def test_short_and_cached_prompts_stay_on_the_decode_worker():
    r = make_router(min_prompt_tokens=16)
    assert r.route(list(range(8))).reason == "short_prompt"
    prompt = list(range(200, 264))
    assert r.route(prompt).reason == "remote"
    again = r.route(prompt)
    assert again.reason == "cached_on_decode" and again.prefill_id is None


def test_without_live_prefill_workers_everything_is_local():
    r = make_router()
    r.set_alive(0, False)
    r.set_alive(1, False)
    assert r.route(list(range(40))).reason == "no_prefill_worker"
    r.set_alive(2, False)
    r.set_alive(3, False)
    with pytest.raises(LookupError):
        r.route([1, 2, 3])


def test_layout_mismatch_names_every_field():
    a = KVLayout("Llama(x)", "float32", 4, 2, 16, 16)
    assert a.mismatch(a) is None
    b = KVLayout("Qwen(y)", "float32", 4, 2, 16, 32)
    diff = a.mismatch(b)
    assert "model 'Llama(x)' != 'Qwen(y)'" in diff and "block_size 16 != 32" in diff
