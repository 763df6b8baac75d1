"""A deployment's cost model: step times per worker size, and KV transfer times (no torch).

A `Profile` is what the simulator needs to know of the hardware and the model: how long a step
of a given shape takes on a worker of N threads (CPU) or devices (`step_models`), how long a
prompt's KV takes to reach another worker (`transfers`, per transport), how many bytes of KV a
token holds, and (measured profiles) what serving adds: the CPU the frontend takes per output
token and its latency (`serving`). A measured profile can be anchored later (`anchors`): a
probe of a few seconds measures how much faster or slower the machine runs the same steps now,
and the step models scale by that (`pdserve profile --anchor`). `pdserve profile` measures one on this machine (`kind:
"measured"`); for hardware that is not here, `analytic_profile` builds one from datasheet peaks
(`kind: "analytic"`, which the output says). Profiles are JSON files.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pdserve.planner.speed import SpeedTrace
from pdserve.planner.step_model import (
    ScaledStepModel,
    SplitStepModel,
    StepModel,
    StepNoise,
    StepShape,
    step_model_from_dict,
)


@dataclass(frozen=True)
class TransferModel:
    """Time to move `n` bytes of KV from a prefill to a decode worker: latency + n / rate.
    Layers ship while later layers compute, so only the last layer's share is exposed after a
    prefill (`exposed_seconds`)."""

    latency_s: float
    bytes_per_s: float

    def exposed_seconds(self, num_bytes: float, num_layers: int) -> float:
        return self.latency_s + num_bytes / max(num_layers, 1) / self.bytes_per_s


@dataclass(frozen=True)
class ServingCosts:
    """What serving adds to a step on the measured machine (`perf/serving_costs.py`): CPU time
    per output token that the frontend, and a client on the same machine, take from the cores;
    the time a first token spends outside the engine; and how much longer a served step takes
    than the same step in-process (the worker's loop, and other processes on its cores), per
    kind of step, beyond the CPU per token. Profiles measured before the factors lack them
    (1.0)."""

    cpus: int  # the CPUs the measured deployment occupied
    frontend_cpu_per_token_s: float
    client_cpu_per_token_s: float
    frontend_latency_s: float
    decode_step_factor: float = 1.0  # a served decode-only step / the same step in-process
    prefill_step_factor: float = 1.0  # a served step with prompt tokens / the same in-process
    # the served steps the factors come from, [q_lens, ctx_lens, seconds] each (CPU per token
    # included), and where measured the same step's in-process seconds as a fourth value; a
    # refitted step model gets its factors again from them (`refit`)
    calibration_steps: list = field(default_factory=list)
    # a fixed cost on each served step with prompt tokens, where the calibration's prompts
    # of several lengths separate one from the other (served = overhead + factor x in-process)
    prefill_step_overhead_s: float = 0.0
    # a decode worker on part of the CPUs (`part_cpus` of them, as the decode worker of a 1P+1D
    # split), where the frontend runs beside the worker instead of taking one of its cores: its
    # served decode step over the in-process step at its size, from a second calibration server
    # split in two, and the steps it comes from; None where not measured (then
    # `decode_step_factor` stands for every worker)
    part_decode_step_factor: float | None = None
    part_cpus: int = 0
    part_calibration_steps: list = field(default_factory=list)
    # the prefill worker of that split, on the other part of the CPUs: its prompt steps by its
    # own clock (the server's step-time histogram) over the same prompts' steps in-process on
    # as many CPUs, [worker seconds, in-process seconds] each, and the ratio of their medians;
    # None where not measured (then `prefill_step_factor` stands for every worker). The prompt's
    # fixed cost and the first token's way out stay in the terms above, as for any worker.
    part_prefill_step_factor: float | None = None
    part_prompt_steps: list = field(default_factory=list)
    # the time outside the engine of a request served alone (the calibration's requests sent
    # one at a time), and how many streams the loaded figure (`frontend_latency_s`) had in
    # flight; None where not measured (then `frontend_latency_s` at every load)
    frontend_latency_alone_s: float | None = None
    latency_streams: int = 0
    # a first token's time outside the worker's own prompt step, over what the other terms
    # hold (`prefill_step_overhead_s` and the alone latency): the way in (HTTP, tokenizing, the
    # hop to the worker) and, as the worker goes straight on to its next step on the cores the
    # frontend shares, the wait for a CPU on the way out. Measured on requests served alone that
    # go on decoding (the client's TTFT less the server's prompt-step time from its /metrics);
    # the simulator adds it to a request's way to the worker. None where not measured (0).
    first_token_extra_s: float | None = None

    def latency(self, in_flight: int) -> float:
        """The time a token spends outside the engine with `in_flight` requests streaming: the
        alone figure for one, the loaded one at `latency_streams` and past it, the line between
        them in between (the frontend's and the client's event loops serve every stream)."""
        alone, streams = self.frontend_latency_alone_s, self.latency_streams
        if alone is None or streams <= 1:
            return self.frontend_latency_s
        share = min(1.0, max(0, in_flight - 1) / (streams - 1))
        return alone + (self.frontend_latency_s - alone) * share

    def decode_factor(self, worker_cpus: int) -> float:
        """The served-step factor of a decode step on a worker of `worker_cpus` CPUs."""
        if worker_cpus < self.cpus and self.part_decode_step_factor is not None:
            return self.part_decode_step_factor
        return self.decode_step_factor

    def prefill_factor(self, worker_cpus: int) -> float:
        """The served-step factor of a step with prompt tokens on a worker of `worker_cpus`
        CPUs."""
        if worker_cpus < self.cpus and self.part_prefill_step_factor is not None:
            return self.part_prefill_step_factor
        return self.prefill_step_factor


@dataclass(frozen=True)
class Anchor:
    """This machine's speed at a later moment than the one its profile's steps were measured
    in: a short probe's steps (`steps`, [q_lens, ctx_lens, num_sampled, seconds] each) over the
    fitted model's time for them, at the median, for decode-only steps and for steps with prompt
    tokens (1.0 where the probe ran none). A machine shared with others moves 5-20% within half
    an hour; a profile measured in minutes keeps the speed of those minutes, and an anchor taken
    just before a run brings it to the run's."""

    decode: float
    prefill: float
    steps: list = field(default_factory=list)
    when: str = ""  # UTC, ISO 8601

    @classmethod
    def measure(cls, model: StepModel, steps: list, when: str = "") -> Anchor:
        ratios: dict[bool, list[float]] = {True: [], False: []}
        for q_lens, ctx_lens, num_sampled, seconds in steps:
            shape = StepShape.of(q_lens, ctx_lens, num_sampled)
            if (predicted := model.predict(shape)) > 0:
                ratios[shape.is_decode].append(seconds / predicted)
        decode, prefill = (
            statistics.median(ratios[k]) if ratios[k] else 1.0 for k in (True, False)
        )
        return cls(decode, prefill, steps, when)


@dataclass(frozen=True)
class WakeCost:
    """How much longer a worker's first step after an idle stretch takes than the same step
    right after another: the cores' clocks, sleeping threads and cold caches. `points`:
    [idle seconds, extra seconds] measured (`perf.step_profile.measure_wake`), by idle time; a
    stretch between two points takes the line between them, one past the last the last's
    (a 2-core Zen 4 took 25.6 ms for a step right after another, 38.6 ms at the median after
    2 s idle, up to 79 ms)."""

    points: tuple[tuple[float, float], ...]

    def extra(self, idle_s: float) -> float:
        x0, y0 = 0.0, 0.0
        for x1, y1 in self.points:
            if idle_s <= x1:
                return y0 + (y1 - y0) * (idle_s - x0) / (x1 - x0) if x1 > x0 else y1
            x0, y0 = x1, y1
        return y0


@dataclass
class Profile:
    kind: str  # "measured" (on this machine) or "analytic" (datasheet peaks, efficiency factors)
    description: str  # the hardware and the model, in words
    kv_bytes_per_token: int
    num_layers: int
    step_models: dict[int, StepModel]  # by threads (CPU) or devices per worker
    transfers: dict[str, TransferModel] = field(default_factory=dict)  # by transport
    notes: list[str] = field(default_factory=list)  # how it was measured or assumed
    serving: ServingCosts | None = None  # measured profiles: the frontend's share of the CPUs
    # measured profiles: the steps the models were fitted to, by worker size, [q_lens, ctx_lens,
    # num_sampled, seconds] each, so that a later version of the fit can refit them (`refit`)
    samples: dict[int, list] = field(default_factory=dict)
    # measured profiles anchored later (`Anchor`), by worker size: the step models scale by them
    anchors: dict[int, Anchor] = field(default_factory=dict)
    # measured profiles: the first step after an idle stretch, by worker size (older profiles
    # lack it: no cost)
    wake: dict[int, WakeCost] = field(default_factory=dict)
    # measured profiles: how the machine's speed for decode-bound steps moved over a few minutes
    # (`pdserve profile --speed-trace`), by worker size, against the fitted models
    speed: dict[int, SpeedTrace] = field(default_factory=dict)

    def wake_cost(self, size: int, idle_s: float) -> float:
        """Seconds a worker of `size` adds to its first step after `idle_s` idle."""
        wake = self.wake.get(self._nearest(size)) if self.wake else None
        return wake.extra(idle_s) if wake is not None else 0.0

    def step_model(self, size: int) -> StepModel:
        """The model of a worker of `size` threads or devices (the nearest measured size),
        scaled by its anchor where the profile has one."""
        nearest = self._nearest(size)
        model, anchor = self.step_models[nearest], self.anchors.get(nearest)
        if anchor is None:
            return model
        return ScaledStepModel(model, anchor.decode, anchor.prefill)

    def step_noise(self, size: int) -> StepNoise | None:
        """How the measured steps of a worker of `size` (the nearest measured size) scatter
        around their fitted model (`StepNoise`); None where the profile kept no steps (analytic
        profiles, older measured ones)."""
        rows = self.samples.get(self._nearest(size)) if self.samples else None
        return StepNoise.fit(self.fitted_step_model(size), rows) if rows else None

    def speed_trace(self, size: int) -> SpeedTrace | None:
        """How the machine's speed for decode-bound steps of a worker of `size` (the nearest
        measured size) moved against the fitted model (`SpeedTrace`); None where not measured."""
        return self.speed.get(self._nearest(size)) if self.speed else None

    def fitted_step_model(self, size: int) -> StepModel:
        """The model as fitted to the profile's own steps, whatever anchors it carries."""
        return self.step_models[self._nearest(size)]

    def _nearest(self, size: int) -> int:
        if size in self.step_models:
            return size
        return min(self.step_models, key=lambda s: (abs(s - size), -s))

    def anchored(self, anchors: dict[int, Anchor]) -> Profile:
        """This profile with `anchors` (by worker size) in place of any it had."""
        if self.kind != "measured":
            raise ValueError("only a measured profile can be anchored")
        unknown = set(anchors) - set(self.step_models)
        if unknown:
            raise ValueError(f"anchors for worker sizes {sorted(unknown)} the profile lacks")
        return dataclasses.replace(self, anchors=dict(anchors))

    def transfer(self, transport: str) -> TransferModel:
        if transport not in self.transfers:
            raise KeyError(f"the profile has no KV transfer model for transport {transport!r}")
        return self.transfers[transport]

    # ---- JSON ------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {
            "kind": self.kind,
            "description": self.description,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "num_layers": self.num_layers,
            "step_models": {str(k): m.to_dict() for k, m in sorted(self.step_models.items())},
            "transfers": {
                k: {"latency_s": t.latency_s, "bytes_per_s": t.bytes_per_s}
                for k, t in self.transfers.items()
            },
            "notes": self.notes,
            "serving": None if self.serving is None else asdict(self.serving),
            "samples": {str(k): v for k, v in sorted(self.samples.items())},
            "anchors": {str(k): asdict(a) for k, a in sorted(self.anchors.items())},
            "wake": {str(k): [list(p) for p in w.points] for k, w in sorted(self.wake.items())},
            "speed": {str(k): t.to_dict() for k, t in sorted(self.speed.items())},
        }

    @classmethod
    def from_dict(cls, d: dict) -> Profile:
        return cls(
            kind=d["kind"],
            description=d["description"],
            kv_bytes_per_token=int(d["kv_bytes_per_token"]),
            num_layers=int(d["num_layers"]),
            step_models={int(k): step_model_from_dict(m) for k, m in d["step_models"].items()},
            transfers={k: TransferModel(**t) for k, t in d.get("transfers", {}).items()},
            notes=list(d.get("notes", [])),
            serving=ServingCosts(**d["serving"]) if d.get("serving") else None,
            samples={int(k): v for k, v in d.get("samples", {}).items()},
            anchors={int(k): Anchor(**a) for k, a in d.get("anchors", {}).items()},
            wake={
                int(k): WakeCost(tuple((float(x), float(y)) for x, y in points))
                for k, points in d.get("wake", {}).items()
            },
            speed={int(k): SpeedTrace.from_dict(t) for k, t in d.get("speed", {}).items()},
        )

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        return cls.from_dict(json.loads(Path(path).read_text()))


