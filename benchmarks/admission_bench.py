"""SLO-aware admission and request priorities of the chat profile, past this machine's capacity.

    python benchmarks/admission_bench.py --output admission.json              # ~25 minutes
    python benchmarks/admission_bench.py --experiments admission              # ~12 minutes
    python benchmarks/admission_bench.py --experiments priority --priority-aging-s 1000
    python benchmarks/admission_bench.py --reanalyze admission.json --slo ttft_ms=3000,tpot_ms=150
    python benchmarks/admission_bench.py --num-requests 10 --no-wait          # smoke, ~5 minutes

One colocated deployment of a random llama-125m (float32), started as `pdserve serve --profile
chat --cpus 0-1 --linear-backend torch --slo <the --slo's TTFT and TPOT>` on a free port, one
server per run, every run given requests built by `pdserve bench`'s own code: rows of
azure_conv_2023.csv (the load of disagg_bench.py: prompts capped at 1024 tokens, outputs at 128,
every output forced to its length), Poisson arrivals, `--seed`. `--capacity-rate` (default 0.4
req/s) is what this machine serves of that load: docs/PERFORMANCE.md ("Disaggregated against
colocated serving") measured the colocated worker 96% busy at 0.4 req/s with `--linear-backend
torch`, hence that kernel here (`auto` picks oneDNN for a colocated worker, which serves about
twice the rate: pass `--linear-backend onednn --capacity-rate 0.8` to test that). The SLO
(`--slo`, default ttft_ms=2000,tpot_ms=150) is stated before the run and given to the server too,
so that admission targets the same TTFT.

Experiment `admission`: the first `--num-requests` rows (default 80) at the capacity rate, and
twice as many rows at twice the rate (the same span of arrivals, twice the load):

  (a) capacity      --profile chat (SLO-aware admission on)
  (b) 2x capacity   --profile chat
  (c) 2x capacity   --profile chat --no-slo-admission (the same requests as (b))

Per run: requests sent, completed, refused (503 `ttft_slo_unattainable`, counted apart from any
other failure) and the server's pdserve_requests_rejected_total{reason="slo"}; goodput
(completed requests within the whole SLO per second from the first request sent to the last
one finished; a refused request is not good); SLO attainment over every request sent and over
the admitted ones; TTFT and TPOT p50/p99 of the admitted requests; the worker's share of the
run spent in steps. The target: goodput (b) >= 90% of goodput (a); (c) shows what admission
saves.

Experiment `priority`: the 2x-capacity requests with SLO admission off (`--no-slo-admission`, so
the queue forms), split in two classes with the same length distribution and interleaved
arrivals: a `--high-share` of the requests (default 0.3, spread evenly: at twice the capacity rate
the high class alone is 0.6x capacity, a load the machine can serve within the SLO) sent with
{"priority": 0} (high), the rest with {"priority": 1} (low), by two concurrent clients. The control is the same requests without
priorities: run (c) of the admission experiment when it ran in the same invocation (the same
server command; --priority-aging-s has no effect without priorities), else a run of its own.
Per class: requests completed, TTFT p50/p99, TPOT p50/p99, attainment of the TTFT SLO alone and
of the whole SLO. The target: the high class's TTFT p99 within the TTFT SLO while the low class
absorbs the queueing. `--priority-aging-s` is passed to the server when given (otherwise the
server's default, 60 s, reported): a waiting request gains one level per that many seconds, so
with aging a low-priority request that has waited one aging period longer than a high one ranks
with it; past capacity the queue keeps growing and both classes end up waiting.

Markdown tables are printed per experiment; `--output FILE` saves everything (per-request records
too), and `--reanalyze FILE` recomputes the tables of a saved run under another `--slo` without
running anything (what the server admitted by stays what it was).

Each run waits until no other benchmark, test or pdserve process runs and runs again (up to
`--attempts`) when one appeared while it ran; `--no-wait` runs at once (smoke runs). Duration at
the defaults, per server ~20 s to start and warm up: (a) and (b) ~4 minutes each (200 s of
arrivals, then the drain), (c) and the priority run ~5-8 minutes each (twice the work of (a) at
the capacity rate): about 25 minutes for both experiments, more while waiting for a quiet CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import re
import sys
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lib.disagg_analysis import per_worker_steps  # noqa: E402
from lib.machine import code_info, machine_info  # noqa: E402
from lib.paths import DEFAULT_125M, TRACE, ensure_125m  # noqa: E402
from lib.quiet import Watch, measured  # noqa: E402
from lib.server import Server, metric_total, send  # noqa: E402
from lib.tables import ms  # noqa: E402

from pdserve.bench.client import ClientConfig, run_requests  # noqa: E402
from pdserve.bench.metrics import CANCELLED, FAILED, RequestRecord, Slo, summarize  # noqa: E402
from pdserve.bench.tokenizer import HFPromptTokenizer, load_tokenizer  # noqa: E402
from pdserve.bench.traces import read_trace  # noqa: E402
from pdserve.bench.workload import (  # noqa: E402
    BenchRequest,
    WorkloadConfig,
    build_prompts,
    make_specs,
    with_rate,
)
from pdserve.config.engine import EngineArgs  # noqa: E402

DEFAULT_SLO = "ttft_ms=2000,tpot_ms=150"
REFUSAL_CODE = "ttft_slo_unattainable"
HIGH, LOW = 0, 1  # the two priority values (lower is more urgent)
TARGET_RATIO = 0.9  # goodput (b) / goodput (a)


def server_aging_default() -> float:
    return {f.name: f for f in dataclasses.fields(EngineArgs)}["priority_aging_s"].default


# ---- records ------------------------------------------------------------------------------------
def is_high(index: int, share: float) -> bool:
    """Whether request `index` is in the high class: a `share` of the requests, spread evenly
    over the run (the same requests whatever the run)."""
    return int((index + 1) * share) > int(index * share)


def is_refusal(r: RequestRecord) -> bool:
    """A 503 with code ttft_slo_unattainable: the bench client records it as a failed request
    (error "HTTP 503", the response body in error_detail)."""
    detail = r.error_detail or ""
    return (
        r.status == FAILED
        and r.error == "HTTP 503"
        and (REFUSAL_CODE in detail or "too busy to meet the time to first token" in detail)
    )


def refusal_rate(r: RequestRecord) -> float | None:
    """The prefill rate (prompt tokens/s) admission predicted with, from a refusal's message."""
    m = re.search(r"at (\d+(?:\.\d+)?) prompt tokens/s", r.error_detail or "")
    return float(m.group(1)) if m else None


