"""`pdserve advise`: which phase limits a deployment, and what to change.

Two sources: a live server (`--url`: `/metrics` scraped every `--interval` seconds over
`--window` seconds, and `/deployment` for its SLO and settings), or a saved `pdserve bench` JSON
(`--bench`: the client's per-request records, and the server's `/metrics` before and after the
run when the bench saved them). With `--sim-profile`, `--model` and `--devices`, a bench run's
requests also go through `pdserve plan`, and its pick is part of the advice.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

HELP = "say which phase limits a server (live, or from a pdserve bench JSON) and what to change"


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_argument_group("source (one of)")
    src.add_argument("--url", help="a running pdserve server, e.g. http://127.0.0.1:8000")
    src.add_argument("--bench", metavar="FILE", help="a pdserve bench --output JSON")
    g = p.add_argument_group("advise")
    g.add_argument("--api-key", help="the server's API key (default: $PDSERVE_API_KEY)")
    g.add_argument("--window", type=float, default=30.0, help="seconds to watch (--url; 30)")
    g.add_argument("--interval", type=float, default=1.0, help="seconds between scrapes (1)")
    g.add_argument(
        "--slo",
        help="latency targets ttft_ms=..,tpot_ms=.. (default: the server's, or the bench's, "
        "else ttft_ms=2000,tpot_ms=150)",
    )
    g.add_argument("--json", action="store_true", help="print the verdict as JSON")
    plan = p.add_argument_group("the planner's pick (with --bench)")
    plan.add_argument("--sim-profile", metavar="FILE", help="step-time profile (pdserve profile)")
    plan.add_argument("--model", help="model folder (its config.json is read)")
    plan.add_argument("--devices", type=int, help="device budget to plan for")


def run(args: argparse.Namespace) -> int:
    import os

    if bool(args.url) == bool(args.bench):
        raise ValueError("give one of --url and --bench")
    if args.window <= 0 or args.interval <= 0:
        raise ValueError("--window and --interval must be > 0")
    api_key = args.api_key or os.environ.get("PDSERVE_API_KEY")
    if args.url:
        verdicts = [("", *_live(args.url.rstrip("/"), api_key, args))]
    else:
        verdicts = _from_bench(args)
    for name, verdict, plan in verdicts:
        if args.json:
            print(json.dumps({"name": name, **verdict.to_dict(), "plan": plan}))
            continue
        if name:
            print(f"== {name}")
        print(verdict.text())
        if plan:
            print("\nthe planner's pick for this load (simulated):")
            for row in plan:
                print(f"  - {row['name']}: {row['goodput']:.3f} req/s  `{row['flags']}`")
        print()
    return 0


def _slo(text: str | None, fallback: dict | None) -> tuple[float, float]:
    from pdserve.bench.metrics import Slo

    if text:
        s = Slo.parse(text)
        return _seconds(s.ttft_ms), _seconds(s.tpot_ms)
    fallback = fallback or {"ttft_ms": 2000.0, "tpot_ms": 150.0}
    return _seconds(fallback.get("ttft_ms")), _seconds(fallback.get("tpot_ms"))


def _seconds(ms: float | None) -> float | None:
    return None if ms is None else ms / 1e3


def _live(url: str, api_key: str | None, args):
    import httpx

    from pdserve.planner.advisor import advise
    from pdserve.planner.observation import from_window
    from pdserve.planner.scrape import Scrape, Window

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with httpx.Client(base_url=url, headers=headers, timeout=10, trust_env=False) as client:

        def get(path: str) -> httpx.Response:
            try:
                r = client.get(path)
            except httpx.HTTPError as e:
                raise ValueError(f"cannot reach {url}: {e}") from None
            if r.status_code in (401, 403):
                raise ValueError(f"{url} refused the API key (HTTP {r.status_code}): --api-key")
            return r

        facts = get("/deployment")
        facts = facts.json() if facts.status_code == 200 else {}
        scrapes = []
        deadline = time.monotonic() + args.window
        while True:
            r = get("/metrics")
            if r.status_code != 200:
                raise ValueError(f"{url}/metrics answered HTTP {r.status_code}")
            scrapes.append(Scrape.parse(r.text, time.monotonic()))
            if time.monotonic() >= deadline:
                break
            if sys.stderr.isatty():
                print(f"\rwatching {url}: {len(scrapes)} scrapes", end="", file=sys.stderr)
            time.sleep(min(args.interval, max(0.0, deadline - time.monotonic())))
    if sys.stderr.isatty():
        print(file=sys.stderr)
    ttft, tpot = _slo(args.slo, facts.get("slo"))
    obs = from_window(Window(scrapes), ttft, tpot)
    return advise(obs, facts.get("settings")), None


def _from_bench(args):
    """(name, verdict, plan rows) for each run of a bench JSON."""
    from pdserve.bench.metrics import RequestRecord
    from pdserve.planner.advisor import advise
    from pdserve.planner.observation import from_records, from_window
    from pdserve.planner.scrape import Scrape, Window

    try:
        with open(args.bench) as f:
            payload = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {args.bench}: {e}") from None
    out = []
    for name, run in _runs(payload):
        records = [RequestRecord.from_dict(r) for r in run.get("requests", [])]
        ttft, tpot = _slo(args.slo, (run.get("summary") or {}).get("slo"))
        server = None
        scrapes = run.get("server_metrics")
        if scrapes:
            window = Window([Scrape.parse(scrapes[k]["text"], scrapes[k]["t"])
                             for k in ("before", "after")])  # fmt: skip
            server = from_window(window, ttft, tpot)
        obs = from_records(records, ttft, tpot, server)
        out.append((name, advise(obs), _plan(args, records, ttft, tpot)))
    if not out:
        raise ValueError(f"{args.bench}: no run in it (not a pdserve bench --output JSON?)")
    return out


def _runs(payload: dict):
    if "requests" in payload:
        yield "", payload
    for run in (payload.get("sweep") or {}).get("runs", []):
        yield f"rate {run.get('request_rate')}", run
    for dep in payload.get("deployments", []):
        if "requests" in dep:
            yield dep.get("name", ""), dep
        for run in (dep.get("sweep") or {}).get("runs", []):
            yield f"{dep.get('name', '')} rate {run.get('request_rate')}", run


def _plan(args, records, ttft_s, tpot_s) -> list[dict] | None:
    """The planner's top three for the run's requests, or None without a profile."""
    if not args.sim_profile:
        return None
    if not args.model or not args.devices:
        raise ValueError("--sim-profile needs --model and --devices")
    from pdserve.bench.metrics import Slo
    from pdserve.bench.workload import RequestSpec
    from pdserve.config import ModelConfig
    from pdserve.planner.plan import candidates, rank
    from pdserve.planner.profile import Profile

    profile = Profile.load(args.sim_profile)
    specs = [
        RequestSpec(i, r.t_scheduled, r.num_input_tokens, r.output_len)
        for i, r in enumerate(sorted(records, key=lambda r: r.t_scheduled))
    ]
    slo = Slo(ttft_ms=ttft_s and ttft_s * 1e3, tpot_ms=tpot_s and tpot_s * 1e3)
    cands = candidates(args.model, args.devices, cpu=profile.kind == "measured")
    max_len = ModelConfig.from_pretrained(args.model).max_model_len
    ranked = rank(profile, specs, slo, cands, max_model_len=max_len)
    return [
        {"name": r.candidate.name, "goodput": r.goodput,
         "flags": " ".join(r.candidate.serve_flags()) or "(defaults)"}
        for r in ranked[:3]
    ]  # fmt: skip