def step_factors(steps: list, model: StepModel, cpu_per_token_s: float) -> dict[str, float]:
    """The served/in-process factors of `ServingCosts` from served steps of known shape
    ([q_lens, ctx_lens, seconds] each, `calibration_steps`): per kind of step, the median served
    time less the CPU one token costs, over the median in-process time of the same shapes. A
    step's in-process time is its fourth value where it has one (the same request run in-process
    seconds after it was served, so that both are taken in the machine's same state), else the
    model's prediction. A kind with no served step is left out (its factor stays 1.0).

    Where the prompt steps span lengths (the longest in-process step at least
    `PROMPT_SPAN` times the shortest), the prompt's served time is fitted as a line instead,
    `overhead + factor x in-process` (overhead >= 0; a line that outliers move little, `_line`):
    a short prompt served pays a cost of its own that a ratio taken on long prompts hides."""
    served: dict[bool, list[float]] = {True: [], False: []}
    in_process: dict[bool, list[float]] = {True: [], False: []}
    for q_lens, ctx_lens, seconds, *own in steps:
        shape = StepShape.of(q_lens, ctx_lens, 1)
        served[shape.is_decode].append(seconds - cpu_per_token_s)
        in_process[shape.is_decode].append(own[0] if own else model.predict(shape))
    factors = {}
    for name, decode in (("prefill_step_factor", False), ("decode_step_factor", True)):
        own = statistics.median(served[decode]) if served[decode] else 0.0
        if own > 0:
            factors[name] = own / statistics.median(in_process[decode])
    x, y = in_process[False], served[False]
    if len(x) >= 3 and min(x) > 0 and max(x) >= PROMPT_SPAN * min(x):
        line = _line(x, y)
        if line is not None:
            factors["prefill_step_overhead_s"], factors["prefill_step_factor"] = line
    return factors


