"""What serving adds to the engine's steps on this machine: the frontend's CPU and latency.

`pdserve profile` times steps in-process; a served step shares its cores with the frontend
process (detokenizing and streaming every token) and, in a benchmark, with the client. On a CPU
every millisecond they take from a core that a worker's threads run on delays that worker's
step. `measure_serving_costs` starts `pdserve serve` with the profile's model and kernels on all
allowed CPUs, streams a fixed synthetic load through it with `pdserve bench`'s client, and
measures, per output token, the CPU time of the frontend (its `process_cpu_seconds_total`) and
of the client (this process), and the time a first token spends outside the engine (the
client's TTFT minus the server's own). The simulator adds them to a step (`planner/simulator`).
"""

from __future__ import annotations

import asyncio
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

from pdserve.config import EngineArgs
from pdserve.planner.profile import ServingCosts

NUM_REQUESTS = 32
CONCURRENCY = 6
INPUT_LEN, OUTPUT_LEN = 256, 64


def measure_serving_costs(args: EngineArgs, log=print) -> ServingCosts:
    from pdserve.bench.client import ClientConfig, fetch_metrics, run_requests
    from pdserve.bench.compare import Deployment, ServerProcess
    from pdserve.bench.tokenizer import HFPromptTokenizer, load_tokenizer
    from pdserve.bench.workload import WorkloadConfig, build_prompts, make_specs
    from pdserve.planner.scrape import Scrape, Window

    cpus = sorted(os.sched_getaffinity(0))
    port = _free_port()
    base_url = f"http://127.0.0.1:{port}"
    serve = [
        sys.executable, "-m", "pdserve.cli", "serve", "--model", args.model, "--port", str(port),
        "--cpus", ",".join(map(str, cpus)), "--linear-backend", str(args.linear_backend),
        "--dtype", str(args.dtype), "--log-level", "warning",
    ]  # fmt: skip
    workload = WorkloadConfig(
        num_requests=NUM_REQUESTS, input_len=INPUT_LEN, output_len=OUTPUT_LEN, seed=0
    )
    tokenizer = HFPromptTokenizer(load_tokenizer(args.tokenizer or args.model))
    prompts = build_prompts(make_specs(workload), tokenizer)
    client = ClientConfig(base_url, args.model, "completions")
    log_path = Path(tempfile.mkdtemp(prefix="pdserve-profile-")) / "serve.log"
    with ServerProcess(Deployment("calibration", base_url, tuple(serve)), log_path):
        asyncio.run(run_requests(prompts[:CONCURRENCY], client, CONCURRENCY))  # warm up
        before = fetch_metrics(base_url)
        cpu0 = time.process_time()
        records = asyncio.run(run_requests(prompts, client, CONCURRENCY))
        client_cpu = time.process_time() - cpu0
        after = fetch_metrics(base_url)
    if before is None or after is None:
        raise RuntimeError(f"the calibration server gave no /metrics; see {log_path}")
    window = Window([Scrape.parse(s["text"], s["t"]) for s in (before, after)])
    tokens = sum(r.num_output_tokens for r in records if r.status == "completed")
    if tokens == 0:
        raise RuntimeError(f"the calibration requests failed; see {log_path}")
    outside = [
        r.ttft - r.server_timings["ttft_ms"] / 1e3
        for r in records
        if r.ttft is not None and r.server_timings and r.server_timings.get("ttft_ms") is not None
    ]
    costs = ServingCosts(
        cpus=len(cpus),
        frontend_cpu_per_token_s=window.increase("process_cpu_seconds_total") / tokens,
        client_cpu_per_token_s=client_cpu / tokens,
        frontend_latency_s=max(statistics.median(outside), 0.0) if outside else 0.0,
    )
    log(
        f"serving on {len(cpus)} CPUs: frontend {costs.frontend_cpu_per_token_s * 1e3:.2f} ms and "
        f"client {costs.client_cpu_per_token_s * 1e3:.2f} ms of CPU per output token, "
        f"{costs.frontend_latency_s * 1e3:.1f} ms of TTFT outside the engine"
    )
    return costs


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
