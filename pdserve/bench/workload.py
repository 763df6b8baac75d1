"""What the benchmark sends and when: request lengths, arrival times and prompts (no torch here).

`make_specs` turns a `WorkloadConfig` (a random dataset, or a trace read by `traces.py`) into
`RequestSpec`s: when to send each request and how many tokens in and out. `build_prompts` writes
each prompt from units (words, or characters) that are one token each in the target's tokenizer,
then checks the count with that tokenizer, so the server sees the intended input length. Mooncake
hash ids become identical blocks of units, so requests that share leading hash ids share a real
token prefix.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import numpy as np

from pdserve.bench.traces import MOONCAKE_BLOCK_TOKENS, TraceRow

DEFAULT_NUM_REQUESTS = 200
LENGTH_DISTS = ("fixed", "uniform", "lognormal")
_COUNT_BATCH = 256  # prompts per tokenizer call
_ADJUST_ROUNDS = 4  # tries to land a prompt on its exact length when the tokenizer merges words

# Independent random streams, so that changing one knob leaves the others' draws alone.
_STREAM_LENGTHS, _STREAM_ARRIVALS, _STREAM_BLOCKS, _STREAM_FILLER = range(4)


@dataclass(frozen=True)
class WorkloadConfig:
    """The workload, as the `pdserve bench` flags describe it.

    With a trace, lengths (and arrival times, unless `request_rate` is set) come from it; without,
    lengths are drawn around `input_len` / `output_len`. `request_rate` None means the trace's own
    timing, or everything at once for the random dataset.
    """

    num_requests: int | None = None  # None: the whole trace, or DEFAULT_NUM_REQUESTS
    input_len: int = 256
    output_len: int = 128
    length_dist: str = "fixed"
    length_spread: float = 0.5  # uniform: +-fraction of the mean; lognormal: sigma of log
    time_scale: float = 1.0
    length_scale: float = 1.0
    max_input_len: int | None = None
    max_output_len: int | None = None
    request_rate: float | None = None  # requests/s (inf: all at once)
    burstiness: float = 1.0  # gamma shape of the gaps: 1 is Poisson, < 1 burstier
    seed: int = 0

    def __post_init__(self) -> None:
        _positive("num_requests", self.num_requests, allow_none=True)
        _positive("input_len", self.input_len)
        _positive("output_len", self.output_len)
        _positive("max_input_len", self.max_input_len, allow_none=True)
        _positive("max_output_len", self.max_output_len, allow_none=True)
        if self.length_dist not in LENGTH_DISTS:
            raise ValueError(f"length_dist={self.length_dist!r}: must be one of {LENGTH_DISTS}")
        if not (self.length_spread >= 0 and math.isfinite(self.length_spread)):
            raise ValueError(f"length_spread={self.length_spread!r}: must be >= 0")
        if self.length_dist == "uniform" and self.length_spread > 1:
            raise ValueError(f"length_spread={self.length_spread!r}: must be <= 1 for uniform")
        for name in ("time_scale", "length_scale", "burstiness"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{name}={value!r}: must be a finite number > 0")
        if self.request_rate is not None and not self.request_rate > 0:
            raise ValueError(f"request_rate={self.request_rate!r}: must be > 0 (or inf)")

    @property
    def block_tokens(self) -> int:
        """Tokens per Mooncake hash block after `length_scale`."""
        return max(1, round(MOONCAKE_BLOCK_TOKENS * self.length_scale))


def _positive(name: str, value: int | None, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r}: must be an integer >= 1")


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One request before its prompt is written: when to send it and its lengths in tokens."""

    index: int
    send_at_s: float  # offset from the start of the run
    input_len: int  # prompt tokens as the server counts them (special tokens included)
    output_len: int  # max_tokens (forced with ignore_eos / min_tokens)
    hash_ids: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class BenchRequest:
    """A request ready to send. `prompt_len` is the prompt's length counted with the tokenizer."""

    index: int
    send_at_s: float
    input_len: int
    output_len: int
    prompt: str
    prompt_len: int