def calibration_drift(profile: Profile) -> float | None:
    """How this machine's speed moved between measuring the profile's steps and its serving
    costs, minutes later: the median ratio of the calibration's in-process decode steps to the
    step model's time for them (above 1: slower then). None without paired calibration steps.
    The served-step factors cancel such drift (both sides of a pair are taken seconds apart),
    the step models do not: a simulated figure moves with it."""
    served = profile.serving
    if served is None:
        return None
    ratios = []
    for steps, size in ((served.calibration_steps, served.cpus),
                        (served.part_calibration_steps, served.part_cpus)):  # fmt: skip
        model = profile.fitted_step_model(size) if steps else None
        for q_lens, ctx_lens, _, *own in steps:
            shape = StepShape.of(q_lens, ctx_lens, 1)
            if own and shape.is_decode and (predicted := model.predict(shape)) > 0:
                ratios.append(own[0] / predicted)
    return statistics.median(ratios) if ratios else None


def worker_step_factor(pairs: list) -> float | None:
    """The ratio of the medians of [worker seconds, in-process seconds] pairs (a served step by
    the worker's own clock over the same step run in-process seconds later); None without a
    pair of positive times."""
    pairs = [(w, own) for w, own in pairs if w > 0 and own > 0]
    if not pairs:
        return None
    return statistics.median(w for w, _ in pairs) / statistics.median(own for _, own in pairs)


