"""What a benchmark shows: tables on stdout, a JSON file, and PNG plots.

Tables are plain text built from summaries (`metrics.summarize`); the JSON holds the summaries
and every raw per-request record, so any figure can be recomputed; plots (matplotlib, imported
only when asked for) are TTFT and TPOT CDFs, and for sweeps latency and goodput against rate.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from pdserve.bench.metrics import COMPLETED, RequestRecord, Slo
from pdserve.bench.runner import RunResult
from pdserve.bench.sweep import format_rate

FORMAT_VERSION = 1
_LATENCY_ROWS = (("TTFT", "ttft_ms"), ("ITL", "itl_ms"), ("TPOT", "tpot_ms"), ("E2E", "e2e_ms"))
_STATS = ("mean", "p50", "p90", "p99")
_WIDTH = 72


def summary_table(summary: dict, title: str) -> str:
    """One run's figures: counts, throughput, latency percentiles, goodput."""
    rule = "-" * _WIDTH
    lines = [title, rule]
    lines += _pairs(
        [
            ("Completed requests", str(summary["completed"])),
            ("Failed requests", f"{summary['failed']}{_errors(summary['errors'])}"),
            ("Duration (s)", f"{summary['duration_s']:.2f}"),
            ("Request throughput (req/s)", f"{summary['request_throughput']:.2f}"),
            ("Input tokens/s", f"{summary['input_throughput']:.1f}"),
            ("Output tokens/s", f"{summary['output_throughput']:.1f}"),
        ]
    )
    lines += [rule, f"{'Latency (ms)':<16}" + "".join(f"{s:>12}" for s in _STATS)]
    for name, key in _LATENCY_ROWS:
        lines.append(f"{name:<16}" + "".join(f"{_num(summary[key][s]):>12}" for s in _STATS))
    lines.append(rule)
    lines += _pairs(
        [
            ("SLO", Slo(**summary["slo"]).describe()),
            ("Goodput (req/s)", f"{summary['goodput']:.2f}"),
            ("SLO attainment", _attainment(summary)),
        ]
    )
    return "\n".join([*lines, rule])


def comparison_table(named: Mapping[str, dict | None], title: str = "") -> str:
    """Summaries side by side, one column per deployment (None: it did not run)."""
    names = list(named)
    width = max(12, *(len(n) + 2 for n in names))
    rows: list[tuple[str, Callable[[dict], str]]] = [
        ("completed", lambda s: str(s["completed"])),
        ("failed", lambda s: str(s["failed"])),
        ("duration (s)", lambda s: f"{s['duration_s']:.2f}"),
        ("requests/s", lambda s: f"{s['request_throughput']:.2f}"),
        ("input tokens/s", lambda s: f"{s['input_throughput']:.1f}"),
        ("output tokens/s", lambda s: f"{s['output_throughput']:.1f}"),
    ]
    for label, key in _LATENCY_ROWS:
        for stat in _STATS:
            rows.append((f"{label} {stat} (ms)", lambda s, k=key, st=stat: _num(s[k][st])))
    rows += [
        ("goodput (req/s)", lambda s: f"{s['goodput']:.2f}"),
        ("SLO attainment", lambda s: _percent(s["slo_attainment"])),
    ]
    lines = [title] if title else []
    lines.append(f"{'':<20}" + "".join(f"{n:>{width}}" for n in names))
    for label, cell in rows:
        values = [cell(s) if s is not None else "-" for s in named.values()]
        lines.append(f"{label:<20}" + "".join(f"{v:>{width}}" for v in values))
    return "\n".join(lines)


def sweep_table(results: Sequence[RunResult], target: float, max_rate: float | None) -> str:
    """One line per rate, then the highest rate that keeps attainment >= target."""
    head = ("rate", "done", "failed", "req/s", "goodput", "attain", "TTFT p50", "TTFT p99")
    head += ("TPOT p50", "TPOT p99")
    lines = ["".join(f"{h:>10}" for h in head)]
    for r in results:
        s = r.summary
        cells = (
            format_rate(r.request_rate) + ("*" if r.interrupted else ""),
            str(s["completed"]),
            str(s["failed"]),
            f"{s['request_throughput']:.2f}",
            f"{s['goodput']:.2f}",
            _percent(s["slo_attainment"]),
            _num(s["ttft_ms"]["p50"]),
            _num(s["ttft_ms"]["p99"]),
            _num(s["tpot_ms"]["p50"]),
            _num(s["tpot_ms"]["p99"]),
        )
        lines.append("".join(f"{c:>10}" for c in cells))
    best = "none" if max_rate is None else f"{format_rate(max_rate)} req/s"
    lines.append(f"highest rate with SLO attainment >= {target:.0%}: {best}")
    if any(r.interrupted for r in results):
        lines.append("* interrupted: partial results")
    return "\n".join(lines)


