"""A discrete-event simulation of a deployment, driving the real scheduling code (no torch).

Each simulated worker is the engine's own `Scheduler` and `KVCacheManager` (with `RemoteKV` for
the two ends of a prefill/decode handoff); requests are placed by the frontend's own `Router`;
with `--pd-ratio auto` the roles are set by the real `RoleManager` and `PDController`, fed by the
real `LoadObserver`. Only the forward pass is replaced: a step takes the time the profile's step
model gives for its shape (`planner.step_model`), and samples a token that ends nothing (every
output runs to its length, as `pdserve bench` forces it). Everything runs on a simulated clock
that the schedulers and the controller read.

The events: a request arrives (the router places it); a worker ends a step (its outputs reach
the client at once; it starts its next step if it has work); a prompt's KV reaches its decode
worker (the last layer's transfer after the prefill: layers ship while later ones compute); the
P:D controller samples the load (every second). A handoff follows the engine's protocol: the
decode worker reserves blocks (`RemoteKV.reserve`), the prefill worker computes the prompt and
the first token (which the client sees then), the KV arrives, the decode worker decodes on.

Serving's own costs come from the profile when it measured them (`Profile.serving`): a step
takes its measured served/in-process factor (decode-only steps and steps with prompt tokens each
their own, and a worker on part of the CPUs its own where measured:
`ServingCosts.decode_factor`, `prefill_factor`) times the step model's time; the CPU the
frontend (and a client on the same machine, `local_client`) spends per output token is added to
the step that emits the token, in the worker's share of the CPUs, when the workers occupy every
CPU; every token reaches the client the profile's time outside the engine after its step
(measured alone and under load; `ServingCosts.latency` by the requests in flight), and a request
reaches its worker the profile's `first_token_extra_s` after the client sent it. A worker's
first step after an idle stretch takes the profile's wake cost on top (`Profile.wake`). With
`step_noise`, each step's time is also multiplied by a ratio drawn (seeded) from how the
profile's own measured steps of its kind lay from their fitted model (`StepNoise`): a machine's
steps scatter, and a percentile resting on a few short steps follows the scatter. With
`speed_trace`, where the profile holds a speed trace (`planner.speed`), decode-bound steps take
the fitted time times the trace's ratio along a seeded path through it: a shared machine's
memory bandwidth moves in stretches. What is not modelled: message latencies between processes,
KV transfer fallbacks and failures, preemption's recompute being cheaper than a first prefill
(the prefix cache is modelled, so recompute hits cached blocks as it does for real).

The result is the same list of `RequestRecord`s as `pdserve bench` writes, so its summary and
`pdserve bench compare` read a simulated run like a measured one.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from pdserve.bench.metrics import COMPLETED, RequestRecord
from pdserve.bench.workload import RequestSpec
from pdserve.config import DisaggConfig, EngineArgs, worker_specs
from pdserve.disagg.router import Router
from pdserve.kv.manager import KVCacheManager
from pdserve.planner.profile import Profile
from pdserve.planner.speed import AlignedPath, SpeedPath, follows_speed
from pdserve.planner.step_model import StepModel, StepNoise, StepShape
from pdserve.pools.pd_controller import MERGED, PDController, PhaseSLO
from pdserve.pools.roles import LoadObserver, RoleManager, cpu_sets
from pdserve.pools.roles import Worker as RoleView
from pdserve.request import Request
from pdserve.sched.scheduler import Scheduler, SchedulerOutput
from pdserve.types import KVRole, RequestStatus, Role, RoleControl, SamplingParams

TOKEN = 3  # what every simulated step samples: no request has an EOS, so nothing stops early
MOONCAKE_BLOCK_TOKENS = 512  # a Mooncake trace's hash ids name blocks of this many tokens
CONTROL_INTERVAL_S = 1.0  # how often the P:D controller samples the load (as the server does)


@dataclass
class StepRecord:
    """One simulated step of one worker (the step log)."""

    worker_id: int
    start_s: float
    duration_s: float
    scheduled: list[tuple[str, int]]  # (request id, tokens computed)
    num_steps: int = 1  # a burst's decode steps (--num-scheduler-steps)


@dataclass
class SimWorker:
    worker_id: int
    role: Role
    scheduler: Scheduler
    size: int  # threads or devices
    predict: Callable[[StepShape], float]
    step_factors: tuple[float, float] = (1.0, 1.0)  # served / in-process: decode, prompt steps
    noise: StepNoise | None = None  # where the simulation draws step-time noise
    speed: SpeedPath | AlignedPath | None = None  # decode-bound steps follow the machine's speed
    fitted: StepModel | None = None  # the unanchored model, with `speed`
    plan: SchedulerOutput | None = None
    step_start: float = 0.0
    wake_pending: bool = False
    idle_since: float = float("-inf")  # when its last step ended (a server idles before a run)

    @property
    def busy(self) -> bool:
        return self.plan is not None


@dataclass
class _Live:
    """A request in flight: its record and its token ids."""

    record: RequestRecord
    prompt: list[int]
    num_tokens: int = 0
    decode_worker: int | None = None
    prefill_worker: int | None = None
    requests: list[Request] = field(default_factory=list)  # on each worker it went through


@dataclass
class SimResult:
    records: list[RequestRecord]
    steps: list[StepRecord]
    decisions: list[dict] = field(default_factory=list)  # role switches (auto)
    end_s: float = 0.0


class Simulation:
    def __init__(
        self,
        profile: Profile,
        engine: EngineArgs,
        disagg: DisaggConfig | None = None,
        *,
        max_model_len: int,
        threads_per_worker: int = 1,
        transport: str | None = None,
        step_time: Callable[[SimWorker, StepShape], float] | None = None,
        local_client: bool = False,
        step_noise: bool = False,
        speed_trace: bool = False,
        speed_offset_s: float | None = None,
        seed: int = 0,
    ) -> None:
        """`threads_per_worker` sizes a worker without a CPU set (one with `--*-cpus` counts its
        CPUs). `step_time(worker, shape)` replaces the profile's step models (tests replay a
        recorded step log with it). `local_client`: the load comes from a client on the same
        machine (a benchmark), whose CPU per token the profile measured too. `step_noise`: each
        step's time takes a ratio drawn from the scatter of the profile's measured steps
        (`Profile.step_noise`; nothing where the profile kept none), from a generator seeded
        with `seed`: the same seed, the same run. `speed_trace`: decode-bound steps (those of a
        few rows, `planner.speed.follows_speed`) take the fitted model's time times the ratio of
        the profile's speed trace at the step's start, along a path cut from it at seeded
        offsets (`planner.speed`), in place of the model's anchor; one path for every worker
        size, since they share the machine. `speed_offset_s`: the trace read in time instead,
        the simulated clock's 0 that many seconds after its first probe (a trace probed beside
        the measured run the simulation replays: `planner.speed.AlignedPath`)."""
        self.profile = profile
        self.disagg = disagg = disagg or DisaggConfig()
        self.now = 0.0
        # auto moves its rows through shared memory between workers of one host (the profile's)
        kind = str(disagg.kv_transport)
        self.transport = transport or ("shm" if kind == "auto" else kind)
        self.events: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self.workers: list[SimWorker] = []
        self.own_cpus: dict[int, frozenset[int]] = {}  # stand-ins, for lending (--pd-merge)
        self._step_time = step_time
        self._noise = step_noise and step_time is None  # a replayed log holds its own times
        self._rng = random.Random(seed)
        self._speed = speed_trace and step_time is None
        self._speed_seed = f"speed/{seed}"  # every size's path cut at the same offsets
        self._speed_offset_s = speed_offset_s
        self._speed_paths: dict[int, SpeedPath | AlignedPath] = {}
        kv_bytes_per_block = engine.block_size * profile.kv_bytes_per_token
        for wid, (role, args, cpus) in enumerate(worker_specs(engine, disagg)):
            cache = args.cache_config()
            num_blocks = cache.num_blocks or cache.memory_bytes // kv_bytes_per_block
            kv = KVCacheManager(num_blocks, args.block_size, cache.enable_prefix_caching)
            sched = Scheduler(args.scheduler_config(max_model_len), kv, clock=self.clock)
            size = _num_cpus(cpus) if cpus else threads_per_worker
            first = sum(len(c) for c in self.own_cpus.values())
            self.own_cpus[wid] = frozenset(range(first, first + size))
            model = profile.step_model(size)
            worker = SimWorker(wid, role, sched, size, model.predict)
            if step_time is not None:
                worker.predict = lambda shape, w=worker: step_time(w, shape)
            self.workers.append(worker)
        self.num_cpus = sum(w.size for w in self.workers)
        self.host_cpu_per_token_s = _host_cpu_per_token(profile, self.num_cpus, local_client)
        served = profile.serving
        # a served step's own slowdown (its worker's loop, the other processes on its cores),
        # per worker: one on part of the CPUs leaves the frontend room beside it; a replayed
        # step log (`step_time`) is already served time
        self.prefill_step_overhead_s = 0.0
        if served is not None and step_time is None:
            self.prefill_step_overhead_s = served.prefill_step_overhead_s
        # a request's way from the client to its worker, beyond the other terms
        self.arrival_delay_s = 0.0
        if served is not None and served.first_token_extra_s is not None:
            self.arrival_delay_s = max(0.0, served.first_token_extra_s)
        for w in self.workers:
            self._set_factors(w)
            self._set_noise(w)
            self._set_speed(w)
        self.block_size = engine.block_size
        self.max_model_len = max_model_len
        self.router = Router(engine.block_size, disagg.min_prompt_tokens)
        for w in self.workers:
            self.router.add_worker(w.worker_id, w.role, w.scheduler.kv.num_free_blocks())
        self.live: dict[str, _Live] = {}
        self.finished: list[_Live] = []
        self.steps: list[StepRecord] = []
        self.slo = PhaseSLO.parse(disagg.slo)
        self.load = LoadObserver(self.slo, clock=self.clock)
        self.roles: RoleManager | None = None
        if disagg.pd_ratio == RoleControl.AUTO:
            start = (disagg.num_prefill_workers, disagg.num_decode_workers)
            controller = PDController(
                disagg.num_workers,
                self.slo,
                start=start,
                min_dwell_s=disagg.pd_min_dwell_s,
                merge=disagg.pd_merge,
            )
            self.roles = RoleManager(RoleControl.AUTO, controller)
        self.decisions: list[dict] = []
        if self.roles is not None and disagg.pd_merge and disagg.num_prefill_workers == 0:
            self._set_roles(self.roles.plan(self._view(), MERGED, "start (--pd-merge)"))

    def clock(self) -> float:
        return self.now

    # ---- events ----------------------------------------------------------------------------
    def at(self, t: float, action: Callable[[], None]) -> None:
        heapq.heappush(self.events, (t, next(self._seq), action))

    def run(self, requests: Sequence[RequestSpec]) -> SimResult:
        for spec in requests:
            self.at(spec.send_at_s, lambda spec=spec: self._arrive(spec))
        if self.roles is not None and requests:
            self.at(CONTROL_INTERVAL_S, self._control)
        while self.events:
            self.now, _, action = heapq.heappop(self.events)
            action()
        records = sorted((x.record for x in self.finished), key=lambda r: r.index)
        return SimResult(records, self.steps, self.decisions, self.now)

    def _arrive(self, spec: RequestSpec) -> None:
        prompt = prompt_ids(spec, self.max_model_len)
        output_len = max(1, min(spec.output_len, self.max_model_len - len(prompt)))
        record = RequestRecord(
            spec.index,
            spec.input_len,
            spec.output_len,
            len(prompt),
            t_scheduled=spec.send_at_s,
            t_arrive=self.now,
            prompt_tokens=len(prompt),
        )
        rid = f"r{spec.index}"
        self.live[rid] = _Live(record, prompt)
        self.load.on_arrival(rid)
        if self.arrival_delay_s:
            self.at(self.now + self.arrival_delay_s, lambda: self._place(rid, output_len))
        else:
            self._place(rid, output_len)

    def _place(self, rid: str, output_len: int) -> None:
        """The request reaches the frontend's router and its worker's scheduler."""
        live = self.live[rid]
        prompt = live.prompt
        route = self.router.route(prompt)
        live.decode_worker = route.decode_id
        decode = self.workers[route.decode_id]
        request = self._request(rid, prompt, output_len)
        live.requests.append(request)
        if route.prefill_id is not None:
            live.prefill_worker = route.prefill_id
            request.kv_role = KVRole.RECEIVE
        decode.scheduler.add_request(request)
        self._wake(decode)

    def _request(self, rid: str, prompt: list[int], output_len: int) -> Request:
        params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
        return Request(rid, list(prompt), params, output_len, arrival_time=self.now)

    def _wake(self, worker: SimWorker) -> None:
        """Let the worker start its next step at the current time, once every other event of
        this instant has been applied (requests arriving together are scheduled together, as
        a real worker reads every queued message before it schedules)."""
        if not worker.wake_pending:
            worker.wake_pending = True
            self.at(self.now, lambda: self._start_step(worker))

    def _start_step(self, worker: SimWorker) -> None:
        """Start the worker's next step if it is idle and has something to compute."""
        worker.wake_pending = False
        if worker.busy:
            return
        plan = worker.scheduler.schedule()
        for reserved in worker.scheduler.remote.take_reservations():
            self._send_to_prefill(reserved)
        if plan.is_empty:
            return
        q_lens, ctx_lens = [], []
        for item in plan.scheduled:
            q_lens.append(item.num_new_tokens)
            ctx_lens.append(item.request.num_computed_tokens + item.num_new_tokens)
        num_sampled = sum(item.sample for item in plan.scheduled)
        shape = StepShape.of(q_lens, ctx_lens, num_sampled)
        if worker.speed is not None and follows_speed(shape, worker.fitted):
            base = worker.fitted.predict(shape) * worker.speed.ratio(self.now)
        else:
            base = worker.predict(shape)
        duration = base * worker.step_factors[0 if shape.is_decode else 1]
        if worker.noise is not None:
            duration *= worker.noise.draw(shape, self._rng, plan.num_steps)
        if self._step_time is None:  # a burst's steps in a row (a replayed log holds its time)
            duration *= plan.num_steps
        if not shape.is_decode:
            duration += self.prefill_step_overhead_s
        if self._step_time is None:  # the first step after an idle stretch: cores to wake
            duration += self.profile.wake_cost(worker.size, self.now - worker.idle_since)
        # the frontend's work on this step's tokens takes CPU from the worker's cores
        duration += (self.host_cpu_per_token_s * num_sampled * plan.num_steps * worker.size
                     / self.num_cpus)  # fmt: skip
        worker.plan, worker.step_start = plan, self.now
        self.steps.append(
            StepRecord(
                worker.worker_id,
                self.now,
                duration,
                [(i.request.request_id, i.num_new_tokens) for i in plan.scheduled],
                plan.num_steps,
            )
        )
        self.at(self.now + duration, lambda: self._step_done(worker))

    def _send_to_prefill(self, reserved: Request) -> None:
        live = self.live[reserved.request_id]
        prefill = self.workers[live.prefill_worker]
        request = self._request(reserved.request_id, live.prompt, reserved.max_tokens)
        live.requests.append(request)
        request.kv_role = KVRole.SEND
        prefill.scheduler.add_request(request)
        self._wake(prefill)

    def _step_done(self, worker: SimWorker) -> None:
        plan, worker.plan = worker.plan, None
        worker.idle_since = self.now
        sched = worker.scheduler
        sampled = [TOKEN] * sum(item.sample for item in plan.scheduled)
        bursts = None if plan.num_steps == 1 else [[TOKEN] * plan.num_steps] * len(sampled)
        outputs = sched.update(plan, sampled, bursts=bursts)
        step_s = (self.now - worker.step_start) / plan.num_steps
        if plan.num_decode_tokens:
            self.load.on_decode_step(worker.worker_id, step_s)
        if plan.num_prefill_tokens and worker.role.decodes:
            self.load.on_prefill_on_decoder(plan.num_prefill_tokens)
        handed_off = {r.request_id for r in sched.remote.take_handed_off()}
        for out in outputs:
            live = self.live.get(out.request_id)
            if live is None:
                continue
            self._tokens(live, len(out.new_token_ids))
            if out.request_id in handed_off:  # the prompt is done: its KV goes to decode
                self._ship_kv(worker, out.request_id)
            elif out.finish_reason is not None:
                self._finish(live)
                if live.prefill_worker == worker.worker_id:  # it ended at its first token
                    decode = self.workers[live.decode_worker]
                    decode.scheduler.finish_requests(
                        [out.request_id], RequestStatus.FINISHED_ABORTED
                    )
                    self._wake(decode)
        self.router.report(
            worker.worker_id, sched.kv.num_free_blocks(), sched.queued_prefill_tokens()
        )
        if worker.role == Role.PARKED:  # its last request may be done: its CPUs go over
            self._lend()
        self._wake(worker)

    def _ship_kv(self, prefill: SimWorker, rid: str) -> None:
        live = self.live[rid]
        num_bytes = len(live.prompt) * self.profile.kv_bytes_per_token
        delay = self.profile.transfer(self.transport).exposed_seconds(
            num_bytes, self.profile.num_layers
        )
        decode = self.workers[live.decode_worker]

        def arrive() -> None:
            out = decode.scheduler.remote.finish_remote(rid, TOKEN)
            if out is not None and out.finish_reason is not None:
                self._finish(live)
            self._wake(decode)

        self.at(self.now + delay, arrive)

    def _tokens(self, live: _Live, n: int) -> None:
        record = live.record
        seen = self.now + self._latency()  # when the client has the token
        for _ in range(n):
            record.token_times.append(seen)
        if n and record.t_first is None:
            record.t_first = seen
            self.load.on_first_output(f"r{record.index}")
        live.num_tokens += n

    def _finish(self, live: _Live) -> None:
        record = live.record
        record.t_end = self.now + self._latency()
        record.status = COMPLETED
        record.completion_tokens = live.num_tokens
        record.cached_tokens = max(max(r.num_cached_tokens, 0) for r in live.requests)
        del self.live[f"r{record.index}"]
        self.finished.append(live)
        self.load.on_finish(record.ttft, record.tpot, f"r{record.index}")

    def _latency(self) -> float:
        """The time a token spends outside the engine now, with this many requests in flight."""
        served = self.profile.serving
        return served.latency(len(self.live)) if served is not None else 0.0

    # ---- the P:D controller ------------------------------------------------------------------
    def _view(self) -> list[RoleView]:
        return [
            RoleView(
                w.worker_id,
                w.role,
                True,
                len(w.scheduler.running),
                w.scheduler.queued_prefill_tokens(),
                len(w.scheduler.waiting) + len(w.scheduler.remote.waiting),
            )
            for w in self.workers
        ]

    def _control(self) -> None:
        view = self._view()
        queued = sum(v.queued_prefill_tokens for v in view)
        kv = max((w.scheduler.kv.usage for w in self.workers if w.role.decodes), default=0.0)
        self._set_roles(self.roles.tick(view, self.load.sample(queued, kv)))
        if self.live or any(t > self.now for t, _, _ in self.events):
            self.at(self.now + CONTROL_INTERVAL_S, self._control)

    def _set_roles(self, changes: dict[int, Role]) -> None:
        for wid, role in changes.items():
            self.workers[wid].role = role
            self.router.set_role(wid, role)
        if changes:
            self.load.on_switch()
            d = self.roles.decisions[-1]
            self.decisions.append({"t": self.now, "reason": d.reason, "new": list(d.new)})
            self._lend()

    def _lend(self) -> None:
        """`--pd-merge`: a parked worker's CPUs go to the colocated worker once it is idle (as
        `SetCPUs` does for real); a step already running keeps its duration."""
        if not self.disagg.pd_merge:
            return
        for wid, cpus in cpu_sets(self._view(), self.own_cpus).items():
            w = self.workers[wid]
            if len(cpus) != w.size:
                w.size = len(cpus)
                if self._step_time is None:
                    w.predict = self.profile.step_model(w.size).predict
                    self._set_factors(w)
                    self._set_noise(w)
                    self._set_speed(w)

    def _set_noise(self, w: SimWorker) -> None:
        w.noise = self.profile.step_noise(w.size) if self._noise else None

    def _set_speed(self, w: SimWorker) -> None:
        trace = self.profile.speed_trace(w.size) if self._speed else None
        if trace is None:
            w.speed = w.fitted = None
            return
        if w.size not in self._speed_paths:
            offset = self._speed_offset_s
            self._speed_paths[w.size] = (
                trace.path(random.Random(self._speed_seed)) if offset is None
                else trace.aligned(offset)
            )  # fmt: skip
        w.speed, w.fitted = self._speed_paths[w.size], self.profile.fitted_step_model(w.size)

    def _set_factors(self, w: SimWorker) -> None:
        served = self.profile.serving
        if served is not None and self._step_time is None:
            w.step_factors = (served.decode_factor(w.size), served.prefill_factor(w.size))


