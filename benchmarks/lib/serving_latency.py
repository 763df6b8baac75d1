"""Part 1 of serving_bench.py: latency at low load, the offline engine against `pdserve serve`.

The same prompts one at a time, greedy, `ignore_eos`, through the offline engine (`pdserve.LLM`
in a child process: serving_bench.py `--_offline`, per-request `RequestMetrics`) and through a
`pdserve serve` subprocess with `pdserve bench`'s streaming client at concurrency 1.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import numpy as np

from lib.paths import BENCHMARKS
from lib.quiet import measured
from lib.server import Server, metric_total, prompts_for, send
from lib.tables import ms
from pdserve.bench.metrics import COMPLETED, latency_stats, summarize

SCRIPT = BENCHMARKS / "serving_bench.py"  # its `--_offline` mode runs `offline_main`


def offline_main(
    model: str, prompts_file: str, out_file: str, output_len: int, burst: bool = False
) -> None:
    """Child process: each prompt alone through `pdserve.LLM`, greedy, its RequestMetrics and
    the engine's own step times; or (`burst`) all prompts in one `generate` call."""
    from pdserve import LLM, SamplingParams

    prompts, warmup = json.loads(Path(prompts_file).read_text())
    llm = LLM(model=model)
    params = SamplingParams(
        temperature=0, max_tokens=output_len, min_tokens=output_len, ignore_eos=True
    )
    if burst:
        llm.generate(warmup, params)
        t0, c0 = time.perf_counter(), os.times()
        outs = llm.generate(prompts, params)
        wall, c1 = time.perf_counter() - t0, os.times()
        ntok = sum(len(o.outputs[0].token_ids) for o in outs)
        cpu = (c1.user - c0.user) + (c1.system - c0.system)
        res = {
            "num_requests": len(prompts),
            "wall_s": wall,
            "request_throughput": len(prompts) / wall,
            "output_throughput": ntok / wall,
            "cores": cpu / wall,
        }
        Path(out_file).write_text(json.dumps(res))
        return
    core = llm.engine.core
    core_step, steps = core.step, []

    def timed_step():  # the same step times the server's workers export to /metrics
        prev = core.last_step
        out = core_step()
        if core.last_step is not prev:
            steps.append((core.last_step.phase, core.last_step.step_time_s))
        return out

    core.step = timed_step
    for p in warmup:  # untimed, other prompts (no prefix-cache hits for the timed ones)
        llm.generate([p], params)
    steps.clear()
    rows = []
    for p in prompts:
        (out,) = llm.generate([p], params)
        m = out.metrics
        rows.append(
            {
                "ttft": m.ttft,
                "itl": m.itl,
                "tpot": m.tpot,
                "e2e": m.e2e,
                "prompt_tokens": m.num_prompt_tokens,
                "output_tokens": len(out.outputs[0].token_ids),
            }
        )
    Path(out_file).write_text(json.dumps({"rows": rows, "steps": steps}))


def step_means(pairs) -> dict[str, float]:
    """Mean step time (ms) per phase from (phase, seconds) pairs."""
    by: dict[str, list[float]] = {}
    for phase, sec in pairs:
        by.setdefault(phase, []).append(sec)
    return {k: float(np.mean(v)) * 1e3 for k, v in by.items()}


def with_overheads(res: dict) -> dict:
    """TTFT beyond the prefill step and TPOT beyond the decode step: what is not the model."""
    st = res["step_ms"]
    res["ttft_minus_prefill_step_ms"] = res["ttft_ms"]["mean"] - st.get("prefill", np.nan)
    res["tpot_minus_decode_step_ms"] = res["tpot_ms"]["mean"] - st.get("decode", np.nan)
    return res


def run_offline(
    model: str, prompts_file: Path, out_file: Path, output_len: int, burst: bool = False
) -> dict:
    """`offline_main` in a child process (serving_bench.py `--_offline`); what it wrote."""
    cmd = [sys.executable, str(SCRIPT), "--_offline", model, str(prompts_file), str(out_file)]
    subprocess.run([*cmd, str(output_len), *(["--burst"] if burst else [])], check=True)
    return json.loads(out_file.read_text())


def offline_run(model: str, requests, warmup, output_len: int, workdir: Path) -> dict:
    pf, of = workdir / "prompts.json", workdir / "offline.json"
    pf.write_text(json.dumps([[r.prompt for r in requests], [r.prompt for r in warmup]]))
    data = run_offline(model, pf, of, output_len)
    rows = data["rows"]
    return with_overheads(
        {
            "ttft_ms": latency_stats(r["ttft"] for r in rows),
            "itl_ms": latency_stats(g for r in rows for g in r["itl"]),
            "tpot_ms": latency_stats(r["tpot"] for r in rows),
            "e2e_ms": latency_stats(r["e2e"] for r in rows),
            "step_ms": step_means(data["steps"]),
            "prompt_tokens": sorted({r["prompt_tokens"] for r in rows}),
            "output_tokens": sorted({r["output_tokens"] for r in rows}),
        }
    )


