"""Measure a step-time profile on this machine (`pdserve profile`): the simulator's cost model.

For each thread count, an `EngineCore` of the model (pinned to that many of the allowed CPUs)
runs a fixed set of scenarios that together cover the step shapes serving produces: prefills of
one chunk from an empty context (16 to 2048 tokens), a long prompt in chunks (context growing
to 2048), decode batches of 1 to 32 sequences at short and long contexts and of mixed contexts
(one long among short ones: decode attention pads to the longest), decodes sharing their steps
with prefill chunks (mixed steps) and with whole prompts of 640 and 1,536 tokens (an unchunked
deployment's mixed steps), prompts that find all but a few of their tokens in the prefix cache
(alone and beside decodes), and serving's steady state (requests of spread lengths arriving
every few steps while others decode). Every step's shape (`StepShape`, taken from the
scheduler's plan) and wall time (`EngineCore.step`: schedule, forward, sample, update) is
recorded, and a `SplitStepModel` (decode-only steps fitted apart, wide decode batches apart
again where that fits them better) per thread count, with what an idle stretch adds to the step
after it (`measure_wake`: the cores' clocks, sleeping threads and cold caches); the fit's error
on the measured steps is printed and kept in the profile's notes, and the steps themselves in
the profile, so that a later fit can use them again (`pdserve profile --refit`). KV transfers:
`shm` is a copy into shared memory, so its rate is this machine's measured copy bandwidth; `tcp`
is measured by sending 1 MiB frames over a loopback ZMQ socket.

`measure_anchors` (`pdserve profile --anchor`) runs a few seconds of the same shapes on an
existing profile's thread counts and measures how much faster or slower they run now than the
profile's model says (`planner.profile.Anchor`): this machine's speed moves by 5-20% within half
an hour when others share it, and a profile keeps the speed of the minutes it was measured in.
`measure_speed` (`pdserve profile --speed-trace`) follows that speed for minutes, a probe of a
few decode steps every half second (`planner.speed.SpeedTrace`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import statistics
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timezone

import numpy as np
import torch

from pdserve.config import EngineArgs
from pdserve.engine.core import EngineCore
from pdserve.perf.cost import ModelShape
from pdserve.perf.hardware import cpu_model
from pdserve.planner.profile import Anchor, Profile, TransferModel, WakeCost
from pdserve.planner.speed import SpeedTrace
from pdserve.planner.step_model import SplitStepModel, StepModel, StepShape
from pdserve.types import SamplingParams

Sample = tuple[StepShape, float]
STEADY_REQUESTS = 40  # the steady-state scenario: a request arrives every STEADY_GAP_STEPS steps
STEADY_GAP_STEPS = 4
WAKE_IDLE_S = (0.1, 0.5, 2.0)  # `measure_wake`: idle stretches before a timed step
WAKE_REPEATS = 6


def measure_profile(
    args: EngineArgs,
    threads: Sequence[int],
    *,
    repeats: int = 2,
    split_decode: bool = True,
    log: Callable[[str], None] = print,
) -> Profile:
    """Measure and fit a profile for each thread count in `threads` (`split_decode`: see
    `SplitStepModel.fit`)."""
    allowed = sorted(os.sched_getaffinity(0))
    models, notes, kept, wake = {}, [], {}, {}
    shape = ModelShape.from_hf_config(_hf_config(args.model))
    kv_bytes_per_token = 0
    for n in threads:
        if n > len(allowed):
            raise ValueError(f"invalid thread count {n}: only {len(allowed)} CPUs are allowed")
        os.sched_setaffinity(0, allowed[:n])
        try:
            core = EngineCore(dataclasses.replace(args, num_threads=n))
            kv_bytes_per_token = core.runner.kv_bytes_per_block // core.runner.block_size
            samples = run_scenarios(core, repeats, log=lambda m, n=n: log(f"[{n} thread(s)] {m}"))
            wake[n] = measure_wake(core)
        finally:
            os.sched_setaffinity(0, allowed)
        model = SplitStepModel.fit(
            [s for s, _ in samples], [t for _, t in samples], split_decode=split_decode
        )
        err = _fit_error(model, samples)
        models[n] = model
        kept[n] = [[list(s.q_lens), list(s.ctx_lens), s.num_sampled, t] for s, t in samples]
        wide = f"; decode batches of more than {model.wide_rows} fitted apart" * bool(
            model.wide_decode
        )
        note = (
            f"{n} thread(s) on CPUs {allowed[:n]}: {len(samples)} steps, fit error "
            f"median {err[0]:.1%}, p90 {err[1]:.1%}{wide}; the first step after "
            + ", ".join(f"{g:g} s idle +{x * 1e3:.1f} ms" for g, x in wake[n].points)
        )
        notes.append(note)
        log(note)
    copy_bw = _copy_bandwidth()
    transfers = {"shm": TransferModel(0.0005, copy_bw), "tcp": _tcp_transfer()}
    notes.append(
        f"shm: copy bandwidth {copy_bw / 1e9:.1f} GB/s; tcp: loopback "
        f"{transfers['tcp'].bytes_per_s / 1e9:.2f} GB/s; latency 0.5 ms assumed for shm"
    )
    return Profile(
        kind="measured",
        description=profile_description(args),
        kv_bytes_per_token=kv_bytes_per_token or shape.kv_bytes_per_token,
        num_layers=shape.num_layers,
        step_models=models,
        transfers=transfers,
        notes=notes,
        samples=kept,
        wake=wake,
    )


class Driver:
    """Requests of random tokens added to an `EngineCore` and its steps run and timed, with the
    scheduler's token budget and chunk size of each scenario; the timed steps in `samples`."""

    def __init__(self, core: EngineCore, seed: int = 0):
        self.core, self.rng = core, random.Random(seed)
        self.samples: list[Sample] = []
        self._counter = iter(range(10**9))

    def add(self, n_prompt: int, max_tokens: int, prefix: Sequence[int] = ()) -> list[int]:
        """A request of `n_prompt` tokens: `prefix`, then random ones. Returns its prompt."""
        core = self.core
        n_prompt = min(n_prompt, core.max_model_len - 64)
        vocab = core.model_config.vocab_size
        tokens = list(prefix[:n_prompt])
        tokens += [self.rng.randrange(3, vocab) for _ in range(n_prompt - len(tokens))]
        max_tokens = min(max_tokens, core.max_model_len - len(tokens))  # a small model's context
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        core.add_request(core.make_request(f"p{next(self._counter)}", tokens, params))
        return tokens

    def run(self, budget: int, chunk: int = 0, until=None) -> None:
        sched = self.core.scheduler
        sched.config = dataclasses.replace(
            sched.config, max_num_batched_tokens=budget, long_prefill_token_threshold=chunk
        )
        while sched.has_unfinished and (until is None or not until()):
            self.samples.extend(timed_step(self.core))

    def beside_decodes(
        self, batch: int, prompts: Sequence[int], budget: int, chunk: int = 0
    ) -> None:
        """`batch` requests decoding (128-token prompts, prefilled first), then `prompts`
        added and every request run to its end with `budget` and `chunk`: steps of prompt
        tokens beside those decodes (mixed steps)."""
        sched = self.core.scheduler
        for _ in range(batch):
            self.add(128, 40)
        self.run(8192, until=lambda: not sched.waiting
                 and all(r.num_output_tokens > 0 for r in sched.running))  # fmt: skip
        for n in prompts:
            self.add(n, 1)
        self.run(budget, chunk)

    def prefix_hits(self, contexts: Sequence[int], new: Sequence[int], batch: int = 0) -> None:
        """Prompts that find most of themselves in the prefix cache, as a conversation's next
        turn or a shared system prompt does: for each context length, a prompt of that many
        tokens is prefilled, then prompts that repeat it and add `new` tokens each (0: the same
        prompt again, whose last token is computed again) are prefilled one at a time, beside
        `batch` decodes. Steps that compute a few tokens over a long cached context."""
        sched = self.core.scheduler
        for _ in range(batch):
            self.add(128, 40 + 2 * len(contexts) * len(new))
        self.run(8192, until=lambda: not sched.waiting
                 and all(r.num_output_tokens > 0 for r in sched.running))  # fmt: skip
        for ctx in contexts:
            base = self.add(ctx, 1)
            self.run(8192, until=lambda: not sched.waiting)
            for n in new:
                self.add(ctx + n, 1, prefix=base)
                self.run(8192, until=lambda: not sched.waiting)
        self.run(8192)

    def warm_up(self) -> None:
        """Kernels built and caches touched; nothing kept."""
        self.run(256)
        self.add(64, 4)
        self.run(256)
        self.samples.clear()