def make_specs(cfg: WorkloadConfig, trace: Sequence[TraceRow] | None = None) -> list[RequestSpec]:
    """Lengths and send times of every request (trace rows in order, or random draws)."""
    if trace is not None:
        rows = trace[: cfg.num_requests] if cfg.num_requests else trace
        inputs = [_scale(r.input_len, cfg.length_scale, cfg.max_input_len) for r in rows]
        outputs = [_scale(r.output_len, cfg.length_scale, cfg.max_output_len) for r in rows]
        hash_ids = [r.hash_ids for r in rows]
        if cfg.request_rate is None:
            send_at = [r.timestamp_s * cfg.time_scale for r in rows]
        else:
            send_at = arrival_offsets(len(rows), cfg.request_rate, cfg.burstiness, cfg.seed)
    else:
        n = cfg.num_requests or DEFAULT_NUM_REQUESTS
        rng = np.random.default_rng([cfg.seed, _STREAM_LENGTHS])
        inputs = sample_lengths(n, cfg.input_len, cfg.length_dist, cfg.length_spread, rng)
        outputs = sample_lengths(n, cfg.output_len, cfg.length_dist, cfg.length_spread, rng)
        inputs = [_clip(x, cfg.max_input_len) for x in inputs]
        outputs = [_clip(x, cfg.max_output_len) for x in outputs]
        hash_ids = [()] * n
        rate = math.inf if cfg.request_rate is None else cfg.request_rate
        send_at = arrival_offsets(n, rate, cfg.burstiness, cfg.seed)
    return [
        RequestSpec(i, float(t), int(a), int(b), tuple(h))
        for i, (t, a, b, h) in enumerate(zip(send_at, inputs, outputs, hash_ids))
    ]


def _scale(length: int, scale: float, limit: int | None) -> int:
    return _clip(max(1, round(length * scale)), limit)


def _clip(length: int, limit: int | None) -> int:
    return int(length) if limit is None else min(int(length), limit)


def sample_lengths(
    n: int, mean: int, dist: str, spread: float, rng: np.random.Generator
) -> list[int]:
    """`n` lengths >= 1 with the given mean: fixed, uniform in mean*(1 +- spread), or lognormal
    with sigma `spread` (its mean, not its median, is `mean`)."""
    if dist == "fixed":
        values = np.full(n, float(mean))
    elif dist == "uniform":
        lo, hi = round(mean * (1 - spread)), round(mean * (1 + spread))
        values = rng.integers(lo, hi + 1, size=n).astype(float)
    elif dist == "lognormal":
        mu = math.log(mean) - spread**2 / 2
        values = rng.lognormal(mu, spread, size=n)
    else:
        raise ValueError(f"length_dist={dist!r}: must be one of {LENGTH_DISTS}")
    return [max(1, round(v)) for v in values]


