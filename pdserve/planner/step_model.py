"""How long one engine step takes, from what the step computes (no torch).

A step is described by its `StepShape`: the new tokens and the context of every scheduled
sequence, and how many of them sample. These models turn a shape into seconds:

- `LinearStepModel`, fitted to steps measured on this machine (`pdserve profile`):

      t = overhead + per_token * T + per_pair * A + per_kv_token * K + per_sample * S
          + per_padded_kv_token * P

  with T the tokens computed, A the (query, key) pairs attended (`perf.cost.attention_pairs`),
  K the context tokens read from the KV cache, S the rows that sample and P the decode batch's
  padded context: its decodes times the longest of their contexts (the paged SDPA backend
  gathers every decode's context into one padded batch, so one long context makes every decode
  of the step pay for its length). On a CPU the overhead is mostly the weights read once per
  step (decode is bandwidth-bound), T the matrix products' work, A, K and P the attention's.
  Coefficients are fitted by least squares and kept >= 0.
- `SplitStepModel`, what `pdserve profile` fits: one `LinearStepModel` for decode-only steps
  and one for steps with prompt tokens; and, where the measured steps call for it, a third for
  decode batches wider than `wide_rows` sequences (a kernel that multiplies a few rows in one
  pass over the weights changes its method past its register tile, and the step time with it).
- `AnalyticStepModel`, for hardware that is not here: the step's FLOPs and bytes
  (`perf.cost.step_cost`) against datasheet peaks scaled by efficiency factors, plus a fixed
  overhead: `t = overhead + max(flops / (peak * mfu), bytes / (bandwidth * mbu))`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

from pdserve.perf.cost import ModelShape, attention_pairs, step_cost

TERMS = ("overhead", "per_token", "per_pair", "per_kv_token", "per_sample", "per_padded_kv_token")


@dataclass(frozen=True)
class StepShape:
    """What one step computes: sequence j computes q_lens[j] new tokens and holds ctx_lens[j]
    tokens after the step; `num_sampled` rows sample."""

    q_lens: tuple[int, ...]
    ctx_lens: tuple[int, ...]
    num_sampled: int

    @classmethod
    def of(cls, q_lens: Sequence[int], ctx_lens: Sequence[int], num_sampled: int) -> StepShape:
        return cls(tuple(q_lens), tuple(ctx_lens), num_sampled)

    @property
    def num_tokens(self) -> int:
        return sum(self.q_lens)

    @property
    def is_decode(self) -> bool:
        """Every sequence computes one token (a decode-only step)."""
        return all(q == 1 for q in self.q_lens)

    def features(self) -> np.ndarray:
        """The linear model's regressors, in `TERMS` order."""
        pairs = sum(attention_pairs(q, c) for q, c in zip(self.q_lens, self.ctx_lens))
        decode_ctx = [c for q, c in zip(self.q_lens, self.ctx_lens) if q == 1]
        padded = len(decode_ctx) * max(decode_ctx, default=0)
        return np.array(
            [1.0, self.num_tokens, pairs, sum(self.ctx_lens), self.num_sampled, padded],
            dtype=np.float64,
        )


@dataclass(frozen=True)
class LinearStepModel:
    """Seconds per unit of each term of `TERMS` (see the module docstring)."""

    overhead: float
    per_token: float
    per_pair: float
    per_kv_token: float
    per_sample: float
    per_padded_kv_token: float = 0.0  # profiles measured before this term was added lack it

    def predict(self, shape: StepShape) -> float:
        return float(np.dot(self.coefficients, shape.features()))

    @property
    def coefficients(self) -> np.ndarray:
        return np.array([getattr(self, t) for t in TERMS], dtype=np.float64)

    @classmethod
    def fit(cls, shapes: Sequence[StepShape], seconds: Sequence[float]) -> LinearStepModel:
        """Least squares on relative error (each step weighs by 1/t, so a 5 ms decode step
        counts as much as a 2 s prefill), with every coefficient kept >= 0: a term that comes
        out negative is dropped and the rest refitted."""
        if len(shapes) != len(seconds) or not shapes:
            raise ValueError("fit needs one measured time per step shape, and at least one")
        x = np.stack([s.features() for s in shapes])
        y = np.asarray(seconds, dtype=np.float64)
        if (y <= 0).any():
            raise ValueError("step times must be > 0")
        w = 1.0 / y
        active = list(range(len(TERMS)))
        while True:
            coef, *_ = np.linalg.lstsq(x[:, active] * w[:, None], y * w, rcond=None)
            if (coef >= 0).all() or len(active) == 1:
                break
            del active[int(np.argmin(coef))]
        full = np.zeros(len(TERMS))
        full[active] = np.maximum(coef, 0.0)
        return cls(*full.tolist())

    def to_dict(self) -> dict:
        return {"kind": "linear", **asdict(self)}


