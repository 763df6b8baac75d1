"""What serving adds to the engine's steps on this machine: the frontend's CPU and latency.

`pdserve profile` times steps in-process; a served step shares its cores with the frontend
process (detokenizing and streaming every token) and, in a benchmark, with the client. On a CPU
every millisecond they take from a core that a worker's threads run on delays that worker's
step. `measure_serving_costs` starts `pdserve serve` with the profile's model and kernels on all
allowed CPUs, streams a fixed synthetic load through it with `pdserve bench`'s client, and
measures, per output token, the CPU time of the frontend (its `process_cpu_seconds_total`) and
of the client (this process), and the time a first token spends outside the engine (the
client's TTFT minus the server's own). The simulator adds them to a step (`planner/simulator`).

Before that load, a few requests go one at a time, so that every step's shape is known (one
prompt from an empty cache, then decodes of one sequence): a served step takes longer than the
profile's in-process step of the same shape by more than the frontend's CPU per token (the
worker's loop between steps; the frontend's and the client's processes preempting one of the
worker's threads, which the other then waits for at the next barrier). The factor per kind of
step is the served time (the server's TTFT for the prompt step, the client's median inter-token
time for decodes) less the CPU per token, over the in-process time of the same steps: each
request served alone is run again in this process right after (the server idle), so that the
two sides of the ratio are taken seconds apart. This machine's speed moves by a third from
minute to minute, and the ratio against the profile's model, fitted minutes earlier, took that
drift in with the serving overhead (x1.35 decode on one profile, x1.09 on another). The requests
served alone have prompts of 16 to 512 tokens, and the prompt step is fitted as a fixed cost
plus a factor: a short prompt served pays some milliseconds of its own that a ratio taken on
long prompts alone hid (`planner.profile.step_factors`).

A worker on part of the CPUs (the decode worker of a 1P+1D split) leaves the frontend room to
run beside it instead of on its cores: with more than one CPU, a second server split into a
prefill worker and a decode worker on half the CPUs each serves a few requests one at a time,
each run again in-process on the decode worker's CPUs, and that decode factor is kept apart
(`ServingCosts.part_decode_step_factor`; x0.96-1.00 on a 2-core Zen 4 where the worker on both
CPUs took x1.11). The same requests give the split's prefill worker its factor: its prompt steps
by its own clock (the server's step-time histogram, where only that worker runs prompt steps)
over the in-process prompt steps on as many CPUs (`ServingCosts.part_prefill_step_factor`); the
first token's fixed cost and its way out stay in the terms measured on the whole machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from pdserve.config import EngineArgs
from pdserve.heap import frozen_heap
from pdserve.planner.profile import ServingCosts, part_cpu_per_token, worker_step_factor
from pdserve.planner.profile import step_factors as profile_step_factors
from pdserve.planner.step_model import StepModel

NUM_REQUESTS = 32
CONCURRENCY = 6
INPUT_LEN, OUTPUT_LEN = 256, 64
# requests sent one at a time, for the served/in-process step factors: prompts of several
# lengths, so that a served prompt step's fixed cost and its factor can be told apart
SEQUENTIAL_LENS = (16, 64, 256, 512) * 2
# ... and as many again for their prompt step alone (one token out), a few seconds more for a
# line that one slow step moves less
PROMPT_ONLY_LENS = (16, 64, 256, 512) * 2
# between the two sides of a pair: the threads of the engine that ran last spin for a while
# after its step, on the same cores as the other's next step
SETTLE_S = 0.5
# requests sent one at a time through a server split in two (a prefill and a decode worker, each
# on half the CPUs), for the factors of a worker on part of the CPUs; the first warms it up (a
# prompt served twice would hit the prefix cache the second time)
PART_LENS = (256,) * 5


def measure_serving_costs(
    args: EngineArgs, log=print, step_models: Callable[[int], StepModel] | None = None
) -> ServingCosts:
    """`step_models(n)`: the profile's model of a worker on n CPUs (`Profile.step_model`), for
    the step factors (without it they stay 1.0)."""
    from pdserve.bench.client import ClientConfig, fetch_metrics, run_requests
    from pdserve.bench.compare import Deployment, ServerProcess
    from pdserve.bench.tokenizer import HFPromptTokenizer, load_tokenizer
    from pdserve.bench.workload import WorkloadConfig, build_prompts, make_specs
    from pdserve.planner.scrape import Scrape, Window

    cpus = sorted(os.sched_getaffinity(0))
    port = _free_port()
    base_url = f"http://127.0.0.1:{port}"
    serve = _serve_command(args, port, "--cpus", _cpu_list(cpus))
    workload = WorkloadConfig(
        num_requests=NUM_REQUESTS,
        input_len=INPUT_LEN,
        output_len=OUTPUT_LEN,
        seed=0,
    )
    tokenizer = HFPromptTokenizer(load_tokenizer(args.tokenizer or args.model))
    prompts = build_prompts(make_specs(workload), tokenizer)
    # each its own seed: no prompt shares a prefix with another (the prefix cache)
    lengths = [(n, OUTPUT_LEN) for n in SEQUENTIAL_LENS] + [(n, 1) for n in PROMPT_ONLY_LENS]
    lengths += [(n, OUTPUT_LEN) for n in PART_LENS]  # the split server's, last
    alone = []
    for i, (n, out) in enumerate(lengths):
        one = WorkloadConfig(num_requests=1, input_len=n, output_len=out, seed=1 + i)
        alone += build_prompts(make_specs(one), tokenizer, 1 + i)
    alone, part = alone[: -len(PART_LENS)], alone[-len(PART_LENS) :]
    client = ClientConfig(base_url, args.model, "completions")
    log_path = Path(tempfile.mkdtemp(prefix="pdserve-profile-")) / "serve.log"
    # the client's heap frozen as `pdserve bench` freezes it: its CPU per token is that client's
    core = _in_process_engine(args, len(cpus))
    with ServerProcess(Deployment("calibration", base_url, tuple(serve)), log_path), frozen_heap():
        asyncio.run(run_requests(prompts[:CONCURRENCY], client, CONCURRENCY))  # warm up
        sequential, in_process, prompt_steps = _served_and_in_process(alone, client, core, cpus)
        del core
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
    outside, alone_outside = _outside(records), _outside(sequential)
    frontend_cpu = window.increase("process_cpu_seconds_total") / tokens
    client_cpu = client_cpu / tokens
    calibration = served_steps(sequential, in_process)
    factors = {}
    if step_models is not None:
        model = step_models(len(cpus))
        factors = profile_step_factors(calibration, model, frontend_cpu + client_cpu)
    costs = ServingCosts(
        cpus=len(cpus),
        frontend_cpu_per_token_s=frontend_cpu,
        client_cpu_per_token_s=client_cpu,
        frontend_latency_s=max(statistics.median(outside), 0.0) if outside else 0.0,
        frontend_latency_alone_s=max(statistics.median(alone_outside), 0.0)
        if alone_outside
        else None,
        latency_streams=CONCURRENCY,
        **factors,
        calibration_steps=calibration,
    )
    costs = dataclasses.replace(
        costs, first_token_extra_s=_first_token_extra(sequential, prompt_steps, costs)
    )
    if len(cpus) >= 2:
        from pdserve.bench.errors import BenchError

        try:
            costs = _measure_part(args, costs, part, step_models, log_path.parent)
        except BenchError as e:  # the split server did not start: every worker takes the one
            log(f"no decode factor of a worker on part of the CPUs: {e}")
    log(
        f"serving on {len(cpus)} CPUs: frontend {costs.frontend_cpu_per_token_s * 1e3:.2f} ms and "
        f"client {costs.client_cpu_per_token_s * 1e3:.2f} ms of CPU per output token, "
        f"{costs.frontend_latency_s * 1e3:.1f} ms of TTFT outside the engine at {CONCURRENCY} "
        f"streams ({(costs.frontend_latency_alone_s or 0) * 1e3:.1f} ms alone, a first token "
        f"{(costs.first_token_extra_s or 0) * 1e3:+.1f} ms more); a served step "
        f"takes x{costs.decode_step_factor:.2f} (decode) and "
        f"{costs.prefill_step_overhead_s * 1e3:.1f} ms + x{costs.prefill_step_factor:.2f} (prompt) "
        "the in-process one"
        + (
            f"; a decode worker on {costs.part_cpus} of them x{costs.part_decode_step_factor:.2f}"
            if costs.part_decode_step_factor is not None
            else ""
        )
        + (
            f", a prefill worker's own prompt step x{costs.part_prefill_step_factor:.2f}"
            if costs.part_prefill_step_factor is not None
            else ""
        )
    )
    return costs


def _outside(records) -> list[float]:
    """Each request's time outside the engine: the client's TTFT less the server's own."""
    return [
        r.ttft - r.server_timings["ttft_ms"] / 1e3
        for r in records
        if r.ttft is not None and r.server_timings and r.server_timings.get("ttft_ms") is not None
    ]