def part_cpu_per_token(costs: ServingCosts, cpu_per_token_s: float) -> float:
    """The share of the host's CPU per token that the simulator puts on a worker of
    `costs.part_cpus` CPUs (as much as it adds back to that worker's steps)."""
    return cpu_per_token_s * costs.part_cpus / costs.cpus


PROMPT_SPAN = 3.0  # `step_factors`: prompt steps this far apart fit a fixed cost and a factor


def _line(x: list[float], y: list[float]) -> tuple[float, float] | None:
    """`y = a + b x` by Theil and Sen's estimator (the median of the slopes between every two
    points, then the median intercept), which a few outliers move little, with `a >= 0` (else
    the median ratio `y / x` through the origin); None if the slope comes out <= 0."""
    pairs = [(x[j], y[j], x[i], y[i]) for i in range(len(x)) for j in range(i)]
    slopes = [(y1 - y0) / (x1 - x0) for x0, y0, x1, y1 in pairs if x1 != x0]
    if not slopes:
        return None
    b = statistics.median(slopes)
    a = statistics.median(yi - b * xi for xi, yi in zip(x, y))
    if a < 0:
        a, b = 0.0, statistics.median(yi / xi for xi, yi in zip(x, y))
    return (a, b) if b > 0 else None


def refit(profile: Profile, *, split_decode: bool = True) -> Profile:
    """`profile` with its step models fitted again to the steps it kept (`samples`), by this
    version's `SplitStepModel.fit`, and its served-step factors and anchors computed again
    against the new models from the steps they kept. Nothing is measured."""
    if profile.kind != "measured" or not profile.samples:
        raise ValueError("only a measured profile that kept its steps can be refitted")
    models, notes = {}, list(profile.notes)
    for size, rows in sorted(profile.samples.items()):
        shapes, seconds = [StepShape.of(q, c, n) for q, c, n, _ in rows], [t for *_, t in rows]
        models[size] = model = SplitStepModel.fit(shapes, seconds, split_decode=split_decode)
        errors = sorted(abs(model.predict(s) / t - 1) for s, t in zip(shapes, seconds))
        wide = f", decode batches of more than {model.wide_rows} apart" * bool(model.wide_decode)
        notes.append(
            f"refitted, {size} thread(s): fit error median {statistics.median(errors):.1%}, "
            f"p90 {errors[int(0.9 * (len(errors) - 1))]:.1%}{wide}"
        )
    anchors = {
        size: Anchor.measure(models[size], a.steps, a.when)
        for size, a in profile.anchors.items() if size in models
    }  # fmt: skip
    if profile.speed:  # its ratios were taken against the old models, and kept no steps
        notes.append("refitted: the speed trace is left out (measure it again: --speed-trace)")
    out = dataclasses.replace(profile, step_models=models, notes=notes, anchors=anchors, speed={})
    served = profile.serving
    if served is not None and served.calibration_steps:
        cpu = served.frontend_cpu_per_token_s + served.client_cpu_per_token_s
        factors = step_factors(served.calibration_steps, out.fitted_step_model(served.cpus), cpu)
        out.serving = served = dataclasses.replace(
            served, **{"prefill_step_overhead_s": 0.0, **factors}
        )
        if served.part_calibration_steps:
            part = step_factors(
                served.part_calibration_steps,
                out.fitted_step_model(served.part_cpus),
                part_cpu_per_token(served, cpu),
            )
            out.serving = dataclasses.replace(
                served, part_decode_step_factor=part.get("decode_step_factor")
            )
    return out


