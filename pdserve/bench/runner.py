"""One benchmark end to end: prompts from the tokenizer, requests sent, records summarized.

A `BenchPlan` is everything the flags decide except the server; `bench_target` carries it out
against one server (a probe request, then one run, or one per rate of a sweep), which is also
what a comparison does for each deployment. `run_once` sends one set of requests with a progress bar, stoppable by
Ctrl-C, and returns a `RunResult`: per-request records, their summary, and whether it was cut.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from pdserve.bench.client import ClientConfig, fetch_metrics, resolve_target, run_requests
from pdserve.bench.errors import BenchError
from pdserve.bench.metrics import COMPLETED, RequestRecord, Slo, summarize
from pdserve.bench.progress import Interrupt, Progress
from pdserve.bench.sweep import format_rate
from pdserve.bench.tokenizer import HFPromptTokenizer, load_tokenizer
from pdserve.bench.workload import (
    BenchRequest,
    RequestSpec,
    WorkloadConfig,
    build_prompts,
    with_rate,
)
from pdserve.heap import frozen_heap

PROBE_INPUT_LEN = 32  # tokens in the probe request's prompt


@dataclass(frozen=True)
class BenchPlan:
    """The workload and how to send it: the same for every server it runs against."""

    workload: WorkloadConfig
    specs: list[RequestSpec]
    trace: str | None = None
    endpoint: str = "completions"
    slo: Slo = field(default_factory=Slo)
    sweep_rates: list[float] | None = None
    target_attainment: float = 0.9
    max_concurrency: int | None = None
    api_key: str | None = None
    temperature: float = 0.0
    force_output_len: bool = True
    extra_body: dict = field(default_factory=dict)
    timeout_s: float = 600.0
    show_progress: bool | None = None  # None: when stderr is a terminal

    def describe(self) -> dict:
        """The plan as JSON-ready settings (no secrets)."""
        return {
            "dataset": "trace" if self.trace else "random",
            "trace": self.trace,
            "workload": asdict(self.workload),
            "num_requests": len(self.specs),
            "endpoint": self.endpoint,
            "slo": asdict(self.slo),
            "sweep_rates": self.sweep_rates,
            "target_attainment": self.target_attainment,
            "max_concurrency": self.max_concurrency,
            "temperature": self.temperature,
            "force_output_len": self.force_output_len,
            "extra_body": self.extra_body,
            "timeout_s": self.timeout_s,
        }


@dataclass
class RunResult:
    """The outcome of one run (one rate of a sweep, one deployment of a comparison)."""

    records: list[RequestRecord]
    summary: dict
    interrupted: bool = False
    request_rate: float | None = None  # the rate it was sent at (sweeps), None: the workload's
    # the server's /metrics just before and just after the run (`pdserve advise --bench` reads
    # them), when it has that route
    server_metrics: dict | None = None

    def to_dict(self) -> dict:
        return {
            "request_rate": self.request_rate,
            "interrupted": self.interrupted,
            "summary": self.summary,
            "server_metrics": self.server_metrics,
            "requests": [r.to_dict() for r in self.records],
        }


@dataclass
class TargetResult:
    """What one server did with a plan: one run, or one per swept rate."""

    base_url: str
    model: str
    tokenizer: str
    runs: list[RunResult]
    sweep: bool = False

    @property
    def interrupted(self) -> bool:
        return any(r.interrupted for r in self.runs)


def bench_target(
    plan: BenchPlan,
    base_url: str,
    model: str | None,
    tokenizer: str | None,
    interrupt: Interrupt,
    label: str = "",
    prompt_cache: dict | None = None,
) -> TargetResult:
    """Run `plan` against the server at `base_url` (model and tokenizer resolved if None).

    `prompt_cache` maps a tokenizer folder to its prompts, so that deployments of one model
    in a comparison get the very same requests without rebuilding them.
    """
    model, tokenizer_path = resolve_target(base_url, model, tokenizer, plan.api_key)
    client = ClientConfig(
        base_url, model, plan.endpoint, plan.api_key, plan.temperature,
        plan.force_output_len, plan.extra_body, plan.timeout_s,
    )  # fmt: skip
    cache = {} if prompt_cache is None else prompt_cache
    prompt_tokenizer = cache.get((tokenizer_path, plan.endpoint))
    if prompt_tokenizer is None:
        chat = plan.endpoint == "chat"
        prompt_tokenizer = HFPromptTokenizer(load_tokenizer(tokenizer_path), chat)
        cache[(tokenizer_path, plan.endpoint)] = prompt_tokenizer
    offset = probe_prompt_offset(client, prompt_tokenizer)
    key = (tokenizer_path, plan.endpoint, offset)
    if key not in cache:
        prompt_tokenizer.offset = offset
        seed, block_tokens = plan.workload.seed, plan.workload.block_tokens
        cache[key] = build_prompts(plan.specs, prompt_tokenizer, seed, block_tokens)
    requests = cache[key]
    if plan.sweep_rates:
        runs = run_sweep(
            requests, plan.sweep_rates, client, plan.slo, interrupt, plan.workload.burstiness,
            plan.workload.seed, plan.max_concurrency, plan.show_progress, label,
        )  # fmt: skip
    else:
        one = run_once(
            requests, client, plan.slo, interrupt, plan.max_concurrency, label=label,
            show_progress=plan.show_progress, request_rate=plan.workload.request_rate,
        )  # fmt: skip
        runs = [one]
    return TargetResult(base_url, model, tokenizer_path, runs, sweep=bool(plan.sweep_rates))


def probe_prompt_offset(client: ClientConfig, tokenizer: HFPromptTokenizer) -> int:
    """Send one short request before the run: it checks that the server accepts the requests
    (a failure is a one-line `BenchError`), warms the server up, and returns how many more prompt
    tokens the server counts than the tokenizer does (a BOS added to chat prompts, say), so that
    prompts can be sized for the server's count. 0 when the server sends no `usage`."""
    tokenizer.offset = 0
    probe = build_prompts([RequestSpec(0, 0.0, PROBE_INPUT_LEN, 1)], tokenizer)[0]
    (record,) = asyncio.run(run_requests([probe], client))
    if record.status != COMPLETED:
        raise BenchError(
            f"a probe request to {client.url} failed ({record.error}: {record.error_detail}); "
            "check --model, --endpoint and --no-force-output-len"
        )
    if record.prompt_tokens is None:
        return 0
    offset = record.prompt_tokens - probe.prompt_len
    if offset:
        print(
            f"note: the server counts {offset:+d} prompt tokens against the tokenizer "
            "(special or template tokens); prompts are sized for the server's count",
            file=sys.stderr,
        )
    return offset