def arrival_offsets(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Send times (s) for `n` requests at `rate` req/s: gamma-distributed gaps with shape
    `burstiness` (1: a Poisson process) and mean 1/rate; the first request goes at 0."""
    if n == 0:
        return []
    if math.isinf(rate):
        return [0.0] * n
    rng = np.random.default_rng([seed, _STREAM_ARRIVALS])
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n - 1)
    return [0.0, *np.cumsum(gaps).tolist()]


def with_rate(
    requests: Sequence[BenchRequest], rate: float, burstiness: float, seed: int
) -> list[BenchRequest]:
    """The same requests (same prompts) sent at `rate` instead of their own times."""
    offsets = arrival_offsets(len(requests), rate, burstiness, seed)
    return [replace(r, send_at_s=t) for r, t in zip(requests, offsets)]


class PromptTokenizer(Protocol):
    """What prompt construction needs from the target's tokenizer (see `bench/tokenizer.py`)."""

    words: Sequence[str]  # units that are one token each wherever they stand in a prompt
    separator: str  # what joins them: " " for words, "" for characters

    def count(self, prompts: list[str]) -> list[int]:
        """Tokens the server will see for each prompt (special and template tokens included)."""
        ...


def build_prompts(
    specs: Sequence[RequestSpec],
    tokenizer: PromptTokenizer,
    seed: int = 0,
    block_tokens: int = MOONCAKE_BLOCK_TOKENS,
) -> list[BenchRequest]:
    """Write each spec's prompt so that it counts `input_len` tokens.

    A prompt is one-token units (words, or characters) joined by `tokenizer.separator`. Block j
    of a request with hash ids is drawn from (seed, hash_ids[j]) alone, so equal leading ids give
    equal leading text; the rest is drawn from (seed, index). Lengths are then checked with the
    tokenizer and nudged at the end.
    """
    words = list(tokenizer.words)
    if not words:
        raise ValueError("the tokenizer has no single-token words to build prompts from")
    overhead = max(0, tokenizer.count([words[0]])[0] - 1)  # BOS, chat template...
    word_ids = [
        _word_ids(spec, max(1, spec.input_len - overhead), block_tokens, seed, len(words))
        for spec in specs
    ]
    sep = tokenizer.separator
    counts = _count_all(tokenizer, [_join(words, ids, sep) for ids in word_ids])
    for _ in range(_ADJUST_ROUNDS):
        off = [i for i, s in enumerate(specs) if counts[i] != s.input_len and len(word_ids[i]) > 1]
        if not off:
            break
        for i in off:
            excess = counts[i] - specs[i].input_len
            word_ids[i] = _nudge(word_ids[i], seed, specs[i].index, excess, len(words))
        for i, c in zip(off, _count_all(tokenizer, [_join(words, word_ids[i], sep) for i in off])):
            counts[i] = c
    return [
        BenchRequest(s.index, s.send_at_s, s.input_len, s.output_len, _join(words, ids, sep), n)
        for s, ids, n in zip(specs, word_ids, counts)
    ]


def _word_ids(
    spec: RequestSpec, num_words: int, block_tokens: int, seed: int, vocab: int
) -> np.ndarray:
    parts = []
    for j, hash_id in enumerate(spec.hash_ids):
        start = j * block_tokens
        if start >= num_words:
            break
        parts.append(_block(seed, hash_id, block_tokens, vocab)[: num_words - start])
    rest = num_words - sum(len(p) for p in parts)
    if rest > 0:
        parts.append(_filler(seed, spec.index, vocab, rest))
    return np.concatenate(parts)


@functools.lru_cache(maxsize=8192)
def _block(seed: int, hash_id: int, block_tokens: int, vocab: int) -> np.ndarray:
    rng = np.random.default_rng([seed, _STREAM_BLOCKS, hash_id & 0xFFFF_FFFF_FFFF_FFFF])
    block = rng.integers(0, vocab, size=block_tokens)
    block.flags.writeable = False  # shared by every request that names this hash id
    return block


def _filler(seed: int, index: int, vocab: int, size: int, salt: int = 0) -> np.ndarray:
    return np.random.default_rng([seed, _STREAM_FILLER, index, salt]).integers(0, vocab, size)


def _nudge(ids: np.ndarray, seed: int, index: int, excess: int, vocab: int) -> np.ndarray:
    """Drop `excess` words from the end of a prompt (or append -excess words)."""
    if excess > 0:
        return ids[: max(1, len(ids) - excess)]
    return np.concatenate([ids, _filler(seed, index, vocab, -excess, salt=1 + len(ids))])


def _join(words: Sequence[str], ids: np.ndarray, separator: str) -> str:
    return separator.join([words[i] for i in ids.tolist()])


def _count_all(tokenizer: PromptTokenizer, prompts: list[str]) -> list[int]:
    counts: list[int] = []
    for start in range(0, len(prompts), _COUNT_BATCH):
        counts.extend(tokenizer.count(prompts[start : start + _COUNT_BATCH]))
    return counts