# Assumed transfer paths between workers of a GPU deployment, by the transport that would carry
# them (an analytic profile states them): within a node over NVLink, across nodes over RDMA.
GPU_TRANSFERS = {
    "shm": TransferModel(latency_s=20e-6, bytes_per_s=300e9),  # within a node: NVLink
    "tcp": TransferModel(latency_s=50e-6, bytes_per_s=40e9),  # across nodes: a 400 Gb/s NIC
}


def analytic_profile(
    hf_config: dict,
    device: str,
    *,
    dtype: str = "bfloat16",
    mfu: float = 0.5,
    mbu: float = 0.7,
    overhead_s: float = 0.003,
) -> Profile:
    """A profile of one GPU per worker from its datasheet: a roofline whose compute and bandwidth
    peaks are scaled by `mfu` and `mbu`, plus a fixed overhead per step. Not measured: the
    profile says so, and which factors it assumed."""
    from pdserve.perf.cost import DTYPE_BYTES, ModelShape
    from pdserve.perf.datasheets import datasheet
    from pdserve.planner.step_model import AnalyticStepModel

    sheet = datasheet(device)
    shape = ModelShape.from_hf_config(hf_config, dtype_bytes=DTYPE_BYTES[dtype])
    model = AnalyticStepModel(shape, sheet.peak_flops(dtype), sheet.bandwidth, mfu, mbu, overhead_s)
    return Profile(
        kind="analytic",
        description=f"{hf_config.get('_name_or_path') or 'model'} ({dtype}) on one {sheet.label} "
        "per worker (datasheet)",
        kv_bytes_per_token=shape.kv_bytes_per_token,
        num_layers=shape.num_layers,
        step_models={1: model},
        transfers=dict(GPU_TRANSFERS),
        notes=[
            f"analytic, not measured: {sheet.label} datasheet peaks "
            f"({sheet.peak_flops(dtype) / 1e12:.0f} TFLOP/s {dtype}, "
            f"{sheet.bandwidth / 1e9:.0f} GB/s) at MFU {mfu:.0%} / MBU {mbu:.0%}, "
            f"{overhead_s * 1e3:.1f} ms per step",
            "KV transfers assumed: within a node (--kv-transport shm) NVLink at 300 GB/s, across "
            "nodes (tcp) RDMA at 40 GB/s, per prefill-decode pair",
        ],
    )