def run_once(
    requests: Sequence[BenchRequest],
    client: ClientConfig,
    slo: Slo,
    interrupt: Interrupt,
    max_concurrency: int | None = None,
    label: str = "",
    show_progress: bool | None = None,
    request_rate: float | None = None,
) -> RunResult:
    """Send `requests` and summarize; Ctrl-C (via `interrupt`) ends it early with what it has."""
    progress = Progress(len(requests), label, enabled=show_progress)

    async def main() -> list[RequestRecord]:
        stop = interrupt.bind()
        return await run_requests(requests, client, max_concurrency, stop, progress.update)

    before = fetch_metrics(client.base_url, client.api_key)
    try:
        # the client's own full collections (~100 ms with transformers loaded) would land in
        # the token timestamps it measures
        with frozen_heap():
            records = asyncio.run(main())
    finally:
        progress.close()
    after = fetch_metrics(client.base_url, client.api_key) if before else None
    scrapes = {"before": before, "after": after} if before and after else None
    return RunResult(records, summarize(records, slo), interrupt.requested, request_rate, scrapes)


def run_sweep(
    requests: Sequence[BenchRequest],
    rates: Sequence[float],
    client: ClientConfig,
    slo: Slo,
    interrupt: Interrupt,
    burstiness: float = 1.0,
    seed: int = 0,
    max_concurrency: int | None = None,
    show_progress: bool | None = None,
    label: str = "",
) -> list[RunResult]:
    """One run per rate, lowest first; stops after a run cut short by Ctrl-C."""
    results = []
    for rate in sorted(rates):
        timed = with_rate(requests, rate, burstiness, seed)
        name = f"{label} rate {format_rate(rate)}".strip()
        result = run_once(
            timed, client, slo, interrupt, max_concurrency, name, show_progress, request_rate=rate
        )
        results.append(result)
        if result.interrupted:
            break
    return results
