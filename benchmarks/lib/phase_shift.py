"""phase_shift_bench.py's load, its /deployment poller, and its figures and report.

The load: consecutive *stretches* of one kind of request each (prefill-heavy, decode-heavy,
mixed), Poisson arrivals at a rate of their own, built from trace rows by `pdserve bench`'s own
workload code and tagged with their stretch. The poller reads GET /deployment while a run goes
and keeps the split over time and every P:D decision. The figures: goodput and SLO attainment
per stretch (each request judged by the SLO of the stretch it belongs to) and overall, latency
percentiles per stretch, the adaptive deployment's goodput against the best static one, the
split's share of each stretch, and rolling attainment over time (the plot).
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np

from lib.tables import ms
from pdserve.bench.metrics import RequestRecord, Slo, summarize
from pdserve.bench.traces import TraceRow
from pdserve.bench.workload import RequestSpec, arrival_offsets

STRETCHES = ("prefill-heavy", "decode-heavy", "mixed")
# the deployments whose split moves (auto: between 1P+1D and two colocated workers;
# auto-merged: --pd-merge, between 1P+1D and one worker on both cores); the others are static
ADAPTIVE = ("auto", "auto-merged")


# ---- the load ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Stretch:
    """One stretch of the load: which trace rows, how their lengths are cut, how fast they come."""

    name: str
    trace: str  # path of an Azure CSV
    first_row: int  # rows are taken in trace order from here
    max_input_len: int
    max_output_len: int  # outputs are min(trace output, this) ...
    fixed_output_len: int | None  # ... or exactly this (decode-heavy: long answers)
    rate: float  # requests/s, Poisson

    def describe(self) -> str:
        out = (
            f"output = {self.fixed_output_len}"
            if self.fixed_output_len
            else f"output <= {self.max_output_len}"
        )
        return (
            f"{Path(self.trace).name} rows from {self.first_row}, input <= "
            f"{self.max_input_len}, {out}, Poisson {self.rate:g} req/s"
        )


def stretch_specs(
    st: Stretch,
    rows: list[TraceRow],
    start_s: float,
    length_s: float | None,
    seed: int,
    first_index: int,
    num: int | None = None,
) -> list[RequestSpec]:
    """The requests of one stretch: the arrivals of a Poisson process at `st.rate` that fall in
    [0, length_s), shifted to start at `start_s` (or the first `num` arrivals). Arrivals are
    drawn from (seed, the stretch's kind), so one stretch's requests do not depend on the
    others' rates or order. Indices run on from `first_index` (prompts are drawn from the
    index: no two requests of the run share a prompt prefix)."""
    kind = STRETCHES.index(st.name)
    draw = num or max(16, int(st.rate * (length_s or 0) * 3) + 16)
    while True:
        offsets = arrival_offsets(draw, st.rate, 1.0, seed * 16 + kind + 1)
        if num or offsets[-1] >= length_s:
            break
        draw *= 2
    if not num:
        offsets = [t for t in offsets if t < length_s]
    rows = rows[st.first_row : st.first_row + len(offsets)]
    if len(rows) < len(offsets):
        raise ValueError(
            f"{st.name}: {len(offsets)} requests, {len(rows)} trace rows from row {st.first_row}"
        )
    specs = []
    for i, (t, row) in enumerate(zip(offsets, rows)):
        out = st.fixed_output_len or max(1, min(row.output_len, st.max_output_len))
        specs.append(
            RequestSpec(
                first_index + i, start_s + t, max(1, min(row.input_len, st.max_input_len)), out
            )
        )
    return specs


def shape(lengths: list[int]) -> dict:
    a = np.array(lengths or [0])
    return {"p50": float(np.median(a)), "mean": float(a.mean()), "max": int(a.max())}


# ---- GET /deployment while a run goes ----------------------------------------------------------
def prefill_count(report: dict) -> int:
    return sum(1 for w in report.get("workers", []) if w.get("alive") and w["role"] == "prefill")


def new_decisions(seen: list[dict], now: list[dict]) -> list[dict]:
    """Decisions in `now` (the server's last few, oldest first) not already in `seen`: the
    longest tail of `seen` that `now` starts with is what both hold (compared without their
    `age_s`, which grows from one poll to the next)."""
    now = [{k: v for k, v in d.items() if k != "age_s"} | {"_age": d.get("age_s")} for d in now]
    key = lambda ds: [{k: v for k, v in d.items() if k != "_age"} for d in ds]  # noqa: E731
    for k in range(min(len(seen), len(now)), 0, -1):
        if key(now[:k]) == key(seen[-k:]):
            return now[k:]
    return list(now)


class DeploymentPoller:
    """Polls GET /deployment every `every_s` in a thread: `samples` (time, split, prefill
    workers, roles) and `decisions` (time first seen, from, to, reason). Times are seconds since
    `t0` (a `time.perf_counter()` reading: the start of the load). A decision's time is the poll's
    less the age the server gives it."""

    def __init__(self, base_url: str, every_s: float = 1.0) -> None:
        self.url = base_url + "/deployment"
        self.every_s = every_s
        self.t0 = time.perf_counter()
        self.samples: list[dict] = []
        self.decisions: list[dict] = []
        self.errors: Counter[str] = Counter()
        self._seen: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._http = httpx.Client(timeout=5.0, trust_env=False)

    def poll(self) -> dict | None:
        t = time.perf_counter() - self.t0
        try:
            r = self._http.get(self.url)
            r.raise_for_status()
            rep = r.json()
        except (httpx.HTTPError, ValueError) as e:
            self.errors[e.__class__.__name__] += 1
            return None
        self.samples.append(
            {
                "t": round(t, 3),
                "split": rep.get("split"),
                "prefill_workers": prefill_count(rep),
                "roles": [w["role"] for w in rep.get("workers", [])],
            }
        )
        fresh = new_decisions(self._seen, rep.get("decisions", []))
        for d in fresh:
            made = t - d["_age"] if d.get("_age") is not None else t  # the server's age of it
            self.decisions.append(
                {"t": round(made, 3), "from": d["old"], "to": d["new"], "reason": d["reason"]}
            )
        self._seen.extend(fresh)
        self._seen = self._seen[-200:]
        return rep

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.poll()

    def start(self, t0: float) -> DeploymentPoller:
        self.t0 = t0
        self.poll()  # the split as the load starts
        self._thread.start()
        return self

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        self.poll()
        self._http.close()
        return {
            "poll_s": self.every_s,
            "samples": self.samples,
            "decisions": self.decisions,
            "poll_errors": dict(self.errors),
        }


# ---- figures -----------------------------------------------------------------------------------
def slo_for(stretch: str, base: Slo, overrides: dict[str, Slo]) -> Slo:
    return overrides.get(stretch, base)


def _part(records: list[RequestRecord], slo: Slo, seconds: float) -> dict:
    s = summarize(records, slo)
    return {
        "requests": len(records),
        "completed": s["completed"],
        "failed": s["failed"],
        "meeting": s["num_meeting_slo"],
        "attainment": s["slo_attainment"],
        # requests in SLO per second of offered load (the stretch's length): one denominator
        # for every deployment, whatever its drain time
        "goodput": s["num_meeting_slo"] / seconds if seconds > 0 else 0.0,
        "goodput_run_duration": s["goodput"],  # summarize's: over first send .. last finish
        "slo": slo.describe(),
        "ttft_ms": s["ttft_ms"],
        "tpot_ms": s["tpot_ms"],
        "itl_ms": s["itl_ms"],
        "e2e_ms": s["e2e_ms"],
        "duration_s": s["duration_s"],
    }


def analyze(entry: dict, windows: dict[str, tuple[float, float]], base: Slo, over: dict) -> None:
    """Per-stretch and overall figures of one deployment's run, from its records (each a dict
    with a `stretch` key)."""
    by: dict[str, list[RequestRecord]] = {name: [] for name in windows}
    for d in entry["records"]:
        by[d["stretch"]].append(RequestRecord.from_dict(d))
    entry["stretches"] = {
        name: _part(recs, slo_for(name, base, over), windows[name][1] - windows[name][0])
        for name, recs in by.items()
    }
    parts = entry["stretches"].values()
    total_s = sum(b - a for a, b in windows.values())
    considered = sum(p["requests"] - _cancelled(by[n]) for n, p in entry["stretches"].items())
    meeting = sum(p["meeting"] for p in parts)
    everything = [r for recs in by.values() for r in recs]
    overall = _part(everything, base, total_s)
    overall.update(
        meeting=meeting,
        attainment=meeting / considered if considered else None,
        goodput=meeting / total_s if total_s > 0 else 0.0,
        slo="per stretch",
    )
    entry["overall"] = overall


def _cancelled(records: list[RequestRecord]) -> int:
    return sum(r.status == "cancelled" for r in records)


def compare(entries: list[dict], names: list[str]) -> dict:
    """Each adaptive deployment's goodput over the best static one's, per stretch and overall:
    {adaptive name: {part: ...}}."""
    static = [e for e in entries if e["name"] not in ADAPTIVE]
    out: dict = {}
    for auto in (e for e in entries if e["name"] in ADAPTIVE):
        if not static:
            break
        parts = out[auto["name"]] = {}
        for part in [*names, "overall"]:
            get = (lambda e, p=part: e["overall"]) if part == "overall" else (
                lambda e, p=part: e["stretches"][p]
            )  # fmt: skip
            best = max(static, key=lambda e: get(e)["goodput"])
            g_best, g_auto = get(best)["goodput"], get(auto)["goodput"]
            parts[part] = {
                "auto_goodput": g_auto,
                "best_static": best["name"],
                "best_static_goodput": g_best,
                "ratio": g_auto / g_best if g_best > 0 else None,
            }
    return out


def split_shares(timeline: dict, windows: dict[str, tuple[float, float]]) -> dict:
    """Share of each stretch's time spent in each split (from the polled samples: each sample's
    split holds until the next one)."""
    samples = timeline.get("samples", [])
    out = {}
    for name, (a, b) in windows.items():
        spent: Counter[str] = Counter()
        for s, nxt in zip(samples, [*samples[1:], None]):
            end = nxt["t"] if nxt else max(s["t"], b)
            lo, hi = max(a, s["t"]), min(b, end)
            if hi > lo:
                spent[s["split"] or f"{s['prefill_workers']}P"] += hi - lo
        total = sum(spent.values())
        out[name] = {k: v / total for k, v in spent.items()} if total else {}
    return out


def rolling_attainment(
    entry: dict, base: Slo, over: dict, window_s: float, step_s: float, end_s: float
) -> list[tuple[float, float | None]]:
    """(t, share of the requests scheduled in [t - window_s/2, t + window_s/2) that met their
    stretch's SLO)."""
    met = []
    for d in entry["records"]:
        r = RequestRecord.from_dict(d)
        if r.status != "cancelled":
            met.append((r.t_scheduled, slo_for(d["stretch"], base, over).met_by(r)))
    out = []
    for t in np.arange(0.0, end_s + step_s / 2, step_s):
        inside = [m for ts, m in met if t - window_s / 2 <= ts < t + window_s / 2]
        out.append((float(t), sum(inside) / len(inside) if inside else None))
    return out


# ---- report ------------------------------------------------------------------------------------
def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


def _p50_99(v: dict) -> str:
    return f"{ms(v['p50'])} / {ms(v['p99'])}"


def print_tables(res: dict) -> None:
    entries = res["deployments"]
    names = [s["name"] for s in res["workload"]["stretches"]]
    print("\n### Per deployment and stretch\n")
    print(
        "| deployment | stretch | SLO | requests (failed) | goodput req/s | attainment "
        "| TTFT p50 / p99 ms | TPOT p50 / p99 ms |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for e in entries:
        for part, p in [*((n, e["stretches"][n]) for n in names), ("overall", e["overall"])]:
            bold = "**" if part == "overall" else ""
            print(
                f"| {e['name']} | {bold}{part}{bold} | {p['slo']} | {p['requests']} "
                f"({p['failed']}) | {bold}{p['goodput']:.3f}{bold} | {_pct(p['attainment'])} "
                f"| {_p50_99(p['ttft_ms'])} | {_p50_99(p['tpot_ms'])} |"
            )
    for name, cmp in (res.get("comparison") or {}).items():
        print(f"\n### Goodput of {name} over the best static deployment\n")
        print("| | " + " | ".join(cmp) + " |")
        print("| --- |" + " --- |" * len(cmp))
        print(
            f"| {name} / best static | "
            + " | ".join("-" if c["ratio"] is None else f"{c['ratio']:.2f}" for c in cmp.values())
            + " |"
        )
        print(
            "| best static (goodput) | "
            + " | ".join(
                f"{c['best_static']} ({c['best_static_goodput']:.3f})" for c in cmp.values()
            )
            + " |"
        )
        print(
            f"| {name} goodput | "
            + " | ".join(f"{c['auto_goodput']:.3f}" for c in cmp.values())
            + " |"
        )
    for e in entries:
        tl = e.get("timeline")
        if not tl or not tl.get("samples"):
            continue
        print(f"\n### {e['name']}: the split over time\n")
        shares = e.get("split_shares", {})
        print("| stretch | time in each split |")
        print("| --- | --- |")
        for n in names:
            txt = ", ".join(f"{k} {v:.0%}" for k, v in sorted(shares.get(n, {}).items()))
            print(f"| {n} | {txt or '-'} |")
        print_decisions(tl, res["workload"]["stretches"])


def stretch_at(t: float, stretches: list[dict]) -> str:
    for s in stretches:
        if s["start_s"] <= t < s["end_s"]:
            return s["name"]
    return "after" if stretches and t >= stretches[-1]["end_s"] else "before"


def print_decisions(timeline: dict, stretches: list[dict], file=None) -> None:
    decisions = timeline.get("decisions", [])
    print(f"\nP:D decisions ({len(decisions)}; time = first poll that showed it):\n", file=file)
    print("| t s | stretch | from | to | reason |", file=file)
    print("| --- | --- | --- | --- | --- |", file=file)
    for d in decisions:
        print(
            f"| {d['t']:.1f} | {stretch_at(d['t'], stretches)} | {d['from']} | {d['to']} "
            f"| {d['reason']} |",
            file=file,
        )


def split_level(sample: dict) -> int:
    """Where a polled split sits on the plot: 0 merged (a worker parked, --pd-merge), 1 every
    worker colocated, 2 and up a P+D split (by its prefill workers)."""
    if "parked" in (sample.get("split") or ""):
        return 0
    return 1 + (sample.get("prefill_workers") or 0)


def plot(res: dict, path: str, window_s: float) -> str:
    """The split of each switchable deployment over time with the stretch boundaries, and the
    rolling SLO attainment of every deployment. Without matplotlib, the decisions timeline as a
    text table next to `path` (returns what was written)."""
    stretches = res["workload"]["stretches"]
    end_s = stretches[-1]["end_s"] if stretches else 0.0
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        txt = str(Path(path).with_suffix(".txt"))
        with open(txt, "w") as f:
            for e in res["deployments"]:
                if e.get("timeline"):
                    print(f"{e['name']}", file=f)
                    print_decisions(e["timeline"], stretches, file=f)
        return txt
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 6.5), sharex=True)
    colors = {}
    for e in res["deployments"]:
        colors[e["name"]] = bottom.plot([], [])[0].get_color()
    for e in res["deployments"]:
        tl = e.get("timeline") or {}
        s = tl.get("samples") or []
        if not s or e.get("control", "static") == "static":
            continue
        t = [x["t"] for x in s]
        p = [split_level(x) for x in s]
        top.step(t, p, where="post", color=colors[e["name"]], label=e["name"])
        for d in tl.get("decisions", []):
            top.annotate(
                f"{d['from']} -> {d['to']}",
                (d["t"], 1.0),
                rotation=90,
                fontsize=7,
                va="center",
                ha="right",
            )
            top.axvline(d["t"], color=colors[e["name"]], ls=":", lw=0.8)
    top.set_ylabel("split")
    top.set_ylim(-0.2, 2.4)
    top.set_yticks([0, 1, 2], ["merged (1 worker)", "colocated", "1P+1D"])
    if top.get_legend_handles_labels()[0]:
        top.legend(loc="upper right", fontsize=8)
    else:
        top.text(end_s / 2, 0.5, "no switchable deployment in this run", ha="center")
    base = Slo.parse(res["slo"]["base"])
    over = {k: Slo.parse(v) for k, v in res["slo"]["per_stretch"].items()}
    for e in res["deployments"]:
        pts = rolling_attainment(e, base, over, window_s, max(1.0, window_s / 10), end_s)
        bottom.plot(
            [t for t, _ in pts],
            [np.nan if a is None else a for _, a in pts],
            label=e["name"],
            color=colors[e["name"]],
        )
    bottom.set_ylabel(f"SLO attainment ({window_s:g} s window)")
    bottom.set_xlabel("s since the start of the load (attainment: by request arrival)")
    bottom.set_ylim(-0.05, 1.05)
    bottom.legend(loc="lower left", fontsize=8)
    for ax in (top, bottom):
        for st in stretches:
            ax.axvline(st["start_s"], color="grey", lw=0.8)
        ax.axvline(end_s, color="grey", lw=0.8)
    for st in stretches:
        top.text((st["start_s"] + st["end_s"]) / 2, 2.3, st["name"], ha="center", fontsize=9)
    fig.suptitle("phase-shifting load: the split of switchable deployments and SLO attainment")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def load(path: str) -> dict:
    return json.loads(Path(path).read_text())


def with_stretch(spec_stretch: dict[int, str], records) -> list[dict]:
    return [{**r.to_dict(), "stretch": spec_stretch[r.index]} for r in records]