def measure_wake(
    core: EngineCore, idle_s: Sequence[float] = WAKE_IDLE_S, repeats: int = WAKE_REPEATS
) -> WakeCost:
    """What an idle stretch adds to the step after it: the same step (ten prompt tokens over a
    cached context of 288, as a conversation's next turn) timed right after a few busy steps
    and after each of `idle_s` idle, `repeats` times each in a shuffled order; the extra is the
    median's over the step right after others, never less for a longer stretch."""
    driver = Driver(core, seed=2)
    base = driver.add(288, 1)
    driver.run(8192)
    gaps = [0.0, *idle_s] * repeats
    random.Random(2).shuffle(gaps)
    times: dict[float, list[float]] = {g: [] for g in gaps}
    for gap in gaps:
        driver.add(128, 8)  # the cores busy: a prompt and its decodes
        driver.run(8192)
        time.sleep(gap)
        start = len(driver.samples)
        driver.add(298, 1, prefix=base)
        driver.run(8192)
        times[gap].append(driver.samples[start][1])
    warm, points, most = statistics.median(times[0.0]), [], 0.0
    for gap in sorted(idle_s):
        most = max(most, statistics.median(times[gap]) - warm)
        points.append((gap, most))
    return WakeCost(tuple(points))


def profile_description(args: EngineArgs) -> str:
    """What a profile measured with `args` on this machine says it is of."""
    return f"{args.model} ({args.dtype}, {args.linear_backend} kernels) on {cpu_model()}"