def records_of(entry: dict) -> list[RequestRecord]:
    return [RequestRecord.from_dict(d) for d in entry["records"]]


# ---- running ------------------------------------------------------------------------------------
async def _send_groups(groups, base_url: str, model: str):
    """Each (requests, extra_body) group by a client of its own, all at once."""
    runs = [
        run_requests(reqs, ClientConfig(base_url, model, "completions", extra_body=body))
        for reqs, body in groups
    ]
    return await asyncio.gather(*runs)


def serve_and_run(args: list[str], model: str, groups, warmup, log: Path):
    with Server(args, log) as srv:
        # untimed, other prompts: compiles, and gives admission its first prefill rate
        if warmup:
            send(warmup, srv.base_url, model, max_concurrency=1)
        m0 = srv.metrics()
        per_group = asyncio.run(_send_groups(groups, srv.base_url, model))
        return srv.command_line, m0, srv.metrics(), per_group


def run_measured(fn, label: str, attempts: int, wait: bool):
    if wait:
        return measured(fn, label, attempts)
    with Watch() as w:
        result = fn()
    if w.disturbed:
        print(f"  {label}: disturbed by {w.disturbed[0]} (--no-wait: kept, marked)", flush=True)
    return result, {"waits_s": [], "attempts": 1, "disturbed": w.disturbed}


def run_one(
    experiment: str,
    name: str,
    label: str,
    rate: float,
    args: list[str],
    model: str,
    groups: list[tuple[list[BenchRequest], dict]],
    warmup,
    workdir: Path,
    a: argparse.Namespace,
) -> dict:
    """One server, one run; `groups` are sent concurrently, each with its extra body."""
    print(f"\n== {experiment} {name}: {label} at {rate:g} req/s ==", flush=True)
    log = workdir / f"{experiment}-{name}.log"
    (command, m0, m1, per_group), meta = run_measured(
        lambda: serve_and_run(args, model, groups, warmup, log), name, a.attempts, not a.no_wait
    )
    delta = lambda n, f="": metric_total(m1, n, f) - metric_total(m0, n, f)  # noqa: E731
    records, priorities = [], []
    for (_, body), recs in zip(groups, per_group):
        records += [r.to_dict() for r in recs]
        priorities += [body.get("priority")] * len(recs)
    entry = {
        "experiment": experiment,
        "name": name,
        "label": label,
        "rate": rate,
        "command": command,
        "log": str(log),
        "meta": meta,
        "disturbed": meta["disturbed"],
        "rejected_slo": delta("pdserve_requests_rejected_total", 'reason="slo"'),
        "rejected_overloaded": delta("pdserve_requests_rejected_total", 'reason="overloaded"'),
        "preemptions": delta("pdserve_preemptions"),
        "steps": per_worker_steps(m0, m1),
        "records": records,
        "priorities": priorities,  # per record: the priority sent (None: none sent)
    }
    print_run(entry)
    return entry