def write_json(path: str | Path, payload: dict) -> Path:
    """Write `payload`: indented, except one line per request record (lists under "requests");
    non-finite numbers become the strings "inf", "-inf", "nan"."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {"format_version": FORMAT_VERSION, **payload}
    path.write_text(_dumps(body) + "\n")
    return path


def _dumps(value: object, depth: int = 0, key: str | None = None) -> str:
    pad = " " * (depth + 1)
    if isinstance(value, dict) and value:
        items = [f"{pad}{json.dumps(k)}: {_dumps(v, depth + 1, k)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + "\n" + " " * depth + "}"
    if isinstance(value, list) and value and (key == "requests" or isinstance(value[0], dict)):
        if key == "requests":
            items = [pad + json.dumps(_finite(v), allow_nan=False) for v in value]
        else:
            items = [pad + _dumps(v, depth + 1) for v in value]
        return "[\n" + ",\n".join(items) + "\n" + " " * depth + "]"
    return json.dumps(_finite(value), allow_nan=False)


def plot_cdfs(
    out_dir: str | Path, named_records: Mapping[str, Sequence[RequestRecord]], slo: Slo
) -> list[Path]:
    """ttft_cdf.png and tpot_cdf.png: one curve per run, the SLO target as a dashed line."""
    plt = _pyplot()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for key, label, target in (("ttft", "TTFT", slo.ttft_ms), ("tpot", "TPOT", slo.tpot_ms)):
        fig, ax = plt.subplots(figsize=(6, 4))
        for name, records in named_records.items():
            values = sorted(
                getattr(r, key) * 1000.0
                for r in records
                if r.status == COMPLETED and getattr(r, key) is not None
            )
            if values:
                ys = [(i + 1) / len(values) for i in range(len(values))]
                ax.step(values, ys, where="post", label=name)
        if target is not None:
            ax.axvline(target, color="grey", linestyle="--", label=f"SLO {target:g} ms")
        ax.set(
            xlabel=f"{label} (ms)", ylabel="fraction of completed requests", title=f"{label} CDF"
        )
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
        paths.append(_save(fig, out / f"{key}_cdf.png", plt))
    return paths


def plot_sweeps(out_dir: str | Path, named_sweeps: Mapping[str, Sequence[RunResult]]) -> list[Path]:
    """latency_vs_rate.png (TTFT and TPOT p50/p99) and goodput_vs_rate.png; finite rates only."""
    plt = _pyplot()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, (label, key) in zip(axes, (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"))):
        for i, (name, results) in enumerate(named_sweeps.items()):
            for stat, style in (("p50", "-o"), ("p99", "--o")):
                xs, ys = _series(results, lambda s, k=key, st=stat: s[k][st])
                ax.plot(xs, ys, style, color=f"C{i}", label=f"{name} {stat}".strip())
        ax.set(xlabel="request rate (req/s)", ylabel=f"{label} (ms)", title=f"{label} vs rate")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    paths = [_save(fig, out / "latency_vs_rate.png", plt)]
    fig, ax = plt.subplots(figsize=(6, 4))
    for i, (name, results) in enumerate(named_sweeps.items()):
        xs, ys = _series(results, lambda s: s["goodput"])
        ax.plot(xs, ys, "-o", color=f"C{i}", label=f"{name} goodput".strip())
        xs, ys = _series(results, lambda s: s["request_throughput"])
        ax.plot(xs, ys, ":", color=f"C{i}", label=f"{name} throughput".strip())
    ax.set(xlabel="request rate (req/s)", ylabel="req/s", title="goodput vs rate")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    paths.append(_save(fig, out / "goodput_vs_rate.png", plt))
    return paths


def _series(
    results: Sequence[RunResult], value: Callable[[dict], float | None]
) -> tuple[list[float], list[float]]:
    points = [
        (r.request_rate, value(r.summary))
        for r in results
        if r.request_rate is not None and math.isfinite(r.request_rate)
    ]
    points = [(x, y) for x, y in points if y is not None]
    return [x for x, _ in points], [y for _, y in points]


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path, plt) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _finite(value):
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _pairs(items: Sequence[tuple[str, str]]) -> list[str]:
    return [f"{label:<32}{value}" for label, value in items]


def _errors(errors: dict[str, int]) -> str:
    if not errors:
        return ""
    return "   (" + ", ".join(f"{kind}: {n}" for kind, n in errors.items()) + ")"


def _attainment(summary: dict) -> str:
    total = summary["completed"] + summary["failed"]
    return f"{_percent(summary['slo_attainment'])} ({summary['num_meeting_slo']} of {total})"


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"