PROBE_PROMPTS = (64, 256, 512)  # `probe_scenarios`: one-chunk prompts
PROBE_DECODES = ((1, 256), (4, 128), (8, 64))  # and decode batches: (sequences, context)


def measure_anchors(
    args: EngineArgs,
    profile: Profile,
    log: Callable[[str], None] = print,
    cores: dict[int, EngineCore] | None = None,
) -> dict[int, Anchor]:
    """Anchor a measured profile to this machine's speed of the moment: for each worker size it
    has a model of, a few seconds of steps (`probe_scenarios`) on that many of the allowed CPUs
    against the fitted model's time for them (`Anchor`). `args` must be the engine the profile
    was measured with, on the same machine. `cores`: engines by thread count kept from one call
    to the next (those missing are built and added), for a caller that probes again and again."""
    _check_measured(args, profile, "anchor")
    allowed = sorted(os.sched_getaffinity(0))
    anchors = {}
    for n in sorted(profile.step_models):
        if n > len(allowed):
            raise ValueError(f"the profile has a {n}-thread model: only {len(allowed)} CPUs here")
        os.sched_setaffinity(0, allowed[:n])
        try:
            core = (cores or {}).get(n) or EngineCore(dataclasses.replace(args, num_threads=n))
            if cores is not None:
                cores[n] = core
            torch.set_num_threads(n)  # another kept engine may have set its own
            samples = probe_scenarios(core, seed=time.monotonic_ns())
            del core
        finally:
            os.sched_setaffinity(0, allowed)
        rows = [[list(s.q_lens), list(s.ctx_lens), s.num_sampled, t] for s, t in samples]
        when = datetime.now(timezone.utc).isoformat(timespec="seconds")
        anchors[n] = a = Anchor.measure(profile.fitted_step_model(n), rows, when)
        log(
            f"{n} thread(s): {len(rows)} probe steps at x{a.decode:.2f} (decode) and "
            f"x{a.prefill:.2f} (prompt) the profile's time"
        )
    return anchors


SPEED_PROBE_STEPS = 4  # `measure_speed`: decode steps per probe, at their median
SPEED_PROBE_CONTEXT = 256  # the probed sequence's prompt; it decodes on from one probe to the next


