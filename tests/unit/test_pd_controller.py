"""The P:D controller's policy on synthetic metric sequences (no processes, no torch)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pdserve.pools.pd_controller import (
    MERGED,
    LoadSample,
    PDController,
    PhaseSLO,
    describe,
    pressures,
)

SLO = PhaseSLO(ttft_s=2.0, tpot_s=0.1)


def calm(t):
    return LoadSample(t, 0, 0.1, 0.03, 0.2, 1.0, 1.0)


def prefill_heavy(t):  # long queue, decodes quick
    return LoadSample(t, 4000, 3.0, 0.03, 0.3, 0.7, 1.0)


def interfered(t):  # decodes miss TPOT while prompts wait
    return LoadSample(t, 800, 0.5, 0.14, 0.4, 1.0, 0.6)


def decode_heavy(t):  # no prompts waiting, decode slow
    return LoadSample(t, 0, 0.0, 0.13, 0.5, 1.0, 0.7)


def overloaded(t):  # prompts wait too long and decodes miss TPOT
    return LoadSample(t, 6000, 5.0, 0.14, 0.5, 0.4, 0.5)


def run(ctrl, samples):
    return [d for d in map(ctrl.observe, samples) if d is not None]


def test_pure_and_torch_free():
    code = "import sys, pdserve.pools.pd_controller; sys.exit(int('torch' in sys.modules))"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_pressures_are_relative_to_the_slo():
    pre, dec = pressures(LoadSample(0, 10, 1.0, 0.05, 0.1), SLO)
    assert (pre, dec) == pytest.approx((0.5, 0.5))
    pre, _ = pressures(LoadSample(0, 10, 0.0, None, 0.1, ttft_attainment=0.85), SLO)
    assert pre == pytest.approx(1.5)  # 15% of requests missed TTFT


def test_steady_load_never_switches():
    ctrl = PDController(2, SLO)
    assert run(ctrl, [calm(t) for t in range(100)]) == []
    ctrl = PDController(2, SLO, start=(1, 1))
    assert run(ctrl, [calm(t) for t in range(100)]) == []


def test_interference_splits_a_colocated_deployment_after_patience():
    ctrl = PDController(2, SLO, patience=3, min_dwell_s=0)
    assert run(ctrl, [interfered(0), interfered(1)]) == []
    [d] = run(ctrl, [interfered(2)])
    assert (d.old, d.new, describe(d.new)) == ((0, 2), (1, 1), "1P+1D")
    assert "stall" in d.reason and ctrl.split == (1, 1)


def test_decode_bound_colocated_load_is_left_alone():
    """Slow decodes with no prompt waiting: taking a worker from decode would not help."""
    ctrl = PDController(2, SLO, patience=1, min_dwell_s=0)
    assert run(ctrl, [decode_heavy(t) for t in range(20)]) == []


def test_step_change_to_prefill_heavy_goes_back_to_colocated():
    ctrl = PDController(2, SLO, start=(1, 1), patience=3, min_dwell_s=0)
    decisions = run(ctrl, [calm(t) for t in range(10)] + [prefill_heavy(t) for t in range(10, 20)])
    assert [(d.t, d.new) for d in decisions] == [(12, (0, 2))]
    assert "prefill pressure" in decisions[0].reason


def test_both_phases_over_their_slos_go_colocated_and_stay():
    """A split helps only when one phase has capacity to spare: with both missing, colocated
    workers give every core to whichever phase has work, and they do not split again."""
    ctrl = PDController(3, SLO, start=(1, 2), patience=2, min_dwell_s=0)
    decisions = run(ctrl, [overloaded(t) for t in range(20)])
    assert [d.new for d in decisions] == [(0, 3)]
    assert "both phases" in decisions[0].reason


def test_more_workers_move_one_at_a_time():
    ctrl = PDController(4, SLO, start=(1, 3), patience=2, min_dwell_s=5)
    decisions = run(ctrl, [prefill_heavy(t) for t in range(20)])
    assert [d.new for d in decisions] == [(2, 2), (3, 1), (0, 4)]
    assert [d.t for d in decisions] == [1, 6, 11]  # dwell time between switches


def test_decode_pressure_or_a_full_kv_cache_moves_workers_to_decode():
    ctrl = PDController(3, SLO, start=(2, 1), patience=1, min_dwell_s=0)
    [d] = run(ctrl, [decode_heavy(0)])
    assert d.new == (1, 2)
    full = LoadSample(1, 0, 0.0, 0.03, 0.95, 1.0, 1.0)
    [d] = run(ctrl, [full])
    assert d.new == (0, 3) and "KV usage 95%" in d.reason


def test_oscillating_load_does_not_flap():
    """Interference and prefill-heavy stretches alternate every 2 samples: no wish lasts the
    patience, so the deployment stays put; with patience met, dwell time bounds the switches."""
    load = [interfered(t) if (t // 2) % 2 == 0 else prefill_heavy(t) for t in range(200)]
    assert run(PDController(2, SLO, patience=3, min_dwell_s=0), load) == []
    slow = [interfered(t) if (t // 4) % 2 == 0 else prefill_heavy(t) for t in range(200)]
    decisions = run(PDController(2, SLO, patience=3, min_dwell_s=30), slow)
    gaps = [b.t - a.t for a, b in zip(decisions, decisions[1:])]
    assert decisions and all(g >= 30 for g in gaps)
    assert len(decisions) <= 200 // 30 + 1


def test_bad_configurations_are_refused():
    with pytest.raises(ValueError, match="num_workers"):
        PDController(0, SLO)
    with pytest.raises(ValueError, match="start split"):
        PDController(2, SLO, start=(2, 0))
    with pytest.raises(ValueError, match="start split"):
        PDController(2, SLO, start=(1, 2))


def test_slo_text_parses_like_the_bench_flag():
    assert PhaseSLO.parse("ttft_ms=1500, tpot_ms=80") == PhaseSLO(1.5, 0.08)
    for bad in ("ttft_ms=1500", "ttft_ms=0,tpot_ms=1", "e2e_ms=1,tpot_ms=1", "ttft_ms=x,tpot_ms=1"):
        with pytest.raises(ValueError, match="--slo"):
            PhaseSLO.parse(bad)


# ---- --pd-merge: colocated means one worker on every worker's CPUs -------------------------------
def test_merge_starts_merged_and_a_steady_load_stays():
    ctrl = PDController(2, SLO, merge=True)
    assert ctrl.split == MERGED and describe(ctrl.split, 2) == "1 colocated + 1 parked"
    assert run(ctrl, [calm(t) for t in range(100)]) == []
    assert (
        run(PDController(2, SLO, merge=True, patience=1), [overloaded(t) for t in range(20)]) == []
    )


def test_merged_splits_on_interference_and_every_way_back_merges():
    ctrl = PDController(2, SLO, merge=True, patience=2, min_dwell_s=0)
    [d] = run(ctrl, [interfered(0), interfered(1)])
    assert (d.old, d.new) == (MERGED, (1, 1)) and "stall" in d.reason
    assert d.describe() == ("1 colocated + 1 parked", "1P+1D")
    [d] = run(ctrl, [overloaded(2), overloaded(3)])  # both phases over: back, merged
    assert d.new == MERGED and "both phases" in d.reason
    ctrl = PDController(2, SLO, start=(1, 1), merge=True, patience=1, min_dwell_s=0)
    assert [d.new for d in run(ctrl, [prefill_heavy(0)])] == [MERGED]
    ctrl = PDController(2, SLO, start=(1, 1), merge=True, patience=1, min_dwell_s=0)
    assert [d.new for d in run(ctrl, [decode_heavy(0)])] == [MERGED]


def test_spread_colocated_workers_merge():
    """Two colocated workers (after a restart, or an operator's split) merge when the
    controller merges, whatever the load."""
    ctrl = PDController(3, SLO, merge=True, patience=2, min_dwell_s=0)
    ctrl.split = (0, 3)
    [d] = run(ctrl, [calm(0), calm(1)])
    assert d.new == MERGED and describe(d.new, 3) == "1 colocated + 2 parked"
    # from merged, a split uses every worker, parked ones included
    ctrl = PDController(3, SLO, merge=True, patience=1, min_dwell_s=0)
    assert [d.new for d in run(ctrl, [interfered(0)])] == [(1, 2)]


def test_without_merge_a_one_worker_split_is_refused():
    with pytest.raises(ValueError, match="start split"):
        PDController(2, SLO, start=MERGED)
    assert PDController(2, SLO, start=MERGED, merge=True).split == MERGED


def test_no_split_when_one_workers_share_would_miss_the_ttft_target():
    """Splitting gives prompts one worker's share of the cores: TTFTs that would then miss the
    target (2 s here; n = 2 doubles them) keep the workers together, however the decodes fare."""
    from dataclasses import replace

    def with_ttfts(sample, ttfts):
        return replace(sample, recent_ttfts_s=tuple(ttfts))

    fast = [with_ttfts(interfered(t), [0.4, 0.7, 0.9] * 4) for t in range(3)]
    [d] = run(PDController(2, SLO, patience=3, min_dwell_s=0), fast)
    assert d.new == (1, 1) and "0.00 on one worker's share" in d.reason
    slow = [with_ttfts(interfered(t), [0.4, 0.7, 1.2] * 4) for t in range(10)]  # 1.2 s x 2 > 2 s
    assert run(PDController(2, SLO, patience=3, min_dwell_s=0), slow) == []
    assert run(PDController(2, SLO, merge=True, patience=3, min_dwell_s=0), slow) == []
    # three workers: one worker's share is a third
    [d] = run(PDController(3, SLO, patience=1, min_dwell_s=0), [with_ttfts(interfered(0), [0.6])])
    assert d.new == (1, 2)
    assert (
        run(PDController(3, SLO, patience=1, min_dwell_s=0), [with_ttfts(interfered(0), [0.7])])
        == []
    )
