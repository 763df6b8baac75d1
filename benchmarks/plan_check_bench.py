"""Is the planner's pick the measured best? `pdserve plan`'s ranking against real runs.

    pdserve profile --model DIR --linear-backend onednn --threads 1,2 --output prof.json
    python benchmarks/plan_check_bench.py --profile prof.json --output plan_check.json  # ~90 min
    python benchmarks/plan_check_bench.py --reanalyze plan_check.json

For each workload (the three of sim_accuracy_bench.py: conv, code, mooncake, `--num-requests`
requests at the trace's lengths, Poisson arrivals), the planner ranks the deployments of this
machine's 2 cores (`planner.plan.candidates`: one worker on both cores, two colocated workers,
1P+1D, at token budgets of 256, 512 and 2048) by simulated goodput: the highest arrival rate at
which `--target` of the requests meet `--slo`. Its top `--top` candidates are then measured:
each is started as `pdserve serve` with its flags (pinned as the simulation assumed: one worker
on CPUs 0-1, or one worker per core) and sent the same requests at the same rates, around the
goodput the planner predicts for its first choice (`--rate-factors` times it; the very same
requests at each rate, time-scaled).
The measured goodput is the highest rate whose attainment reaches the target, interpolated
linearly between the two measured rates that straddle it. The question: is the planner's first
choice the measured best, or within 5% of it?
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lib.machine import code_info, machine_info  # noqa: E402
from lib.paths import DEFAULT_125M, ensure_125m  # noqa: E402
from lib.quiet import measured  # noqa: E402
from lib.server import Server, send  # noqa: E402
from sim_accuracy_bench import TRACES  # noqa: E402

from pdserve.bench.metrics import Slo, summarize  # noqa: E402
from pdserve.bench.tokenizer import HFPromptTokenizer, load_tokenizer  # noqa: E402
from pdserve.bench.traces import read_trace  # noqa: E402
from pdserve.bench.workload import WorkloadConfig, build_prompts, make_specs  # noqa: E402
from pdserve.config import ModelConfig  # noqa: E402
from pdserve.planner.plan import Candidate, candidates, rank  # noqa: E402
from pdserve.planner.profile import Profile  # noqa: E402


def pinned_flags(c: Candidate) -> list[str]:
    """The candidate's serve flags with the CPU placement the simulation assumed."""
    flags = list(c.serve_flags())
    d = c.disagg
    if d.num_workers == 1:
        return [*flags, "--cpus", f"0-{c.threads_per_worker - 1}"]
    cpus = iter(range(d.num_workers))
    for _ in range(d.num_prefill_workers):
        flags += ["--prefill-cpus", str(next(cpus))]
    for _ in range(d.num_decode_workers):
        flags += ["--decode-cpus", str(next(cpus))]
    return flags