@dataclass(frozen=True)
class AnalyticStepModel:
    """A roofline with efficiency factors (datasheet hardware)."""

    shape: ModelShape
    peak_flops: float  # FLOP/s of the step's dtype
    bandwidth: float  # bytes/s
    mfu: float = 0.5  # the share of peak FLOP/s a compute-bound step reaches
    mbu: float = 0.7  # the share of peak bandwidth a bandwidth-bound step reaches
    overhead: float = 0.003  # seconds of launch and scheduling per step

    def predict(self, shape: StepShape) -> float:
        cost = step_cost(self.shape, shape.q_lens, shape.ctx_lens, shape.num_sampled)
        compute = cost.flops / (self.peak_flops * self.mfu)
        memory = cost.total_bytes / (self.bandwidth * self.mbu)
        return self.overhead + max(compute, memory)

    def to_dict(self) -> dict:
        d = asdict(self)
        return {"kind": "analytic", **d}


@dataclass(frozen=True)
class SplitStepModel:
    """Linear models by kind of step: one for decode-only steps (every sequence computes one
    token), one for steps with prompt tokens. A decode step's matrix products have a handful of
    rows, where a kernel's cost per row is far from what it is in a prefill's hundreds: one line
    through both misses the decode steps that serving is mostly made of. Decode batches of more
    than `wide_rows` sequences take `wide_decode` when there is one: a product over a few rows
    streams the weights once at a cost that hardly grows with the rows, and past the kernel's
    tile of rows it works another way (llama-125m in float32 on 2 cores of a Zen 4: 1 to 6
    sequences at 65-75 tokens of context took 10-13 ms a step, 8 sequences 27-29 ms)."""

    decode: LinearStepModel
    prefill: LinearStepModel  # prefill and mixed steps
    wide_decode: LinearStepModel | None = None  # decode batches of more than `wide_rows`
    wide_rows: int = 0

    # `fit` splits the decode steps only where that cuts their squared relative error by this
    # share at least: a split always fits the measured steps a little better, noise included.
    MIN_SPLIT_GAIN = 0.25

    def predict(self, shape: StepShape) -> float:
        return self._model_for(shape).predict(shape)

    def _model_for(self, shape: StepShape) -> LinearStepModel:
        if not shape.is_decode:
            return self.prefill
        if self.wide_decode is not None and len(shape.q_lens) > self.wide_rows:
            return self.wide_decode
        return self.decode

    @classmethod
    def fit(
        cls, shapes: Sequence[StepShape], seconds: Sequence[float], *, split_decode: bool = True
    ) -> SplitStepModel:
        """Each kind fitted on its own steps (`LinearStepModel.fit`); a kind with no step of
        its own takes the fit of all of them. With `split_decode`, the decode steps are also
        tried split at every batch size that leaves at least three batch sizes on either side,
        and the best split is kept if it fits them `MIN_SPLIT_GAIN` better than one line."""
        pairs = list(zip(shapes, seconds))
        both = LinearStepModel.fit(shapes, seconds)

        def fit(chosen):
            if not chosen:
                return both
            return LinearStepModel.fit([s for s, _ in chosen], [t for _, t in chosen])

        decodes = [p for p in pairs if p[0].is_decode]
        prefill = fit([p for p in pairs if not p[0].is_decode])
        one = fit(decodes)
        if not split_decode:
            return cls(one, prefill)
        best, best_error = None, _squared_error(one, decodes)
        sizes = sorted({len(s.q_lens) for s, _ in decodes})
        for rows in sizes[2:-3]:  # three sizes at least on each side
            narrow = [p for p in decodes if len(p[0].q_lens) <= rows]
            wide = [p for p in decodes if len(p[0].q_lens) > rows]
            models = fit(narrow), fit(wide)
            error = _squared_error(models[0], narrow) + _squared_error(models[1], wide)
            if error < best_error:
                best, best_error = (rows, *models), error
        if best is None or best_error > (1 - cls.MIN_SPLIT_GAIN) * _squared_error(one, decodes):
            return cls(one, prefill)
        rows, narrow_model, wide_model = best
        return cls(narrow_model, prefill, wide_model, rows)

    def to_dict(self) -> dict:
        d = {"kind": "split", "decode": self.decode.to_dict(), "prefill": self.prefill.to_dict()}
        if self.wide_decode is not None:
            d.update(wide_decode=self.wide_decode.to_dict(), wide_rows=self.wide_rows)
        return d


