"""`pdserve profile`'s flags are checked before anything is measured."""

from __future__ import annotations

import argparse

import pytest

from pdserve.commands.profile import MAX_SPEED_TRACE_S, check_speed_trace


def flags(speed_trace: float, refit=None, analytic=None) -> argparse.Namespace:
    return argparse.Namespace(speed_trace=speed_trace, refit=refit, analytic=analytic)


@pytest.mark.parametrize("seconds", [-1.0, MAX_SPEED_TRACE_S + 1, float("inf"), float("nan")])
def test_a_speed_trace_out_of_range_is_refused(seconds):
    with pytest.raises(ValueError, match="invalid --speed-trace"):
        check_speed_trace(flags(seconds))


def test_a_speed_trace_is_refused_where_nothing_is_measured():
    with pytest.raises(ValueError, match="not with --refit"):
        check_speed_trace(flags(60.0, refit="p.json"))
    with pytest.raises(ValueError, match="not with --analytic"):
        check_speed_trace(flags(60.0, analytic="H100"))
    for ok in (flags(0.0), flags(0.0, refit="p.json"), flags(180.0), flags(MAX_SPEED_TRACE_S)):
        check_speed_trace(ok)  # in range, or none asked for
