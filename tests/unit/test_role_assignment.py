"""Role assignment for switchable workers and the load the P:D controller reads (no torch)."""

from __future__ import annotations

import pytest

from pdserve.pools.pd_controller import MERGED, PDController, PhaseSLO
from pdserve.pools.roles import (
    LoadObserver,
    RoleManager,
    Worker,
    assign,
    cpu_sets,
    current_split,
)
from pdserve.types import Role, RoleControl

B, P, D, X = Role.BOTH, Role.PREFILL, Role.DECODE, Role.PARKED


def workers(*roles, running=(), queued=(), dead=(), waiting=()):
    return [
        Worker(
            i,
            r,
            i not in dead,
            dict(running).get(i, 0),
            dict(queued).get(i, 0),
            dict(waiting).get(i, 0),
        )
        for i, r in enumerate(roles)
    ]


def test_split_of_live_workers():
    assert current_split(workers(B, B)) == (0, 2)
    assert current_split(workers(P, D, D, dead=[2])) == (1, 1)


def test_splitting_colocated_workers_takes_the_least_busy_as_prefill():
    ws = workers(B, B, B, running=[(0, 5), (1, 1), (2, 3)])
    assert assign(ws, (1, 2)) == {0: D, 1: P, 2: D}
    assert assign(ws, (0, 3)) == {0: B, 1: B, 2: B}


def test_fewer_prefill_workers_keep_the_busiest_prefill_worker():
    ws = workers(P, P, D, queued=[(0, 10), (1, 900)])
    assert assign(ws, (1, 2)) == {0: D, 1: P, 2: D}


def test_dead_workers_are_left_out_and_the_split_must_fit():
    ws = workers(P, D, D, dead=[1])
    assert assign(ws, (1, 1)) == {0: P, 2: D}
    with pytest.raises(ValueError, match="does not fit 2 live workers"):
        assign(ws, (1, 2))


def test_manager_reports_changes_only_and_logs_decisions():
    m = RoleManager(RoleControl.MANUAL)
    ws = workers(B, B)
    assert m.plan(ws, (1, 1), "operator") == {0: P, 1: D}
    ws = workers(P, D)
    assert m.plan(ws, (1, 1), "again") == {}
    report = m.report(ws)
    assert report["split"] == "1P+1D" and report["control"] == "manual"
    assert [d["reason"] for d in report["decisions"]] == ["operator"]
    with pytest.raises(ValueError, match="static"):
        RoleManager(RoleControl.STATIC).plan(ws, (0, 2), "x")


def test_observer_windows_attainment_and_oldest_wait():
    now = [100.0]
    obs = LoadObserver(PhaseSLO(ttft_s=1.0, tpot_s=0.1), window_s=10, clock=lambda: now[0])
    obs.on_arrival("a")
    obs.on_finish(0.5, 0.05)
    obs.on_finish(2.0, 0.2)
    obs.on_decode_step(0, 0.04)
    obs.on_decode_step(0, 0.09)
    now[0] = 103.0
    s = obs.sample(queued_prefill_tokens=50, kv_usage=0.3)
    assert s.oldest_wait_s == pytest.approx(3.0)
    assert (s.ttft_attainment, s.tpot_attainment) == (0.5, 0.5)
    assert s.recent_ttfts_s == (0.5, 2.0)
    assert s.decode_step_s == pytest.approx(0.8 * 0.04 + 0.2 * 0.09)
    obs.on_first_output("a")
    now[0] = 120.0
    s = obs.sample(0, 0.0)
    assert s.oldest_wait_s == 0 and s.ttft_attainment is None  # the window moved on
    assert s.recent_ttfts_s == ()


def test_auto_tick_follows_the_controller():
    slo = PhaseSLO(ttft_s=2.0, tpot_s=0.1)
    m = RoleManager(RoleControl.AUTO, PDController(2, slo, patience=1, min_dwell_s=0))
    obs = LoadObserver(slo)
    for _ in range(3):
        obs.on_finish(0.1, 0.5)  # decodes far over the TPOT target
    obs.on_arrival("waiting")
    changes = m.tick(workers(B, B, running=[(0, 4)]), obs.sample(800, 0.2))
    assert changes == {0: D, 1: P}
    assert "stall" in m.decisions[-1].reason