# ---- analysis -----------------------------------------------------------------------------------
def admission_figures(entry: dict, slo: Slo) -> dict:
    recs = [r for r in records_of(entry) if r.status != CANCELLED]
    refused = [r for r in recs if is_refusal(r)]
    admitted = [r for r in recs if not is_refusal(r)]
    s_all = summarize(recs, slo)  # refused requests are failed ones: they count as missing
    s_adm = summarize(admitted, slo)
    ttft_only = summarize(admitted, Slo(ttft_ms=slo.ttft_ms))
    other = Counter(r.error or "unknown" for r in admitted if r.status == FAILED)
    busy = sum(v["busy_s"] for v in entry["steps"].values())
    rates = [x for x in map(refusal_rate, refused) if x is not None]
    return {
        "sent": len(recs),
        "completed": s_all["completed"],
        "refused": len(refused),
        "other_failures": dict(other),
        "duration_s": s_all["duration_s"],
        "goodput": s_all["goodput"],
        "attainment_sent": s_all["slo_attainment"],
        "attainment_admitted": s_adm["slo_attainment"],
        "ttft_attainment_admitted": ttft_only["slo_attainment"],
        "ttft_ms": s_adm["ttft_ms"],
        "tpot_ms": s_adm["tpot_ms"],
        "e2e_ms": s_adm["e2e_ms"],
        "worker_busy_share": busy / s_all["duration_s"] if s_all["duration_s"] else None,
        # the prefill rate admission predicted with, as its refusals state it
        "refusal_rate_tok_s": [min(rates), float(np.median(rates)), max(rates)] if rates else None,
    }


def class_figures(recs: list[RequestRecord], slo: Slo) -> dict:
    recs = [r for r in recs if r.status != CANCELLED]
    s = summarize(recs, slo)
    return {
        "sent": len(recs),
        "completed": s["completed"],
        "failed": s["failed"],
        "errors": s["errors"],
        "duration_s": s["duration_s"],
        "ttft_ms": s["ttft_ms"],
        "tpot_ms": s["tpot_ms"],
        "ttft_attainment": summarize(recs, Slo(ttft_ms=slo.ttft_ms))["slo_attainment"],
        "attainment": s["slo_attainment"],
        "goodput": s["goodput"],
    }


def priority_figures(entry: dict, slo: Slo) -> dict:
    """Per class: by the priority sent, or (a run without priorities) by the class the same
    request has in the priority run (`is_high`); `all`: every request."""
    recs = records_of(entry)
    share = entry.get("high_share", 0.5)
    cls = [
        p if p is not None else (HIGH if is_high(r.index, share) else LOW)
        for r, p in zip(recs, entry["priorities"])
    ]
    out = {
        name: class_figures([r for r, c in zip(recs, cls) if c == value], slo)
        for name, value in (("high", HIGH), ("low", LOW))
    }
    if all(p is None for p in entry["priorities"]):  # one client, one clock
        out["all"] = class_figures(recs, slo)
    return out


def analyze(res: dict, slo: Slo) -> None:
    res["slo"] = slo.describe()
    for e in res.get("admission", []):
        e["figures"] = admission_figures(e, slo)
    for e in res.get("priority", {}).get("runs", []):
        e["figures"] = priority_figures(e, slo)


# ---- reports ------------------------------------------------------------------------------------
def pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


def p50_99(stats: dict) -> str:
    return f"{ms(stats['p50'])} / {ms(stats['p99'])}"


def md_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def print_run(entry: dict) -> None:
    recs = [r for r in records_of(entry) if r.status != CANCELLED]
    refused = sum(is_refusal(r) for r in recs)
    other = Counter(r.error for r in recs if r.status == FAILED and not is_refusal(r))
    done = sum(r.status != FAILED for r in recs)
    print(
        f"sent {len(recs)}, completed {done}, refused {refused} (server counted "
        f"{entry['rejected_slo']:.0f} slo rejections)"
        + (f", other failures {dict(other)}" if other else "")
    )
    if refused != round(entry["rejected_slo"]):
        print("  NOTE: the client's refusals and the server's slo rejections differ")
    if entry["disturbed"]:
        print(f"  DISTURBED by: {entry['disturbed']}")