def _squared_error(model: LinearStepModel, pairs: Sequence[tuple[StepShape, float]]) -> float:
    """The sum of squared relative errors (`LinearStepModel.fit`'s objective)."""
    return sum((model.predict(s) / t - 1) ** 2 for s, t in pairs)


@dataclass(frozen=True)
class ScaledStepModel:
    """A fitted model whose decode-only steps and steps with prompt tokens are each scaled by a
    factor: the same machine measured at another moment (`planner.profile.Anchor`)."""

    base: LinearStepModel | SplitStepModel
    decode: float
    prefill: float

    def predict(self, shape: StepShape) -> float:
        return self.base.predict(shape) * (self.decode if shape.is_decode else self.prefill)


StepModel = LinearStepModel | SplitStepModel | AnalyticStepModel | ScaledStepModel


def step_model_from_dict(d: dict) -> StepModel:
    d = dict(d)
    kind = d.pop("kind")
    if kind == "linear":
        return LinearStepModel(**{t: float(d.get(t, 0.0)) for t in TERMS})
    if kind == "split":
        wide = d.get("wide_decode")  # profiles fitted before the split lack it
        return SplitStepModel(
            step_model_from_dict(d["decode"]),
            step_model_from_dict(d["prefill"]),
            None if wide is None else step_model_from_dict(wide),
            int(d.get("wide_rows", 0)),
        )
    if kind == "analytic":
        return AnalyticStepModel(ModelShape(**d.pop("shape")), **d)
    raise ValueError(f"unknown step model kind {kind!r}")


# `StepNoise`: steps with at most this many prompt tokens form a kind of their own (a prompt's
# last few tokens over a cached prefix, a conversation's next turn): a short step's time scatters
# more, relative to itself, than a long prefill's
SHORT_PROMPT_TOKENS = 64


def noise_kind(shape: StepShape) -> str:
    """`StepNoise`'s kind of a step: "decode", "short" (a few prompt tokens) or "prompt"."""
    if shape.is_decode:
        return "decode"
    prompt = sum(q for q in shape.q_lens if q > 1)
    return "short" if prompt <= SHORT_PROMPT_TOKENS else "prompt"


@dataclass(frozen=True)
class StepNoise:
    """How far a measured step's time lies from its model's, by kind of step (`noise_kind`): the
    ratio measured / predicted of every step a profile measured, so that a simulated step can
    take a ratio drawn from them (a bootstrap of the fit's residuals) instead of always the
    model's time. A machine's steps scatter (llama-125m's decode steps on 2 cores of a Zen 4
    measured 0.9x-1.2x their fit for 80% of them, up to 2.3x), and a percentile that rests on a
    few short steps (the TTFTs of prompts that hit the prefix cache) follows their scatter, not
    their centre. `ratios`: by kind, sorted; a kind with no measured step takes the others'."""

    ratios: dict[str, tuple[float, ...]]

    @classmethod
    def fit(cls, model: StepModel, rows: Sequence) -> StepNoise | None:
        """From a profile's kept steps (`[q_lens, ctx_lens, num_sampled, seconds]` each) and the
        model fitted to them; None without steps."""
        by_kind: dict[str, list[float]] = {}
        for q_lens, ctx_lens, num_sampled, seconds in rows:
            shape = StepShape.of(q_lens, ctx_lens, num_sampled)
            if (predicted := model.predict(shape)) > 0:
                by_kind.setdefault(noise_kind(shape), []).append(seconds / predicted)
        if not by_kind:
            return None
        every = sorted(r for ratios in by_kind.values() for r in ratios)
        return cls({
            kind: tuple(sorted(by_kind.get(kind, every)))
            for kind in ("decode", "short", "prompt")
        })  # fmt: skip

    def draw(self, shape: StepShape, rng, num_steps: int = 1) -> float:
        """A factor for one step of `shape` (`rng`: a `random.Random`); for a burst of
        `num_steps` decode steps the mean of as many draws."""
        ratios = self.ratios[noise_kind(shape)]
        return sum(rng.choice(ratios) for _ in range(num_steps)) / num_steps