def test_a_switch_starts_the_load_window_afresh():
    """Requests finished under the old split do not judge the new one."""
    now = [0.0]
    load = LoadObserver(PhaseSLO(1.0, 0.1), clock=lambda: now[0])
    load.on_finish(5.0, 0.5)  # late on both counts
    load.on_decode_step(0, 0.3)
    assert load.attainment() == (0.0, 0.0)
    load.on_switch()
    assert load.attainment() == (None, None)
    assert load.sample(0, 0.0).decode_step_s is None
    load.on_finish(0.5, 0.05)
    assert load.attainment() == (1.0, 1.0)


def test_after_a_switch_only_requests_that_arrived_under_the_new_split_count():
    """A request that arrived before the switch inherited the old split's queue and batch: it
    does not judge the new split, however late it finishes."""
    now = [0.0]
    load = LoadObserver(PhaseSLO(1.0, 0.1), clock=lambda: now[0])
    load.on_arrival("old")
    now[0] = 5.0
    load.on_switch()
    load.on_arrival("new")
    load.on_arrival("dropped")
    now[0] = 8.0
    load.on_finish(6.0, 0.5, "old")  # late, but mostly the old split's doing
    assert load.attainment() == (None, None)
    load.on_finish(0.5, 0.05, "new")
    assert load.attainment() == (1.0, 1.0)
    load.on_gone("dropped")
    assert load.arrived == {}  # nothing left behind once each ended


# ---- --pd-merge: parked workers and the CPUs they lend --------------------------------------------
OWN = {0: frozenset({0}), 1: frozenset({1}), 2: frozenset({2, 3})}


def test_merging_keeps_the_busiest_worker_and_parks_the_rest():
    ws = workers(B, B, B, running=[(0, 1), (1, 4), (2, 2)])
    assert assign(ws, MERGED) == {0: X, 1: B, 2: X}
    # from a split, the decode worker (it holds the streams) stays, the prefill worker parks
    assert assign(workers(P, D, running=[(0, 3), (1, 1)]), MERGED) == {0: X, 1: B}
    assert current_split(workers(X, B, X)) == (0, 1)
    assert assign(workers(B, D, dead=[1]), MERGED) == {0: B}  # one live worker: nothing parks


def test_unmerging_gives_the_parked_worker_the_prefill_role():
    ws = workers(X, B, running=[(1, 5)])
    assert assign(ws, (1, 1)) == {0: P, 1: D}
    assert assign(ws, (0, 2)) == {0: B, 1: B}


def test_a_parked_worker_lends_its_cpus_only_once_it_holds_nothing():
    busy = workers(B, X, running=[(1, 2)])
    assert cpu_sets(busy, OWN) == {0: OWN[0], 1: OWN[1]}
    waiting = workers(B, X, waiting=[(1, 1)])  # a handed-off request waits for its KV there
    assert cpu_sets(waiting, OWN) == {0: OWN[0], 1: OWN[1]}
    idle = workers(B, X)
    assert cpu_sets(idle, OWN) == {0: frozenset({0, 1}), 1: OWN[1]}
    three = workers(X, B, X, running=[(2, 1)])  # one done, one still finishing
    assert cpu_sets(three, OWN)[1] == frozenset({0, 1})
    assert cpu_sets(workers(X, B, X), OWN)[1] == frozenset({0, 1, 2, 3})


def test_a_dead_parked_worker_lends_its_cpus_and_splits_lend_nothing():
    assert cpu_sets(workers(B, X, running=[(1, 3)], dead=[1]), OWN) == {0: frozenset({0, 1})}
    for ws in (workers(B, B), workers(P, D), workers(P, D, B)):
        assert cpu_sets(ws, OWN) == {w.worker_id: OWN[w.worker_id] for w in ws}
    # a worker that was colocated and died is not parked: its CPUs stay its own
    assert cpu_sets(workers(B, B, dead=[1]), OWN) == {0: OWN[0]}


def test_merged_decisions_describe_the_parked_workers():
    m = RoleManager(RoleControl.MANUAL)
    assert m.plan(workers(B, B), MERGED, "operator") == {1: X}
    report = m.report(workers(B, X))
    assert report["split"] == "1 colocated + 1 parked"
    assert report["decisions"][0]["new"] == "1 colocated + 1 parked"
    assert report["decisions"][0]["old"] == "2 colocated"
