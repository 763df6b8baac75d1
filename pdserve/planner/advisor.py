"""Which phase limits a deployment, with the numbers behind it and what to change (no torch).

`advise(obs)` reads one `Observation` and returns a `Verdict`. The rules, in order (the first
that holds decides; thresholds are the constants below):

1. idle: nothing finished, ran or waited in the window.
2. KV-bound: requests were preempted, or a worker's KV cache was nearly full
   (`KV_FULL`) while requests waited.
3. frontend-bound: the frontend process used most of a core (`FRONTEND_CPU`) while the workers
   were not busy (`BUSY_HIGH`), or (a bench run) TTFT missed its target and most of the client's
   TTFT was spent outside the engine (`OUTSIDE_SHARE`).
4. Both SLOs met (TTFT p90 and TPOT p90 within their targets): under-loaded when the workers
   are busy less than `BUSY_LOW` of the time, else balanced (at capacity from `AT_CAPACITY`,
   naming the target that more load would miss first).
5. Otherwise the phase whose p90 is further over its target limits the deployment:
   prefill-bound (TTFT) or decode-bound (TPOT); both over is said as such. The causes looked
   for: requests queued for a free sequence slot or for compute, prompt chunks stalling the
   decodes that share their steps, large decode batches, a split whose other pool idles.

The actions name real flags of `pdserve serve`, with values where the observation gives them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from pdserve.planner.observation import Observation

KV_FULL = 0.95  # KV usage at which waiting requests are waiting for blocks
FRONTEND_CPU = 0.85  # cores of CPU time per second: the frontend's event loop is saturated
# of the client's TTFT p50 spent outside the engine: at half, the frontend and the network are
# the larger part of what a client waits for, and faster prefill would no longer help most
OUTSIDE_SHARE = 0.5
BUSY_LOW = 0.35  # workers busy less than this with the SLOs met: under-loaded
BUSY_HIGH = 0.7  # workers busy less than this are not what limits the deployment
AT_CAPACITY = 0.9  # workers busy this much have no room for more load
HEADROOM = 0.6  # a pool whose workers are busy less than this can give one up
STALL_SHARE = 0.3  # mixed steps holding this share of step time ...
STALL_RATIO = 1.5  # ... and this much slower than decode-only steps: prompts stall decodes
BIG_BATCH = 8  # decode batches at least this large trade TPOT for throughput


@dataclass(frozen=True)
class Verdict:
    bound: str  # idle | kv | frontend | under-loaded | balanced | prefill | decode
    summary: str  # one line
    evidence: list[str] = field(default_factory=list)
    actions: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)

    def text(self) -> str:
        lines = [self.summary, "", "evidence:"]
        lines += [f"  - {e}" for e in self.evidence]
        if self.actions:
            lines += ["", "what to change:"]
            lines += [f"  - {a}" for a in self.actions]
        return "\n".join(lines)


def advise(obs: Observation, settings: dict | None = None) -> Verdict:
    """The verdict on `obs`. `settings` (optional): the deployment's engine settings
    (`max_num_batched_tokens`, `max_num_seqs`, `enable_chunked_prefill`), for concrete values."""
    settings = settings or {}
    facts = _evidence(obs)
    for rule in (_idle, _kv_bound, _frontend_bound, _within_slo, _phase_bound):
        verdict = rule(obs, settings, facts)
        if verdict is not None:
            return verdict
    raise AssertionError("the last rule always decides")  # pragma: no cover


# ---- the rules, in order ------------------------------------------------------------------
def _idle(obs: Observation, settings: dict, facts: list[str]) -> Verdict | None:
    if obs.num_finished or (obs.running_mean or 0) > 0 or (obs.waiting_mean or 0) > 0:
        return None
    return Verdict("idle", f"idle: no request ran in the last {obs.window_s:.0f} s", facts)


def _kv_bound(obs: Observation, settings: dict, facts: list[str]) -> Verdict | None:
    full = (obs.kv_usage_max or 0) >= KV_FULL and (obs.waiting_mean or 0) > 0
    if not obs.num_preemptions and not full:
        return None
    why = (
        f"{obs.num_preemptions:.0f} preemptions in {obs.window_s:.0f} s"
        if obs.num_preemptions
        else f"KV cache {obs.kv_usage_max:.0%} full with {obs.waiting_mean:.1f} requests waiting"
    )
    seqs = settings.get("max_num_seqs")
    actions = [
        "give the KV cache more memory: --kv-cache-memory (or --num-kv-blocks)",
        f"admit fewer sequences at once: --max-num-seqs {_scaled(seqs, 0.75)}"
        if seqs
        else "admit fewer sequences at once: a lower --max-num-seqs",
    ]
    if obs.workers.get("prefill"):
        actions.append("give decode workers more of the devices (their KV holds the streams)")
    return Verdict("kv", f"KV-bound: {why}", facts, actions)


def _frontend_bound(obs: Observation, settings: dict, facts: list[str]) -> Verdict | None:
    busy = obs.busy_mean
    cpu_bound = (
        obs.frontend_cpu_cores is not None
        and obs.frontend_cpu_cores >= FRONTEND_CPU
        and (busy is None or busy < BUSY_HIGH)
    )
    outside = obs.outside_ttft_p50_s
    r_ttft, _ = _ratios(obs)
    slow_outside = (
        outside is not None
        and obs.ttft_p50_s
        and (r_ttft is None or r_ttft > 1)  # it matters only where TTFT misses its target
        and outside >= 0.02
        and outside / obs.ttft_p50_s >= OUTSIDE_SHARE
    )
    if not cpu_bound and not slow_outside:
        return None
    if cpu_bound:
        why = f"the frontend process uses {obs.frontend_cpu_cores:.2f} cores"
        if busy is not None:
            why += f" while the workers are busy {busy:.0%} of the time"
    else:
        why = (
            f"{outside * 1e3:.0f} ms of the {obs.ttft_p50_s * 1e3:.0f} ms TTFT p50 is spent "
            "outside the engine (frontend, network, client)"
        )
    actions = [
        "give the frontend a core of its own: pin the workers to the others "
        "(--cpus, --prefill-cpus, --decode-cpus)",
        "clients that read whole answers can send stream=false (one response, not a chunk "
        "per token), and several prompts per /v1/completions request",
    ]
    return Verdict("frontend", f"frontend-bound: {why}", facts, actions)


def _within_slo(obs: Observation, settings: dict, facts: list[str]) -> Verdict | None:
    r_ttft, r_tpot = _ratios(obs)
    if (r_ttft or 0) > 1 or (r_tpot or 0) > 1:
        return None
    busy = obs.busy_mean
    closest = _closest(r_ttft, r_tpot)
    if busy is not None and busy < BUSY_LOW:
        actions = [f"the workers could take about {0.8 / max(busy, 0.05):.1f}x this load"]
        if obs.num_workers > 1:
            actions.append(
                f"or serve it with fewer than {obs.num_workers} workers "
                "(`pdserve plan` on this load ranks the deployments)"
            )
        return Verdict(
            "under-loaded",
            f"under-loaded: SLOs met ({closest}) with the workers busy {busy:.0%} of the time",
            facts,
            actions,
        )
    room = "" if busy is None else f", workers busy {busy:.0%}"
    actions = []
    if busy is not None and busy >= AT_CAPACITY:
        nearer = "TTFT" if (r_ttft or 0) >= (r_tpot or 0) else "TPOT"
        room += f": at capacity, more load will miss the {nearer} target first"
        phase = "prefill" if nearer == "TTFT" else "decode"
        actions.append(f"before the load grows: add {phase} capacity (see {phase}-bound)")
    return Verdict("balanced", f"balanced: SLOs met ({closest}){room}", facts, actions)


def _phase_bound(obs: Observation, settings: dict, facts: list[str]) -> Verdict:
    r_ttft, r_tpot = _ratios(obs)
    both = (r_ttft or 0) > 1 and (r_tpot or 0) > 1
    prefill = (r_ttft or 0) >= (r_tpot or 0)
    if prefill:
        cause, actions = _prefill_causes(obs, settings)
        head = f"prefill-bound: TTFT p90 {_ms(obs.ttft_p90_s)} against {_ms(obs.slo_ttft_s)}"
    else:
        cause, actions = _decode_causes(obs, settings)
        head = f"decode-bound: TPOT p90 {_ms(obs.tpot_p90_s)} against {_ms(obs.slo_tpot_s)}"
    if both:
        other = "TPOT" if prefill else "TTFT"
        head += f" (and {other} over its target too: more devices are needed)"
    return Verdict("prefill" if prefill else "decode", f"{head}; {cause}", facts, actions)


# ---- causes and actions of a phase over its SLO -------------------------------------------
def _prefill_causes(obs: Observation, settings: dict) -> tuple[str, list[str]]:
    actions = []
    seqs = settings.get("max_num_seqs")
    queue, ttft = obs.queue_mean_s, obs.ttft_p50_s
    queued = queue is not None and ttft and queue / max(ttft, 1e-9) >= 0.5
    if queued and seqs and (obs.running_mean or 0) >= 0.9 * seqs:
        cause = (
            f"requests wait {_ms(queue)} for one of the {seqs} sequence slots, all taken "
            f"({obs.running_mean:.1f} running)"
        )
        actions.append(f"raise --max-num-seqs (to {_scaled(seqs, 1.5)}) if TPOT has room")
    elif queued:
        cause = f"requests wait {_ms(queue)} to be scheduled, most of their TTFT"
    else:
        cause = f"prompts take {_ms(obs.prefill_mean_s)} to prefill once scheduled"
    p, d = obs.workers.get("prefill", 0), obs.workers.get("decode", 0)
    decode_busy = obs.busy_of("decode")
    if p and d > 1 and decode_busy is not None and decode_busy < HEADROOM:
        actions.append(
            f"move a decode worker to prefill (decode workers busy {decode_busy:.0%}): "
            f"--prefill-workers {p + 1} --decode-workers {d - 1}, or --pd-ratio auto"
        )
    elif p:
        actions.append("add a prefill worker (--prefill-workers), or --pd-ratio auto")
    else:
        n = obs.workers.get("both", 1)
        actions.append(
            f"add a worker: --decode-workers {n + 1} (colocated workers behind the router)"
        )
        actions.append("put new prompts first: --profile chat (prefill-first, short chunks)")
    actions.append("refuse what cannot start in time instead of serving it late: --slo-admission")
    return cause, actions


def _decode_causes(obs: Observation, settings: dict) -> tuple[str, list[str]]:
    actions = []
    mixed, decode = obs.step_mean_s.get("mixed"), obs.step_mean_s.get("decode")
    share = obs.phase_share("mixed") or 0.0
    colocated = not obs.workers.get("prefill")
    batch = obs.decode_batch_mean
    if (
        colocated
        and mixed
        and share >= STALL_SHARE
        and (not decode or mixed >= STALL_RATIO * decode)
    ):
        cause = (
            f"prompt chunks stall the decodes that share their steps ({share:.0%} of step time "
            f"in mixed steps of {_ms(mixed)}"
            + (f" against {_ms(decode)} for decode alone)" if decode else ")")
        )
        budget = settings.get("max_num_batched_tokens")
        smaller = min(256, budget // 2) if budget and budget > 256 else None
        actions.append(
            f"smaller chunks: --max-num-batched-tokens {smaller}"
            if smaller
            else "smaller chunks: a lower --max-num-batched-tokens"
        )
        if obs.num_workers >= 2:
            actions.append(
                "separate the phases: --prefill-workers 1 with the other workers decoding, or "
                "--pd-ratio auto (--profile mixed)"
            )
    elif batch is not None and batch >= BIG_BATCH:
        cause = f"decode batches of {batch:.1f} sequences take {_ms(decode or obs.tpot_p50_s)}"
        fit = max(1, int(batch * (obs.slo_tpot_s or 0) / max(obs.tpot_p90_s or 1, 1e-9)))
        actions.append(f"fewer streams per worker to hold TPOT: --max-num-seqs {fit}")
    else:
        cause = f"each decode step takes {_ms(decode or obs.tpot_p50_s)}"
    p, d = obs.workers.get("prefill", 0), obs.workers.get("decode", 0)
    prefill_busy = obs.busy_of("prefill")
    if p > 1 and prefill_busy is not None and prefill_busy < HEADROOM:
        actions.append(
            f"move a prefill worker to decode (prefill workers busy {prefill_busy:.0%}): "
            f"--prefill-workers {p - 1} --decode-workers {d + 1}, or --pd-ratio auto"
        )
    elif p == 1 and prefill_busy is not None and prefill_busy < HEADROOM:
        actions.append(
            f"the prefill worker idles ({prefill_busy:.0%} busy): serve colocated "
            f"(--decode-workers {p + d} without --prefill-workers), or --pd-ratio auto"
        )
    else:
        actions.append("add a decode worker (--decode-workers)")
    return cause, actions


# ---- helpers ------------------------------------------------------------------------------
def _ratios(obs: Observation) -> tuple[float | None, float | None]:
    def ratio(value, target):
        return value / target if value is not None and target else None

    return ratio(obs.ttft_p90_s, obs.slo_ttft_s), ratio(obs.tpot_p90_s, obs.slo_tpot_s)


def _closest(r_ttft: float | None, r_tpot: float | None) -> str:
    parts = [
        f"{name} p90 at {r:.0%} of its target"
        for name, r in (("TTFT", r_ttft), ("TPOT", r_tpot))
        if r is not None
    ]
    return ", ".join(parts) or "no targets given"


def _evidence(obs: Observation) -> list[str]:
    """The figures the verdict rests on, each as one readable line."""
    out = [f"{obs.num_finished} requests finished in {obs.window_s:.0f} s "
           f"({obs.request_rate:.2f} req/s)"]  # fmt: skip
    if obs.ttft_p50_s is not None:
        out.append(
            f"TTFT p50 {_ms(obs.ttft_p50_s)}, p90 {_ms(obs.ttft_p90_s)} "
            f"(target {_ms(obs.slo_ttft_s)}); queue {_ms(obs.queue_mean_s)} + prefill "
            f"{_ms(obs.prefill_mean_s)} on average"
        )
    if obs.tpot_p50_s is not None:
        out.append(
            f"TPOT p50 {_ms(obs.tpot_p50_s)}, p90 {_ms(obs.tpot_p90_s)} "
            f"(target {_ms(obs.slo_tpot_s)}); ITL p99 {_ms(obs.itl_p99_s)}"
        )
    if obs.busy:
        per = ", ".join(f"{k} {v:.0%}" for k, v in sorted(obs.busy.items()))
        out.append(f"workers busy in steps: {per}")
    if obs.step_mean_s:
        per = ", ".join(
            f"{ph} {_ms(t)} ({obs.phase_share(ph):.0%} of step time)"
            for ph, t in sorted(obs.step_mean_s.items())
        )
        out.append(f"mean step: {per}")
    if obs.decode_batch_mean is not None:
        out.append(f"decode batch {obs.decode_batch_mean:.1f} sequences on average")
    queues = []
    if obs.running_mean is not None:
        queues.append(f"{obs.running_mean:.1f} requests running")
    if obs.waiting_mean is not None:
        queues.append(f"{obs.waiting_mean:.1f} waiting")
    if obs.kv_usage_max is not None:
        queues.append(f"KV usage peak {obs.kv_usage_max:.0%}")
    if obs.busy:  # the server's counters were read
        queues.append(f"{obs.num_preemptions:.0f} preemptions")
    if queues:
        out.append("on average " + ", ".join(queues))
    utilisation = [
        f"{kind} {ph} {v:.2f}"
        for kind, per in (("MFU", obs.mfu), ("MBU", obs.mbu))
        for ph, v in sorted(per.items())
    ]
    if utilisation:
        out.append("last-step utilisation: " + ", ".join(utilisation))
    if obs.frontend_cpu_cores is not None:
        out.append(f"frontend CPU {obs.frontend_cpu_cores:.2f} cores")
    if obs.outside_ttft_p50_s is not None:
        out.append(f"client TTFT p50 minus the server's: {_ms(obs.outside_ttft_p50_s)}")
    if obs.num_rejected:
        out.append(f"{obs.num_rejected:.0f} requests refused at admission")
    return out


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.0f} ms"


def _scaled(value: int, factor: float) -> int:
    return max(1, int(value * factor))
