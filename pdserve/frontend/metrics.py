"""Prometheus metrics of the server, all prefixed `pdserve_` and labelled by worker role and id.

Request latencies are observed in the frontend when a request finishes (definitions in
docs/ARCHITECTURE.md); step times, MFU/MBU and queue/KV gauges come from the workers' step
reports. Every server has its own registry, so tests can run several in one process.
"""

from __future__ import annotations

import contextlib

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)

from pdserve.ipc.messages import StepOutputs
from pdserve.types import RequestOutput, Role

LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    1.5,
    2.0,
    3.0,
    5.0,
    10.0,
    20.0,
    40.0,
    80.0,
)
LABELS = ("role", "worker")
PHASES = ("prefill", "decode", "mixed")  # of a step (pdserve.engine.stats)


class ServerMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()

        def hist(name: str, doc: str, labels=LABELS) -> Histogram:
            return Histogram(f"pdserve_{name}", doc, labels, buckets=LATENCY_BUCKETS, registry=r)

        self.ttft = hist("time_to_first_token_seconds", "TTFT: first token time - arrival")
        self.itl = hist("inter_token_latency_seconds", "ITL: gap between consecutive tokens")
        self.tpot = hist("time_per_output_token_seconds", "TPOT: decode time / (tokens - 1)")
        self.e2e = hist("e2e_request_latency_seconds", "E2E: finish - arrival")
        self.queue = hist("request_queue_time_seconds", "queue time: scheduled - arrival")
        self.prefill = hist("request_prefill_time_seconds", "prefill time: first token - scheduled")
        self.decode = hist("request_decode_time_seconds", "decode time: finish - first token")
        self.step = hist("step_time_seconds", "engine step time", (*LABELS, "phase"))
        self.scheduled = Counter(
            "pdserve_scheduled_tokens",
            "tokens computed in steps: kind=prefill (prompt tokens), kind=decode (one per "
            "decoding sequence per step)",
            (*LABELS, "kind"),
            registry=r,
        )
        # The frontend's own CPU time (process_cpu_seconds_total, ...): a frontend-bound server
        # shows one core busy here while its workers wait.
        ProcessCollector(registry=r)
        self.prompt_tokens = Counter("pdserve_prompt_tokens", "prompt tokens", LABELS, registry=r)
        self.generation_tokens = Counter(
            "pdserve_generation_tokens", "generated tokens", LABELS, registry=r
        )
        self.requests = Counter(
            "pdserve_requests", "finished requests", (*LABELS, "finish_reason"), registry=r
        )
        self.spec_proposed = Counter(
            "pdserve_spec_proposed_tokens",
            "speculative decoding: tokens proposed for verification (counted as requests end)",
            LABELS,
            registry=r,
        )
        self.spec_accepted = Counter(
            "pdserve_spec_accepted_tokens",
            "speculative decoding: proposed tokens the model accepted (counted as requests end)",
            LABELS,
            registry=r,
        )
        self.spec_steps = Counter(
            "pdserve_spec_verify_steps",
            "speculative decoding: request-steps that verified proposals (accepted / this: the "
            "mean accepted length; counted as requests end)",
            LABELS,
            registry=r,
        )
        self.spec_acceptance = Histogram(
            "pdserve_spec_acceptance_rate",
            "speculative decoding: accepted / proposed tokens of each request that speculated",
            LABELS,
            buckets=(0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0),
            registry=r,
        )
        self.preemptions = Gauge(
            "pdserve_preemptions", "preemptions since the worker started", LABELS, registry=r
        )
        self.prefix_queries = Gauge(
            "pdserve_prefix_cache_queries_tokens",
            "prompt tokens looked up in the prefix cache",
            LABELS,
            registry=r,
        )
        self.prefix_hits = Gauge(
            "pdserve_prefix_cache_hits_tokens",
            "prompt tokens found in the prefix cache",
            LABELS,
            registry=r,
        )
        self.running = Gauge("pdserve_num_requests_running", "running requests", LABELS, registry=r)
        self.waiting = Gauge("pdserve_num_requests_waiting", "waiting requests", LABELS, registry=r)
        self.kv_usage = Gauge(
            "pdserve_kv_cache_usage_ratio", "KV blocks in use", LABELS, registry=r
        )
        self.mfu = Gauge(
            "pdserve_mfu_ratio",
            "model FLOPs utilisation of the last step of a phase",
            (*LABELS, "phase"),
            registry=r,
        )
        self.mbu = Gauge(
            "pdserve_mbu_ratio",
            "memory bandwidth utilisation of the last step of a phase",
            (*LABELS, "phase"),
            registry=r,
        )
        self.router_decisions = Counter(
            "pdserve_router_decisions",
            "where prompts were prefilled (remote = a prefill worker)",
            ("decision",),
            registry=r,
        )
        self.kv_fallbacks = Counter(
            "pdserve_kv_transfer_fallbacks",
            "remote prefills given up for local recompute",
            ("reason",),
            registry=r,
        )
        self.kv_bytes = Counter("pdserve_kv_transfer_bytes", "KV bytes sent, by what the rows "
                                "went through (shm: written in place; tcp; none: the decode worker "
                                "could not be reached)", (*LABELS, "path"),
                                registry=r)  # fmt: skip
        self.kv_seconds = hist(
            "kv_transfer_seconds", "time spent moving one request's KV rows (busy, not waiting)"
        )
        self.kv_span = hist(
            "kv_transfer_span_seconds",
            "one request's first KV layer queued -> KV complete (overlaps its prefill compute)",
        )
        self.kv_gbps = Gauge(
            "pdserve_kv_transfer_gbps",
            "bytes / busy time of the last KV transfer, GB/s",
            LABELS,
            registry=r,
        )
        self.kv_exposed = Gauge(
            "pdserve_kv_transfer_exposed_seconds",
            "cumulative time prefill steps waited for KV transfers",
            LABELS,
            registry=r,
        )
        self.dropped_frames = Counter(
            "pdserve_dropped_frames",
            "frames a worker dropped: not from this deployment, malformed, replayed, or KV "
            "rows outside the request's reservation",
            (*LABELS, "reason"),
            registry=r,
        )
        self._dropped_seen: dict[tuple[str, str, str], int] = {}
        # Offload tiers (--kv-offload): cumulative counts of each worker, as gauges named after
        # the `KVTierState` / `KVOffloadState` field they show
        tier_labels = (*LABELS, "tier")
        self.tier_gauges = {
            field: Gauge(f"pdserve_kv_tier_{name}", doc, tier_labels, registry=r)
            for field, name, doc in (
                ("capacity_bytes", "capacity_bytes", "bytes the tier holds at most"),
                ("used_bytes", "usage_bytes", "bytes the tier holds (a shared host tier: all of it)"),
                ("hits", "hits", "blocks read back from the tier and verified"),
                ("loaded_bytes", "loaded_bytes", "bytes read back from the tier"),
                ("load_s", "load_seconds", "time spent reading from the tier, checksums included"),
                ("stored_bytes", "stored_bytes", "bytes written to the tier"),
                ("store_s", "store_seconds", "time the store thread spent writing to the tier"),
                ("store_errors", "store_errors", "writes that failed (full disk, deleted directory)"),
                ("evicted", "evictions", "entries the tier dropped or handed down for room"),
            )
        }  # fmt: skip
        self.tier_misses = Gauge(
            "pdserve_kv_tier_misses",
            "lookups the tier could not serve, by reason: absent, corrupt (failed its checks), "
            "raced (rewritten while read), error (I/O)",
            (*tier_labels, "reason"),
            registry=r,
        )
        self.offload_gauges = {
            field: Gauge(f"pdserve_kv_offload_{name}", doc, LABELS, registry=r)
            for field, name, doc in (
                ("saved_blocks", "saved_blocks", "blocks evicted from the cache, handed to the tiers"),
                ("dropped_blocks", "dropped_blocks", "evicted blocks not saved: the store thread was behind"),
                ("loaded_blocks", "loaded_blocks", "blocks loaded back from a tier instead of recomputed"),
                ("swap_ins", "swap_ins", "preempted requests that resumed from a tier"),
                ("prefetched_blocks", "prefetched_blocks", "blocks read ahead while their request waited"),
                ("read_on_step", "read_on_step_blocks", "blocks read while scheduling (not prefetched in time)"),
                ("copy_s", "copy_seconds", "the steps' own time copying blocks out of and into the cache"),
            )
        }  # fmt: skip
        self.worker_up = Gauge(
            "pdserve_worker_up", "1 while the worker process lives", LABELS, registry=r
        )
        self.role_switches = Counter(
            "pdserve_role_switches",
            "workers switched from one role to another (--pd-ratio manual or auto)",
            ("from", "to"),
            registry=r,
        )
        self.workers_by_role = Gauge(
            "pdserve_workers", "live workers per role", ("role",), registry=r
        )
        self.slo_attainment = Gauge(
            "pdserve_slo_attainment_ratio",
            "share of the requests finished lately (10 s window) within the phase's --slo "
            "target (ttft: TTFT, tpot: TPOT)",
            ("phase",),
            registry=r,
        )
        self.rejected = Counter(
            "pdserve_requests_rejected",
            "requests refused at admission with 503 (overloaded: --max-waiting-requests; "
            "slo: predicted TTFT beyond the SLO or the request's deadline)",
            ("reason",),
            registry=r,
        )

    def forget_role(self, worker_id: int, role) -> None:
        """A worker switched away from `role`: its gauges under that role go (its counters and
        histograms keep their history)."""
        lab = (str(role), str(worker_id))
        for g in (self.running, self.waiting, self.kv_usage, self.preemptions, self.prefix_queries,
                  self.prefix_hits, self.kv_gbps, self.kv_exposed, self.worker_up):  # fmt: skip
            with contextlib.suppress(KeyError):
                g.remove(*lab)
        for g in (self.mfu, self.mbu):
            for phase in PHASES:
                with contextlib.suppress(KeyError):
                    g.remove(*lab, phase)

    def set_slo_attainment(self, ttft: float | None, tpot: float | None) -> None:
        for phase, share in (("ttft", ttft), ("tpot", tpot)):
            if share is not None:
                self.slo_attainment.labels(phase).set(share)

    def set_roles(self, live_workers) -> None:
        for role in Role:
            n = sum(w.role == role for w in live_workers)
            self.workers_by_role.labels(str(role)).set(n)

    def on_step(self, worker, msg: StepOutputs) -> None:
        lab = (worker.role, str(worker.worker_id))
        for s in msg.steps:
            self.step.labels(*lab, s.phase).observe(s.step_time_s)
            if s.num_prefill_tokens:
                self.scheduled.labels(*lab, "prefill").inc(s.num_prefill_tokens)
            if s.num_decode_seqs:
                self.scheduled.labels(*lab, "decode").inc(s.num_decode_seqs)
            if s.mfu is not None:
                self.mfu.labels(*lab, s.phase).set(s.mfu)
            if s.mbu is not None:
                self.mbu.labels(*lab, s.phase).set(s.mbu)
        for t in msg.transfers:
            self.kv_bytes.labels(*lab, t.path).inc(t.num_bytes)
            self.kv_seconds.labels(*lab).observe(t.seconds)
            self.kv_span.labels(*lab).observe(t.span_s)
            if t.seconds > 0:
                self.kv_gbps.labels(*lab).set(t.num_bytes / t.seconds / 1e9)
        if worker.role == Role.PREFILL:
            self.kv_exposed.labels(*lab).set(msg.kv_exposed_s)
        st = msg.state
        for reason, total in st.dropped_frames.items():  # cumulative in the worker
            seen = self._dropped_seen.get((*lab, reason), 0)
            if total > seen:
                self.dropped_frames.labels(*lab, reason).inc(total - seen)
                self._dropped_seen[(*lab, reason)] = total
        self.running.labels(*lab).set(st.num_running)
        self.waiting.labels(*lab).set(st.num_waiting)
        self.kv_usage.labels(*lab).set(st.kv_usage)
        self.preemptions.labels(*lab).set(st.num_preemptions)
        self.prefix_queries.labels(*lab).set(st.prefix_queries)
        self.prefix_hits.labels(*lab).set(st.prefix_hits)
        if st.kv_offload is not None:
            self._set_offload(lab, st.kv_offload)

    def _set_offload(self, lab: tuple[str, str], off) -> None:
        for field, gauge in self.offload_gauges.items():
            gauge.labels(*lab).set(getattr(off, field))
        for t in off.tiers:
            tl = (*lab, t.tier)
            for field, gauge in self.tier_gauges.items():
                gauge.labels(*tl).set(getattr(t, field))
            for reason, n in t.misses.items():
                self.tier_misses.labels(*tl, reason).set(n)

    def on_finish(self, worker, out: RequestOutput) -> None:
        lab = (worker.role, str(worker.worker_id))
        self.prompt_tokens.labels(*lab).inc(len(out.prompt_token_ids))
        for c in out.outputs:
            self.generation_tokens.labels(*lab).inc(len(c.token_ids))
            self.requests.labels(*lab, c.finish_reason or "abort").inc()
            m = c.metrics
            if m is None:
                continue
            if m.num_spec_proposed:
                self.spec_proposed.labels(*lab).inc(m.num_spec_proposed)
                self.spec_accepted.labels(*lab).inc(m.num_spec_accepted)
                self.spec_steps.labels(*lab).inc(m.num_spec_steps)
                self.spec_acceptance.labels(*lab).observe(m.spec_acceptance_rate)
            for hist, value in (
                (self.ttft, m.ttft),
                (self.tpot, m.tpot),
                (self.e2e, m.e2e),
                (self.queue, m.queue_time),
                (self.prefill, m.prefill_time),
                (self.decode, m.decode_time),
            ):
                if value is not None:
                    hist.labels(*lab).observe(value)
            for gap in m.itl:
                self.itl.labels(*lab).observe(gap)

    def set_worker_up(self, worker, up: bool) -> None:
        lab = (worker.role, str(worker.worker_id))
        self.worker_up.labels(*lab).set(1 if up else 0)
        if not up:  # a dead worker holds nothing: its queue and KV gauges drop to zero
            for gauge in (self.running, self.waiting, self.kv_usage):
                gauge.labels(*lab).set(0)
            for key in [k for k in self._dropped_seen if k[:2] == lab]:
                del self._dropped_seen[key]  # a restarted worker counts from zero

    def render(self) -> bytes:
        return generate_latest(self.registry)
