"""Prometheus scrapes of a pdserve server, and what changed between them (no torch).

A `Scrape` is one reading of `/metrics` (the text a client fetched, or the families the server's
own registry collects: the same samples either way). A `Window` of scrapes answers the questions
the advisor and the dashboard ask of a stretch of time: how much a counter grew, the quantiles of
what a histogram observed in between (Prometheus' `histogram_quantile`: linear inside a bucket),
and a gauge's mean or peak over the scrapes. Series are selected by name and label values.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

Labels = tuple[tuple[str, str], ...]


class Scrape:
    """One reading of a server's metrics: every sample by name, then by its labels."""

    def __init__(self, t: float, by_name: dict[str, dict[Labels, float]]) -> None:
        self.t = t  # seconds, any monotonic origin
        self.by_name = by_name

    @classmethod
    def of_families(cls, families: Iterable, t: float) -> Scrape:
        """From `prometheus_client` metric families (a registry's `collect()` or parsed text)."""
        by_name: dict[str, dict[Labels, float]] = {}
        for family in families:
            for s in family.samples:
                labels = tuple(sorted(s.labels.items()))
                by_name.setdefault(s.name, {})[labels] = float(s.value)
        return cls(t, by_name)

    @classmethod
    def parse(cls, text: str, t: float) -> Scrape:
        """From the Prometheus text format; raises ValueError on text that is not."""
        from prometheus_client.parser import text_string_to_metric_families

        try:
            return cls.of_families(text_string_to_metric_families(text), t)
        except (ValueError, TypeError, IndexError) as e:
            raise ValueError(f"not Prometheus text: {e}") from None

    def series(self, name: str, **match: str) -> dict[Labels, float]:
        """The samples of `name` whose labels include `match`."""
        found = self.by_name.get(name, {})
        if not match:
            return found
        want = match.items()
        return {labels: v for labels, v in found.items() if want <= set(labels)}

    def has(self, name: str) -> bool:
        return name in self.by_name


@dataclass(frozen=True)
class Histogram:
    """What a histogram observed in a window: cumulative bucket counts by upper bound."""

    buckets: tuple[tuple[float, float], ...]  # (le, count), ascending, ending with +inf
    count: float
    total: float

    @property
    def mean(self) -> float | None:
        return self.total / self.count if self.count > 0 else None

    def quantile(self, q: float) -> float | None:
        """The q-quantile, linear inside its bucket; the top finite bound for the +Inf bucket."""
        if self.count <= 0 or not self.buckets:
            return None
        rank = q * self.count
        lower_bound, lower_count = 0.0, 0.0
        for le, cum in self.buckets:
            if cum >= rank:
                if math.isinf(le):
                    return lower_bound
                if cum == lower_count:
                    return le
                return lower_bound + (le - lower_bound) * (rank - lower_count) / (cum - lower_count)
            lower_bound, lower_count = le, cum
        return lower_bound


class Window:
    """Scrapes in time order; the first and last bound the window."""

    def __init__(self, scrapes: Sequence[Scrape]) -> None:
        if not scrapes:
            raise ValueError("a window needs at least one scrape")
        self.scrapes = list(scrapes)
        self.first, self.last = self.scrapes[0], self.scrapes[-1]

    @property
    def seconds(self) -> float:
        return self.last.t - self.first.t

    def increases(self, name: str, **match: str) -> dict[Labels, float]:
        """How much each matching series of a counter (or a cumulative gauge) grew; a series
        that restarted (a restarted worker) counts from zero."""
        before = self.first.series(name, **match)
        out = {}
        for labels, v in self.last.series(name, **match).items():
            old = before.get(labels, 0.0)
            out[labels] = v - old if v >= old else v
        return out

    def increase(self, name: str, **match: str) -> float:
        """`increases` summed over the matching series."""
        return sum(self.increases(name, **match).values())

    def increases_by(self, name: str, label: str, **match: str) -> dict[str, float]:
        """`increase` per value of `label` (per worker, per phase, ...)."""
        out: dict[str, float] = {}
        for labels, v in self.increases(name, **match).items():
            key = dict(labels).get(label)
            if key is not None:
                out[key] = out.get(key, 0.0) + v
        return out

    def histogram(self, name: str, **match: str) -> Histogram:
        """The observations of histogram `name` (its matching series summed) in the window."""
        bounds: dict[float, float] = {}
        for labels, v in self.increases(f"{name}_bucket", **match).items():
            le = dict(labels)["le"]
            bound = math.inf if le in ("+Inf", "inf") else float(le)
            bounds[bound] = bounds.get(bound, 0.0) + v
        return Histogram(
            tuple(sorted(bounds.items())),
            self.increase(f"{name}_count", **match),
            self.increase(f"{name}_sum", **match),
        )

    def gauge(self, name: str, how: str = "mean", **match: str) -> float | None:
        """The matching series summed at each scrape, then their mean or max over the window
        (None: no scrape has the gauge)."""
        totals = [sum(series.values()) for s in self.scrapes if (series := s.series(name, **match))]
        if not totals:
            return None
        return max(totals) if how == "max" else sum(totals) / len(totals)

    def gauge_by(self, name: str, label: str, **match: str) -> dict[str, float]:
        """The mean over the scrapes of each value of `label`."""
        seen: dict[str, list[float]] = {}
        for s in self.scrapes:
            for labels, v in s.series(name, **match).items():
                key = dict(labels).get(label)
                if key is not None:
                    seen.setdefault(key, []).append(v)
        return {k: sum(vs) / len(vs) for k, vs in seen.items()}
