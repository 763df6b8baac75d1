"""Rate sweeps: the same requests at several Poisson (or gamma) rates, goodput against rate.

Pure helpers; the runs themselves are `runner.run_sweep`. The answer a sweep gives is the
highest rate that keeps SLO attainment at or above a target: walking the rates upward, the last
one before attainment first drops below it (a lucky pass above a failing rate does not count).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any


def parse_rates(text: str) -> list[float]:
    """`"1,2,4.5,inf"` -> sorted rates in requests/s (each > 0)."""
    rates = []
    for item in text.split(","):
        if not item.strip():
            continue
        try:
            rate = float(item)
        except ValueError:
            raise ValueError(f"--sweep-rates item {item.strip()!r}: not a number") from None
        if not rate > 0:
            raise ValueError(f"--sweep-rates item {item.strip()!r}: must be > 0 (or inf)")
        rates.append(rate)
    if not rates:
        raise ValueError(f"--sweep-rates {text!r}: give at least one rate")
    return sorted(set(rates))


def max_rate_meeting(points: Sequence[tuple[float, float | None]], target: float) -> float | None:
    """Highest rate such that it and every lower rate have attainment >= `target`."""
    best = None
    for rate, attainment in sorted(points):
        if attainment is None or attainment < target:
            break
        best = rate
    return best


def sweep_payload(results: Sequence[Any], target: float) -> dict:
    """The JSON of a sweep: each rate's run and the highest rate meeting the target."""
    points = [(r.request_rate, r.summary["slo_attainment"]) for r in results]
    return {
        "target_attainment": target,
        "max_rate_meeting_target": max_rate_meeting(points, target),
        "runs": [r.to_dict() for r in results],
    }


def format_rate(rate: float | None) -> str:
    if rate is None:
        return "trace"
    return "inf" if math.isinf(rate) else f"{rate:g}"
