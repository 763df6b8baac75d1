"""Number formatting and plain-text tables for the benchmark reports."""

from __future__ import annotations


def ms(x: float | None) -> str:
    """Milliseconds: one decimal under 100, none above; `-` for no value."""
    return "-" if x is None else f"{x:.1f}" if x < 100 else f"{x:.0f}"


def print_rows(rows: list[tuple[str, str, str]]) -> None:
    """(name, value, note) rows: names left-aligned, values right-aligned, notes as they are."""
    widths = [max(len(row[i]) for row in rows) for i in range(2)]
    for name, value, note in rows:
        print(f"{name:<{widths[0]}}  {value:>{widths[1]}}  {note}")