def _measure_part(
    args: EngineArgs,
    costs: ServingCosts,
    prompts: list,
    step_models: Callable[[int], StepModel] | None,
    log_dir: Path,
) -> ServingCosts:
    """`costs` with the factors of a worker on part of the CPUs: a server split into a prefill
    worker and a decode worker on half the CPUs each serves `prompts` one at a time (the first
    only warms it up), and each is run again in this process on the decode worker's CPUs,
    seconds later."""

    from pdserve.bench.client import ClientConfig, run_requests
    from pdserve.bench.compare import Deployment, ServerProcess

    cpus = sorted(os.sched_getaffinity(0))
    prefill, decode = cpus[: len(cpus) // 2], cpus[len(cpus) // 2 :]
    port = _free_port()
    base_url = f"http://127.0.0.1:{port}"
    serve = _serve_command(args, port, "--prefill-workers", "1", "--decode-workers", "1",
                           "--prefill-cpus", _cpu_list(prefill), "--decode-cpus", _cpu_list(decode))  # fmt: skip
    client = ClientConfig(base_url, args.model, "completions")
    with _pinned(decode):  # the engine's threads are made here, on the decode worker's CPUs
        core = _in_process_engine(args, len(decode))
    deployment = Deployment("calibration-split", base_url, tuple(serve))
    with ServerProcess(deployment, log_dir / "split.log"):
        asyncio.run(run_requests(prompts[:1], client, 1))  # warm up
        served, in_process, prompt_steps = _served_and_in_process(prompts[1:], client, core, decode)
    del core
    steps = served_steps(served, in_process)
    # only the prefill worker runs prompt steps: its own clock against the in-process prompt
    # step on as many CPUs (the decode worker's, which are as fast)
    pairs = [[w, own[0]] for w, own in zip(prompt_steps, in_process) if w is not None and own]
    out = dataclasses.replace(
        costs,
        part_cpus=len(decode),
        part_calibration_steps=steps,
        part_prompt_steps=pairs,
        part_prefill_step_factor=worker_step_factor(pairs),
    )
    if step_models is not None:
        cpu = part_cpu_per_token(out, costs.frontend_cpu_per_token_s + costs.client_cpu_per_token_s)
        factors = profile_step_factors(steps, step_models(len(decode)), cpu)
        out = dataclasses.replace(out, part_decode_step_factor=factors.get("decode_step_factor"))
    return out


def _served_and_in_process(prompts, client, core, cpus: list[int]) -> tuple[list, list, list]:
    """Each prompt served alone, then the same shapes run in `core` on `cpus` (the server
    idle): the pairs lie seconds apart, where this machine's speed can move by a third in
    minutes. (the served records, the in-process step times of each, and the seconds of each
    served request's prompt steps by the worker's own clock, from the server's /metrics; None
    where it gave none)"""
    from pdserve.bench.client import run_requests

    served, in_process, prompt_steps = [], [], []
    for prompt in prompts:
        time.sleep(SETTLE_S)
        before = _prompt_step_seconds(client.base_url)
        served += asyncio.run(run_requests([prompt], client, 1))
        after = _prompt_step_seconds(client.base_url)
        prompt_steps.append(None if None in (before, after) else after - before)
        time.sleep(SETTLE_S)
        with _pinned(cpus):
            in_process.append(_run_in_process(core, served[-1]))
    return served, in_process, prompt_steps


def _prompt_step_seconds(base_url: str) -> float | None:
    """The time a server's workers spent in steps with prompt tokens so far (its step-time
    histogram), or None where it has no /metrics."""
    from pdserve.bench.client import fetch_metrics
    from pdserve.planner.scrape import Scrape

    got = fetch_metrics(base_url)
    if got is None:
        return None
    scrape = Scrape.parse(got["text"], got["t"])
    return sum(
        v
        for phase in ("prefill", "mixed")
        for v in scrape.series("pdserve_step_time_seconds_sum", phase=phase).values()
    )


def _first_token_extra(records, prompt_steps, costs: ServingCosts) -> float | None:
    """The median, over requests served alone that went on decoding after their first token,
    of the client's TTFT less the worker's prompt steps, less what the profile already adds to
    a first token (the prompt step's fixed cost and the latency of a token served alone)."""
    outside = [
        r.ttft - s
        for r, s in zip(records, prompt_steps)
        if s is not None and r.ttft is not None and r.num_output_tokens > 1
    ]
    if not outside:
        return None
    return statistics.median(outside) - costs.prefill_step_overhead_s - costs.latency(1)


def _serve_command(args: EngineArgs, port: int, *placement: str) -> list[str]:
    """`pdserve serve` of the profile's model, kernels and dtype on `port`, placed by
    `placement` (its CPU flags)."""
    return [
        sys.executable, "-m", "pdserve.cli", "serve", "--model", args.model, "--port", str(port),
        *placement, "--linear-backend", str(args.linear_backend), "--dtype", str(args.dtype),
        "--log-level", "warning",
    ]  # fmt: skip


def _cpu_list(cpus: list[int]) -> str:
    return ",".join(map(str, cpus))


@contextlib.contextmanager
def _pinned(cpus: list[int]):
    """This thread on `cpus` for the block (the client's runs between are not)."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def served_steps(records, in_process: list[list[float]] | None = None) -> list[list]:
    """The steps of requests served one at a time (`RequestRecord`s), [q_lens, ctx_lens,
    seconds] each: the prompt's step is the server's TTFT, a decode step the gap between two
    tokens (the gap before token k + 2 is the step that ends at context p + k + 2). With
    `in_process` (per record, the step times of the same request run in-process: the prompt's
    step, then its decodes), each step gets its in-process time as a fourth value."""
    steps = []
    for i, r in enumerate(records):
        if r.status != "completed" or not r.server_timings:
            continue
        own = in_process[i] if in_process is not None else []

        def step(q_lens, ctx_lens, served, j, own=own):  # j: the step's place in `own`
            return [q_lens, ctx_lens, served, *own[j : j + 1]]

        p = r.num_input_tokens
        if r.server_timings.get("ttft_ms") is not None:
            steps.append(step([p], [p], r.server_timings["ttft_ms"] / 1e3, 0))
        steps += [step([1], [p + k + 2], gap, k + 1) for k, gap in enumerate(r.itl)]
    return steps


def _in_process_engine(args: EngineArgs, threads: int):
    """An engine in this process on every allowed CPU, warmed up, with room for one request;
    no prefix cache, so that every prompt is computed whole, as the served ones were."""

    from pdserve.engine.core import EngineCore

    args = dataclasses.replace(
        args, num_threads=threads, num_kv_blocks=256, enable_prefix_caching=False
    )
    core = EngineCore(args)
    _generate(core, INPUT_LEN, 4)
    return core


def _run_in_process(core, record) -> list[float]:
    """The step times of `record`'s request run in `core`: its prompt's length (random tokens),
    as many tokens out, greedy; the prompt's step first, then each decode."""
    if record.status != "completed":
        return []
    steps = _generate(core, record.num_input_tokens, max(record.num_output_tokens, 1))
    return [t for _, t in steps]


def _generate(core, prompt_len: int, max_tokens: int) -> list:
    """One request of `prompt_len` random tokens through `core`: each step's (shape, seconds)."""
    import random

    from pdserve.perf.step_profile import timed_step
    from pdserve.types import SamplingParams

    rng = random.Random()
    tokens = [rng.randrange(3, core.model_config.vocab_size) for _ in range(prompt_len)]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    core.add_request(core.make_request(f"calibration-{time.monotonic_ns()}", tokens, params))
    steps = []
    while core.scheduler.has_unfinished:
        steps += timed_step(core)
    return steps


def step_factors(records, model: StepModel, cpu_per_token_s: float) -> dict[str, float]:
    """The served/in-process factors from requests served one at a time: each kind of step's
    median served time less the CPU one token costs, over the model's time for the same shapes
    (`planner.profile.step_factors`). A factor is left at 1.0 where no request measured it."""
    return profile_step_factors(served_steps(records), model, cpu_per_token_s)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