def admission_report(res: dict) -> str:
    entries = res["admission"]
    f = [e["figures"] for e in entries]
    rows = [
        ("requests sent", lambda x, e: str(x["sent"])),
        ("completed", lambda x, e: str(x["completed"])),
        (f"refused ({REFUSAL_CODE})", lambda x, e: str(x["refused"])),
        ("other failures", lambda x, e: str(sum(x["other_failures"].values()))),
        ('rejected_total{reason="slo"} (server)', lambda x, e: f"{e['rejected_slo']:.0f}"),
        ("duration s", lambda x, e: f"{x['duration_s']:.0f}"),
        ("**goodput req/s**", lambda x, e: f"**{x['goodput']:.3f}**"),
        ("SLO attainment, of sent", lambda x, e: pct(x["attainment_sent"])),
        ("SLO attainment, of admitted", lambda x, e: pct(x["attainment_admitted"])),
        ("TTFT SLO attainment, of admitted", lambda x, e: pct(x["ttft_attainment_admitted"])),
        ("TTFT p50 / p99 ms (admitted)", lambda x, e: p50_99(x["ttft_ms"])),
        ("TPOT p50 / p99 ms (admitted)", lambda x, e: p50_99(x["tpot_ms"])),
        ("worker busy (share of run)", lambda x, e: pct(x["worker_busy_share"])),
        (
            "prefill rate in refusals, tok/s (min / median / max)",
            lambda x, e: " / ".join(f"{v:.0f}" for v in x["refusal_rate_tok_s"] or []) or "-",
        ),
        ("preemptions", lambda x, e: f"{e['preemptions']:.0f}"),
    ]
    header = [""] + [f"({e['name']}) {e['label']} @{e['rate']:g}" for e in entries]
    out = [f"### Admission (SLO {res['slo']}; server --slo {res['server_slo']})", ""]
    out.append(md_table(header, [[n] + [fn(x, e) for x, e in zip(f, entries)] for n, fn in rows]))
    by = {e["name"]: e["figures"] for e in entries}
    if "a" in by and by["a"]["goodput"]:
        for n in ("b", "c"):
            if n in by:
                ratio = by[n]["goodput"] / by["a"]["goodput"]
                verdict = (
                    f" (target >= {TARGET_RATIO:.0%}: {'met' if ratio >= TARGET_RATIO else 'MISSED'})"
                    if n == "b"
                    else ""
                )
                out.append(f"\ngoodput ({n}) / goodput (a) = {ratio:.2f}{verdict}")
    disturbed = [e["name"] for e in entries if e["disturbed"]]
    if disturbed:
        out.append(f"\nruns disturbed by other processes: {', '.join(disturbed)}")
    return "\n".join(out)


def priority_report(res: dict, slo: Slo) -> str:
    pr = res["priority"]
    header = [
        "run",
        "class",
        "sent",
        "completed",
        "TTFT p50 / p99 ms",
        "TPOT p50 / p99 ms",
        f"TTFT <= {slo.ttft_ms:g} ms",
        "whole SLO",
    ]
    rows = []
    for e in pr["runs"]:
        for cls, x in e["figures"].items():
            label = {
                "high": f"high (priority {HIGH})",
                "low": f"low (priority {LOW})",
                "all": "all",
            }[cls]
            if e["name"] == "control" and cls != "all":
                label = f"{cls}-class requests"
            rows.append(
                [
                    e["label"],
                    label,
                    str(x["sent"]),
                    str(x["completed"]),
                    p50_99(x["ttft_ms"]),
                    p50_99(x["tpot_ms"]),
                    pct(x["ttft_attainment"]),
                    pct(x["attainment"]),
                ]
            )
    aging = pr["aging_s"]
    out = [
        f"### Priorities at {pr['rate']:g} req/s, no SLO admission (SLO {res['slo']}; "
        f"--priority-aging-s {aging:g}{'' if pr['aging_given'] else ' (server default)'})",
        "",
        md_table(header, rows),
    ]
    if pr.get("control_from"):
        out.append(f"\ncontrol: {pr['control_from']}")
    run = next((e for e in pr["runs"] if e["name"] == "priority"), None)
    if run and slo.ttft_ms:
        p99 = run["figures"]["high"]["ttft_ms"]["p99"]
        met = p99 is not None and p99 <= slo.ttft_ms
        out.append(
            f"\nhigh-priority TTFT p99 {ms(p99)} ms against the TTFT SLO {slo.ttft_ms:g} ms: "
            + ("met" if met else "MISSED")
        )
    disturbed = [e["name"] for e in pr["runs"] if e["disturbed"]]
    if disturbed:
        out.append(f"\nruns disturbed by other processes: {', '.join(disturbed)}")
    return "\n".join(out)