def measured_goodput(points: list[tuple[float, float]], target: float) -> float:
    """The highest rate meeting `target`, linear between the straddling measured rates."""
    points = sorted(points)
    best = 0.0
    for (r0, a0), (r1, a1) in zip([(0.0, 1.0), *points], points):
        if a1 >= target:
            best = r1
        elif a0 >= target:
            best = max(best, r0 + (r1 - r0) * (a0 - target) / (a0 - a1))
            break
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--profile")
    p.add_argument("--model", help=f"model folder (default: random llama-125m in {DEFAULT_125M})")
    p.add_argument("--workloads", default="conv,code,mooncake")
    p.add_argument("--num-requests", type=int, default=30)
    p.add_argument("--slo", default="ttft_ms=2000,tpot_ms=150")
    p.add_argument("--target", type=float, default=0.9)
    p.add_argument("--top", type=int, default=3)
    p.add_argument("--rate-factors", default="0.6,0.8,1.0,1.3")
    p.add_argument("--mooncake-scale", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--linear-backend", default="onednn")
    p.add_argument("--attempts", type=int, default=2)
    p.add_argument("--output")
    p.add_argument("--reanalyze", metavar="FILE")
    a = p.parse_args()
    if a.reanalyze:
        report(json.loads(Path(a.reanalyze).read_text())["workloads"])
        return
    if not a.profile:
        p.error("--profile is required")
    profile = Profile.load(a.profile)
    model = a.model or ensure_125m(DEFAULT_125M)
    slo = Slo.parse(a.slo)
    tok = HFPromptTokenizer(load_tokenizer(model))
    max_len = ModelConfig.from_pretrained(model).max_model_len
    workdir = Path(tempfile.mkdtemp(prefix="plan_check-"))
    factors = [float(x) for x in a.rate_factors.split(",")]
    results = []
    for wname in a.workloads.split(","):
        path, scale, max_in, max_out = TRACES[wname]
        wl = WorkloadConfig(
            num_requests=a.num_requests, length_scale=a.mooncake_scale if scale is None else scale,
            max_input_len=max_in, max_output_len=max_out, request_rate=1.0, seed=a.seed,
        )  # fmt: skip
        specs = make_specs(wl, read_trace(path))  # at 1 req/s: a rate r scales times by 1/r
        prompts = build_prompts(specs, tok, a.seed)
        cands = [dataclasses.replace(c, engine=dataclasses.replace(
            c.engine, linear_backend=a.linear_backend)) for c in candidates(model, 2)]  # fmt: skip
        ranked = rank(profile, specs, slo, cands, max_model_len=max_len, target=a.target,
                      local_client=True)  # the client runs here too  # fmt: skip
        entry = {"workload": wname, "ranking": [], "measured": []}
        for r in ranked:
            entry["ranking"].append({"name": r.candidate.name, "goodput": r.goodput})
        rates = [ranked[0].goodput * f for f in factors]  # one grid for every candidate
        for r in ranked[: a.top]:
            flags = ["--model", model, *pinned_flags(r.candidate)]
            points = []
            for rate in rates:
                timed = [dataclasses.replace(q, send_at_s=q.send_at_s / rate) for q in prompts]

                def run(flags=flags, timed=timed, tag=f"{wname}-{len(points)}"):
                    with Server(flags, workdir / f"{tag}.log") as srv:
                        return send(timed, srv.base_url, model)

                records, meta = measured(run, f"{wname} {r.candidate.name} @{rate:.3f}", a.attempts)
                att = summarize(records, slo)["slo_attainment"] or 0.0
                points.append((rate, att))
                print(f"  {wname} {r.candidate.name} @ {rate:.3f} req/s: attainment {att:.0%}",
                      flush=True)  # fmt: skip
            entry["measured"].append({
                "name": r.candidate.name, "serve": flags, "predicted": r.goodput,
                "points": points, "goodput": measured_goodput(points, a.target),
            })  # fmt: skip
        results.append(entry)
        report([entry])
    report(results)
    if a.output:
        Path(a.output).write_text(json.dumps({
            "machine": machine_info(), "code": code_info(), "args": vars(a),
            "profile": profile.to_dict(), "workloads": results,
        }, indent=1))  # fmt: skip
        print(f"wrote {a.output}")


def report(results: list[dict]) -> None:
    for e in results:
        print(f"\n{e['workload']}: simulated goodput (req/s) / measured (attainment at each rate)")
        print("| candidate | simulated | measured | points |")
        print("| --- | --- | --- | --- |")
        for m in e["measured"]:
            pts = ", ".join(f"{r:.3f}: {att:.0%}" for r, att in m["points"])
            print(f"| {m['name']} | {m['predicted']:.3f} | {m['goodput']:.3f} | {pts} |")
        if e["measured"]:
            pick = e["measured"][0]
            best = max(e["measured"], key=lambda m: m["goodput"])
            ratio = pick["goodput"] / best["goodput"] if best["goodput"] else float("nan")
            print(f"pick: {pick['name']}; measured best: {best['name']}; pick / best = {ratio:.2f}")


if __name__ == "__main__":
    main()