def measure_speed(
    args: EngineArgs,
    profile: Profile,
    seconds: float,
    interval_s: float = 0.5,
    log: Callable[[str], None] = print,
    cores: dict[int, EngineCore] | None = None,
) -> dict[int, SpeedTrace]:
    """How this machine's speed for decode-bound steps moves (`planner.speed.SpeedTrace`), per
    worker size of `profile`: for `seconds`, every `interval_s`, each size's engine (pinned to
    that many of the allowed CPUs) runs `SPEED_PROBE_STEPS` decode steps of one sequence, and
    the probe is their median time over the fitted model's for them. The sizes take turns within
    each probe, so each sees the same stretch of the machine. The machine must be otherwise idle:
    a probe is a sensor of the host's speed, not of a load. `cores` as in `measure_anchors`."""
    _check_measured(args, profile, "trace")
    allowed = sorted(os.sched_getaffinity(0))
    sizes = sorted(profile.step_models)
    if sizes[-1] > len(allowed):
        raise ValueError(
            f"the profile has a {sizes[-1]}-thread model: only {len(allowed)} CPUs here"
        )
    cores = {} if cores is None else cores
    drivers = {}
    for n in sizes:
        with _pinned(allowed[:n]):
            cores[n] = core = cores.get(n) or EngineCore(dataclasses.replace(args, num_threads=n))
            drivers[n] = Driver(core, seed=time.monotonic_ns())
            drivers[n].warm_up()
    points: dict[int, list[tuple[float, float]]] = {n: [] for n in sizes}
    start = time.monotonic()
    next_probe = start
    while (now := time.monotonic()) < start + seconds:
        time.sleep(max(0.0, next_probe - now))
        next_probe += interval_s
        for n in sizes:
            with _pinned(allowed[:n]):
                ratio = speed_probe(drivers[n], profile.fitted_step_model(n))
            if ratio is not None:
                points[n].append((time.monotonic() - start, ratio))
    for driver in drivers.values():  # a kept engine is left with nothing to run
        sched = driver.core.scheduler
        driver.core.abort_requests([r.request_id for r in (*sched.running, *sched.waiting)])
    traces = {}
    for n in sizes:
        if len(points[n]) >= 2:
            traces[n] = trace = SpeedTrace(tuple(points[n]))
            log(f"{n} thread(s): {trace.describe()}")
    return traces


@contextlib.contextmanager
def _pinned(cpus: list[int]):
    """This process on `cpus` and torch on as many threads, for the block."""
    allowed = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, cpus)
    torch.set_num_threads(len(cpus))
    try:
        yield
    finally:
        os.sched_setaffinity(0, allowed)


def speed_probe(driver: Driver, model: StepModel) -> float | None:
    """The median of `SPEED_PROBE_STEPS` decode steps' time over `model`'s for them; a new
    sequence is prefilled first where none is decoding (that prefill is not counted)."""
    sched = driver.core.scheduler
    if not sched.has_unfinished:
        driver.add(SPEED_PROBE_CONTEXT, 100_000)
        driver.run(8192, until=lambda: not sched.waiting
                   and all(r.num_output_tokens > 0 for r in sched.running))  # fmt: skip
    driver.samples.clear()
    driver.run(8192, until=lambda: len(driver.samples) >= SPEED_PROBE_STEPS)
    ratios = [t / p for s, t in driver.samples if s.is_decode and (p := model.predict(s)) > 0]
    return statistics.median(ratios) if ratios else None


def _check_measured(args: EngineArgs, profile: Profile, what: str) -> None:
    """`profile` is a measured one of the engine `args` describe, to `what` ("anchor")."""
    if profile.kind != "measured":
        raise ValueError(f"only a measured profile can be {what.removesuffix('e')}ed")
    if profile.description != (here := profile_description(args)):
        raise ValueError(
            f"the profile is of {profile.description!r}, this engine here is {here!r}: {what} "
            "it with the engine flags it was measured with, on the machine it was measured on"
        )


def probe_scenarios(core: EngineCore, seed: int = 1) -> list[Sample]:
    """A few seconds of steps of shapes the scenarios measure (`run_scenarios`): one-chunk
    prompts and decode batches, twice. Prompts of random tokens by `seed`: an engine probed
    again takes another seed, or its prefix cache would hold them."""
    driver = Driver(core, seed=seed)
    driver.warm_up()
    for _ in range(2):
        for q in PROBE_PROMPTS:
            driver.add(q, 1)
            driver.run(4096)
        for batch, ctx in PROBE_DECODES:
            for _ in range(batch):
                driver.add(ctx, 12)
            driver.run(8192)
    return driver.samples