def report(res: dict, slo: Slo) -> None:
    if res.get("admission"):
        print("\n" + admission_report(res))
    if res.get("priority", {}).get("runs"):
        print("\n" + priority_report(res, slo))


# ---- main ---------------------------------------------------------------------------------------
def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", help=f"model folder (default: random llama-125m in {DEFAULT_125M})")
    p.add_argument("--trace", default=str(TRACE))
    p.add_argument(
        "--experiments",
        default="admission,priority",
        help="comma-separated: admission, priority (default: both)",
    )
    p.add_argument(
        "--num-requests",
        type=int,
        default=80,
        help="requests at the capacity rate; the 2x runs send twice as many (default 80)",
    )
    p.add_argument(
        "--capacity-rate",
        type=float,
        default=0.4,
        help="req/s this machine serves of the load (default 0.4: the colocated worker was 96%% "
        "busy there with --linear-backend torch, docs/PERFORMANCE.md)",
    )
    p.add_argument("--max-input-len", type=int, default=1024)
    p.add_argument("--max-output-len", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--slo",
        default=DEFAULT_SLO,
        help=f"latency targets, ttft_ms and tpot_ms both given, passed to the server as its --slo "
        f"too (default: {DEFAULT_SLO})",
    )
    p.add_argument(
        "--linear-backend",
        default="torch",
        help="--linear-backend of the server (default torch: the kernel --capacity-rate was "
        "measured with)",
    )
    p.add_argument(
        "--admission-margin", type=float, help="--admission-margin of the server (default: its own)"
    )
    p.add_argument(
        "--priority-aging-s",
        type=float,
        help=f"--priority-aging-s of the priority runs' server (default: the server's, "
        f"{server_aging_default():g} s)",
    )
    p.add_argument(
        "--high-share",
        type=float,
        default=0.3,
        help="priority experiment: the share of requests sent with high priority, spread evenly "
        "(default 0.3: at twice the capacity rate the high class alone is 0.6x capacity)",
    )
    p.add_argument(
        "--warmup-requests",
        type=int,
        default=2,
        help="untimed 256-token requests sent one at a time to each server before its run (as "
        "disagg_bench.py does): admission has no prefill rate before the first (default 2)",
    )
    p.add_argument(
        "--attempts",
        type=int,
        default=2,
        help="runs of a configuration when another benchmark disturbed the previous one",
    )
    p.add_argument(
        "--no-wait",
        action="store_true",
        help="run at once, without waiting for a quiet CPU (a disturbed run is only marked)",
    )
    p.add_argument("--output", help="write every result (with per-request records) as JSON")
    p.add_argument(
        "--reanalyze",
        metavar="FILE",
        help="run nothing: recompute the tables of a saved --output under this --slo, print "
        "them (and write them to --output)",
    )
    a = p.parse_args()
    slo = Slo.parse(a.slo)
    if slo.ttft_ms is None or slo.tpot_ms is None:
        p.error("--slo needs both ttft_ms and tpot_ms (the server's --slo does)")
    if a.reanalyze:
        res = json.loads(Path(a.reanalyze).read_text())
        analyze(res, slo)
        report(res, slo)
        if a.output:
            Path(a.output).write_text(json.dumps(res, indent=1))
        return
    experiments = [x.strip() for x in a.experiments.split(",") if x.strip()]
    if not experiments or set(experiments) - {"admission", "priority"}:
        p.error(f"--experiments {a.experiments!r}: admission and/or priority")

    server_slo = f"ttft_ms={slo.ttft_ms:g},tpot_ms={slo.tpot_ms:g}"
    model = a.model or ensure_125m(DEFAULT_125M)
    cap, n = a.capacity_rate, a.num_requests
    wl = WorkloadConfig(
        num_requests=2 * n, max_input_len=a.max_input_len, max_output_len=a.max_output_len,
        request_rate=cap, seed=a.seed,
    )  # fmt: skip
    specs = make_specs(wl, read_trace(a.trace))
    tok = HFPromptTokenizer(load_tokenizer(model))
    requests = build_prompts(specs, tok, a.seed)
    at_cap = with_rate(requests[:n], cap, 1.0, a.seed)
    at_2x = with_rate(requests, 2 * cap, 1.0, a.seed)
    # warm-up prompts share no text with the measured ones (no prefix-cache hits)
    wcfg = WorkloadConfig(
        num_requests=a.warmup_requests or 1, input_len=256, output_len=8, seed=a.seed + 1000
    )
    warmup = build_prompts(make_specs(wcfg), tok, a.seed + 1000)[: a.warmup_requests]
    ins = np.array([r.input_len for r in requests])
    outs = np.array([r.output_len for r in requests])
    print(
        f"workload: {len(requests)} rows of {Path(a.trace).name}; input tokens p50 "
        f"{np.median(ins):.0f} mean {ins.mean():.0f} max {ins.max()}; output p50 "
        f"{np.median(outs):.0f} mean {outs.mean():.0f} max {outs.max()}; "
        f"{n} at {cap:g} req/s (arrivals over {at_cap[-1].send_at_s:.0f} s), "
        f"{2 * n} at {2 * cap:g} req/s (over {at_2x[-1].send_at_s:.0f} s)"
    )
    print(f"SLO (stated before the run): {slo.describe()}; server --slo {server_slo}")
    print(f"pdserve from {code_info()['pdserve']}")
    workdir = Path(tempfile.mkdtemp(prefix="admission_bench-"))
    print(f"logs in {workdir}")

    base = [
        "--model", model, "--profile", "chat", "--cpus", "0-1",
        "--linear-backend", a.linear_backend, "--slo", server_slo,
    ]  # fmt: skip
    if a.admission_margin is not None:
        base += ["--admission-margin", str(a.admission_margin)]
    no_adm = [*base, "--no-slo-admission"]
    res: dict = {
        "machine": machine_info(),
        "code": code_info(),
        "args": vars(a),
        "server_slo": server_slo,
        "workload": {
            "num_requests_capacity": n,
            "num_requests_2x": 2 * n,
            "input_p50": float(np.median(ins)), "input_mean": float(ins.mean()),
            "input_max": int(ins.max()), "output_p50": float(np.median(outs)),
            "output_mean": float(outs.mean()), "output_max": int(outs.max()),
        },
    }  # fmt: skip

    def run(exp, name, label, rate, args, groups):
        return run_one(exp, name, label, rate, args, model, groups, warmup, workdir, a)

    if "admission" in experiments:
        res["admission"] = [
            run("admission", "a", "capacity, admission", cap, base, [(at_cap, {})]),
            run("admission", "b", "2x, admission", 2 * cap, base, [(at_2x, {})]),
            run("admission", "c", "2x, no admission", 2 * cap, no_adm, [(at_2x, {})]),
        ]
    if "priority" in experiments:
        aging = a.priority_aging_s if a.priority_aging_s is not None else server_aging_default()
        prio_args = [*no_adm]
        if a.priority_aging_s is not None:
            prio_args += ["--priority-aging-s", str(a.priority_aging_s)]
        high = [r for r in at_2x if is_high(r.index, a.high_share)]
        low = [r for r in at_2x if not is_high(r.index, a.high_share)]
        groups = [(high, {"priority": HIGH}), (low, {"priority": LOW})]
        runs = [run("priority", "priority", "priorities", 2 * cap, prio_args, groups)]
        control_from = None
        if "admission" in experiments:
            control = dict(res["admission"][2], experiment="priority", name="control")
            control["label"] = "no priorities"
            control_from = "run (c) of the admission experiment (same requests and command)"
        else:
            control = run("priority", "control", "no priorities", 2 * cap, no_adm, [(at_2x, {})])
        runs.append(control)
        for e in runs:
            e["high_share"] = a.high_share
        res["priority"] = {
            "rate": 2 * cap,
            "aging_s": aging,
            "aging_given": a.priority_aging_s is not None,
            "high_share": a.high_share,
            "control_from": control_from,
            "runs": runs,
        }
    analyze(res, slo)
    report(res, slo)
    if a.output:
        Path(a.output).write_text(json.dumps(res, indent=1))
        print(f"\nwrote {a.output}")


if __name__ == "__main__":
    main()