def _host_cpu_per_token(profile: Profile, num_cpus: int, local_client: bool) -> float:
    """Host CPU seconds per output token that land on the workers' cores, from the profile's
    measured serving costs. The CPU counts only when the workers occupy every CPU the profile
    measured on: a spare core takes it."""
    costs = profile.serving
    if costs is None or num_cpus < costs.cpus:
        return 0.0
    return costs.frontend_cpu_per_token_s + (costs.client_cpu_per_token_s if local_client else 0.0)


def prompt_ids(spec: RequestSpec, max_model_len: int) -> list[int]:
    """Token ids standing for a request's prompt: from its trace's block hash ids where it has
    them (requests sharing a block share its tokens, so the prefix cache finds them), else
    unique to the request. At most `max_model_len - 1` tokens."""
    n = min(spec.input_len, max_model_len - 1)
    if spec.hash_ids:
        ids = [
            (h + 1) * MOONCAKE_BLOCK_TOKENS + j
            for h in spec.hash_ids
            for j in range(MOONCAKE_BLOCK_TOKENS)
        ]
        ids += [-(spec.index + 1) * (10**6) - j for j in range(max(0, n - len(ids)))]
        return ids[:n]
    return [-(spec.index + 1) * (10**6) - j for j in range(n)]


def _num_cpus(cpus: str) -> int:
    """'0-3,6' -> 5."""
    n = 0
    for part in cpus.split(","):
        lo, _, hi = part.partition("-")
        n += int(hi or lo) - int(lo) + 1
    return n