def run_scenarios(core: EngineCore, repeats: int, log=print) -> list[Sample]:
    """Drive `core` through the scenarios; every step's (shape, seconds)."""
    driver = Driver(core)
    rng, samples, add, run = driver.rng, driver.samples, driver.add, driver.run
    driver.warm_up()
    for r in range(repeats):
        for q in (16, 64, 128, 256, 512, 1024, 2048):  # one chunk from an empty context
            add(q, 1)
            run(4096)
        add(2048, 1)  # a long prompt in 256-token chunks: attention over a growing context
        run(256, 256)
        for ctx in (64, 512):
            for batch in (1, 2, 4, 8, 16, 32):  # decode batches
                for _ in range(batch):
                    add(ctx, 12)
                run(8192)
        for batch in (4, 16):  # decode batches of mixed contexts: one long, the rest short
            add(1024, 12)
            for _ in range(batch - 1):
                add(64, 12)
            run(8192)
        # decodes sharing their steps with prompt chunks, then with whole prompts (the mixed
        # steps of an unchunked deployment)
        for batch in (4, 16):
            driver.beside_decodes(batch, (768, 384), 256 + batch, 256)
            driver.beside_decodes(batch, (1536, 640), 4096)
        # prompts that hit the prefix cache (a conversation's next turn): a few tokens computed
        # over a long cached context, alone and beside decodes
        for batch in (0, 4):
            driver.prefix_hits((128, 512, 1024), (0, 8, 32), batch)
        # serving's steady state: requests of spread lengths arriving while others decode, so
        # decode batches hold contexts of every length over a cache that has seen turnover
        for _ in range(STEADY_REQUESTS):
            add(rng.randrange(64, 1024), rng.randrange(16, 96))
            run(512, 256, until=lambda n=len(samples): len(samples) >= n + STEADY_GAP_STEPS)
        run(512, 256)
        log(f"repeat {r + 1}/{repeats}: {len(samples)} steps")
    return samples


def timed_step(core: EngineCore) -> list[Sample]:
    """One `core.step()`: its shape (from the scheduler's plan) and wall time; none if idle."""
    shapes: list[StepShape] = []
    schedule = core.scheduler.schedule

    def recording():
        plan = schedule()
        if not plan.is_empty:
            q = [i.num_new_tokens for i in plan.scheduled]
            ctx = [i.request.num_computed_tokens + i.num_new_tokens for i in plan.scheduled]
            shapes.append(StepShape.of(q, ctx, sum(i.sample for i in plan.scheduled)))
        return plan

    core.scheduler.schedule = recording
    try:
        t0 = time.perf_counter()
        core.step()
        elapsed = time.perf_counter() - t0
    finally:
        del core.scheduler.schedule  # back to the class's method
    return [(shapes[0], elapsed)] if shapes else []


def _fit_error(model: StepModel, samples: list[Sample]) -> tuple[float, float]:
    errors = sorted(abs(model.predict(s) - t) / t for s, t in samples)
    return statistics.median(errors), errors[int(0.9 * (len(errors) - 1))]


def _copy_bandwidth(num_bytes: int = 256 << 20) -> float:
    """Bytes per second of one large copy (the best of three)."""
    src = np.ones(num_bytes, dtype=np.uint8)
    dst = np.empty_like(src)
    best = min(_seconds(lambda: np.copyto(dst, src)) for _ in range(3))
    return num_bytes / best


def _tcp_transfer(total: int = 64 << 20, frame: int = 1 << 20) -> TransferModel:
    """A loopback ZMQ PUSH/PULL pair: one small frame for latency, then `total` bytes."""
    import zmq

    ctx = zmq.Context.instance()
    push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    try:
        port = pull.bind_to_random_port("tcp://127.0.0.1")
        push.connect(f"tcp://127.0.0.1:{port}")
        payload = b"\0" * frame
        push.send(b"x")
        pull.recv()
        latency = min(_seconds(lambda: (push.send(b"x"), pull.recv())) for _ in range(20))

        def move():
            for _ in range(total // frame):
                push.send(payload, copy=False)
                pull.recv(copy=False)

        return TransferModel(latency, total / min(_seconds(move) for _ in range(2)))
    finally:
        push.close(0)
        pull.close(0)


def _seconds(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _hf_config(model: str) -> dict:
    import json
    from pathlib import Path

    return json.loads((Path(model) / "config.json").read_text())