def server_run(model: str, requests, warmup, workdir: Path) -> dict:
    with Server(["--model", model], workdir / "serve-latency.log") as srv:
        send(warmup, srv.base_url, model, max_concurrency=1)  # untimed, other prompts
        m0 = srv.metrics()
        records = send(requests, srv.base_url, model, max_concurrency=1)
        m1 = srv.metrics()
        command = srv.command_line
    done = [r for r in records if r.status == COMPLETED]
    s = summarize(records)
    st = [r.server_timings or {} for r in done]
    step_ms = {}
    for phase in ("prefill", "decode", "mixed"):
        f = f'phase="{phase}"'
        n = metric_total(m1, "pdserve_step_time_seconds_count", f) - metric_total(
            m0, "pdserve_step_time_seconds_count", f
        )
        sec = metric_total(m1, "pdserve_step_time_seconds_sum", f) - metric_total(
            m0, "pdserve_step_time_seconds_sum", f
        )
        if n:
            step_ms[phase] = sec / n * 1e3
    return with_overheads(
        {
            "command": command,
            "completed": s["completed"],
            "failed": s["failed"],
            "ttft_ms": s["ttft_ms"],
            "itl_ms": s["itl_ms"],
            "tpot_ms": s["tpot_ms"],
            "e2e_ms": s["e2e_ms"],
            "server_ttft_ms": latency_stats(t["ttft_ms"] / 1e3 for t in st if "ttft_ms" in t),
            "server_tpot_ms": latency_stats(t["tpot_ms"] / 1e3 for t in st if t.get("tpot_ms")),
            "step_ms": step_ms,
            "chunks_per_request": float(np.mean([len(r.token_times) for r in done])),
            "prompt_tokens": sorted({r.prompt_tokens for r in done}),
            "output_tokens": sorted({r.completion_tokens for r in done}),
        }
    )


def latency_part(models: list[str], a, workdir: Path) -> list[dict]:
    """Offline and server alternately, `a.rounds` times each: the host's speed drifts between
    runs (shared memory bandwidth), so each comparison is between neighbouring runs."""
    results = []
    for model in models:
        name = Path(model).name
        print(f"\n== low-load latency: {name} ==", flush=True)
        both = prompts_for(model, a.num_requests + 5, a.input_len, a.output_len)
        # the first N are what `pdserve bench --num-requests N` sends; 5 more warm up
        requests, warmup = both[: a.num_requests], both[a.num_requests :]
        entry: dict = {"model": model, "name": name, "offline": [], "server": [], "meta": []}
        for i in range(a.rounds):
            runs = {
                "offline": partial(offline_run, model, requests, warmup, a.output_len, workdir),
                "server": partial(server_run, model, requests, warmup, workdir),
            }
            for what, fn in runs.items():
                res, meta = measured(fn, f"{name} {what} round {i + 1}")
                entry[what].append(res)
                entry["meta"].append({"what": what, "round": i + 1, **meta})
                gc.collect()
            print_latency(entry, i)
        results.append(entry)
    return results


def print_latency(e: dict, i: int) -> None:
    off, srv = e["offline"][i], e["server"][i]
    print(
        f"{e['name']} round {i + 1}: prompt tokens {srv['prompt_tokens']} (offline "
        f"{off['prompt_tokens']}), output tokens {srv['output_tokens']} (offline "
        f"{off['output_tokens']})"
    )
    print(
        f"{'ms':<10}{'offline p50':>12}{'server p50':>12}{'diff':>8}"
        f"{'offline mean':>14}{'server mean':>13}{'diff':>8}"
    )
    for key in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"):
        o, s = off[key], srv[key]
        print(
            f"{key[:-3].upper():<10}{ms(o['p50']):>12}{ms(s['p50']):>12}"
            f"{ms(s['p50'] - o['p50']):>8}{ms(o['mean']):>14}{ms(s['mean']):>13}"
            f"{ms(s['mean'] - o['mean']):>8}"
        )
    for label, key in (
        ("TTFT - prefill step", "ttft_minus_prefill_step_ms"),
        ("TPOT - decode step", "tpot_minus_decode_step_ms"),
    ):
        print(f"{label:<20}{ms(off[key]):>8} (offline){ms(srv[key]):>8} (server)")
    print(
        f"step ms offline {off['step_ms']}, server worker {srv['step_ms']}; server-side TTFT "
        f"(frontend timings) p50 {ms(srv['server_ttft_ms']['p50'])} ms"
    )
