"""Turns one step's logits into token ids (and optional logprobs): one logits row per sampling request.

Order per row: penalties, min_tokens masking, the grammar's token mask, then argmax for greedy rows, or temperature, top-k,
top-p, min-p and an exponential race (argmax(probs / q), q ~ Exp(1)) for the others. A seeded row
draws its noise from its own generator, exactly one [vocab] draw per step, so its tokens do not
depend on the rest of the batch. Logprobs are taken from the raw logits handed in (before
penalties, temperature and truncation). One host sync per call, for all results together.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain

import torch

from pdserve.structured.matcher import apply_bitmask
from pdserve.types import Logprob, SamplingParams


@dataclass(slots=True)
class SamplingRow:
    """One row of the logits matrix: one request that samples a token this step.

    `generator` is not None iff `params.seed` is not None; the runner creates it once per request
    on the logits' device, seeds it with `params.seed` and keeps it for the request's lifetime.
    """

    params: SamplingParams
    generator: torch.Generator | None
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]  # tokens generated so far, before this step


@dataclass(slots=True)
class TokenMasks:
    """Rows constrained by a grammar and, per such row, the tokens it allows (a bitmask)."""

    row_indices: list[int]
    bitmask: torch.Tensor  # [len(row_indices), ceil(vocab / 32)] int32


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]  # one per row
    logprobs: list[Logprob | None]  # one per row; None where params.logprobs is None


def is_greedy(params: SamplingParams) -> bool:
    return params.is_greedy


def plain_greedy(row: SamplingRow) -> bool:
    """Whether the row's token is the argmax of its raw logits: greedy, no logprobs, no
    penalties or grammar, and past min_tokens (no ban on its stop tokens); the scheduler's
    bursts ask the same of every step (`SamplingParams.takes_raw_argmax`)."""
    return row.params.takes_raw_argmax(len(row.output_token_ids))


class Sampler:
    """Samples one token per row of `logits` ([num_rows, vocab], float32, any device)."""

    def __init__(self, eos_token_ids: Sequence[int]):
        self.eos_token_ids = tuple(eos_token_ids)

    def __call__(
        self,
        logits: torch.Tensor,
        rows: Sequence[SamplingRow],
        masks: TokenMasks | None = None,
    ) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(
                f"logits of shape {tuple(logits.shape)} do not match {len(rows)} sampling rows"
            )
        if masks is None and all(map(plain_greedy, rows)):
            # the common decode step: few Python calls, since each runs with cold caches
            # after the weights streamed (docs/PERFORMANCE.md, "Decode at the roofline")
            return SamplerOutput(logits.argmax(dim=-1).tolist(), [None] * len(rows))
        raw_logits = logits.float()  # no copy for float32; never modified in place
        random_rows = [i for i, r in enumerate(rows) if not is_greedy(r.params)]
        logprob_rows = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        logits = self.constrain(raw_logits, rows, masks)
        if logits is raw_logits and not (random_rows or logprob_rows):
            return SamplerOutput(raw_logits.argmax(dim=-1).tolist(), [None] * len(rows))

        if len(random_rows) == len(rows):
            token_ids = _sample_random(logits, rows)  # [num_rows]
        else:
            token_ids = logits.argmax(dim=-1)  # [num_rows]
            if random_rows:
                index = torch.tensor(random_rows, device=logits.device)
                sampled = _sample_random(logits[index], [rows[i] for i in random_rows])
                token_ids[index] = sampled
        return collect(raw_logits, token_ids, rows, logprob_rows)

    def constrain(
        self,
        raw_logits: torch.Tensor,
        rows: Sequence[SamplingRow],
        masks: TokenMasks | None = None,
    ) -> torch.Tensor:
        """`raw_logits` ([num_rows, vocab] float32) after each row's penalties, min_tokens ban
        and grammar mask: `raw_logits` itself where no row has any, else a new tensor. A
        constraint added here belongs in `plain_greedy` too (the rows that skip this)."""
        penalty_rows = [i for i, r in enumerate(rows) if r.params.has_penalties]
        # A grammar decides when its row may end: min_tokens does not ban EOS there.
        constrained = set(masks.row_indices) if masks is not None else set()
        banned_rows, banned_ids = self._min_tokens_bans(rows, raw_logits.shape[1], constrained)
        logits = raw_logits
        if penalty_rows:
            logits = apply_penalties(logits, rows, penalty_rows)
        if banned_rows:
            if logits is raw_logits:
                logits = logits.clone()
            index = torch.tensor([banned_rows, banned_ids], device=logits.device)  # [2, num_bans]
            logits[index[0], index[1]] = float("-inf")
        if masks is not None:
            if logits is raw_logits:
                logits = logits.clone()
            index = torch.tensor(masks.row_indices, device=logits.device)
            logits[index] = apply_bitmask(logits[index], masks.bitmask)
        return logits

    def _min_tokens_bans(
        self, rows: Sequence[SamplingRow], vocab_size: int, skip: set[int]
    ) -> tuple[list[int], list[int]]:
        """(row, token) pairs to mask to -inf: EOS and stop ids of rows still below min_tokens."""
        banned_rows: list[int] = []
        banned_ids: list[int] = []
        for i, row in enumerate(rows):
            params = row.params
            if len(row.output_token_ids) >= params.min_tokens or i in skip:
                continue
            eos = () if params.ignore_eos else self.eos_token_ids
            for token_id in {*eos, *params.stop_token_ids}:
                if token_id < vocab_size:
                    banned_rows.append(i)
                    banned_ids.append(token_id)
        return banned_rows, banned_ids


def apply_penalties(
    logits: torch.Tensor, rows: Sequence[SamplingRow], row_indices: Sequence[int]
) -> torch.Tensor:
    """Returns a copy of `logits` with penalties applied to the rows at `row_indices`.

    Repetition penalty (HF): logits of tokens seen in the prompt or the output are divided by it
    when positive and multiplied by it when negative. Then, over output tokens only (OpenAI):
    logit -= frequency_penalty * count + presence_penalty * (count > 0).
    """
    device, vocab_size = logits.device, logits.shape[1]
    index = torch.tensor(row_indices, device=device)
    picked = [rows[i] for i in row_indices]
    penalties = torch.tensor(
        [
            [r.params.repetition_penalty, r.params.frequency_penalty, r.params.presence_penalty]
            for r in picked
        ],
        dtype=torch.float32,
        device=device,
    )  # [num_picked, 3]
    repetition, frequency, presence = penalties.unsqueeze(-1).unbind(dim=1)  # each [num_picked, 1]

    sub = logits[index]  # [num_picked, vocab]
    output_counts = _token_counts([r.output_token_ids for r in picked], vocab_size, device)
    if any(r.params.repetition_penalty != 1.0 for r in picked):
        prompts = [r.prompt_token_ids if r.params.repetition_penalty != 1.0 else () for r in picked]
        seen = (_token_counts(prompts, vocab_size, device) > 0) | (output_counts > 0)
        penalized = torch.where(sub > 0, sub / repetition, sub * repetition)
        sub = torch.where(seen, penalized, sub)
    sub = sub - frequency * output_counts - presence * (output_counts > 0)

    out = logits.clone()
    out[index] = sub
    return out


def _token_counts(
    token_ids: Sequence[Sequence[int]], vocab_size: int, device: torch.device
) -> torch.Tensor:
    """How often each token occurs in each sequence: [len(token_ids), vocab] float32."""
    counts = torch.zeros(len(token_ids), vocab_size, device=device)
    flat = list(chain.from_iterable(token_ids))
    if not flat:
        return counts
    lengths = torch.tensor([len(seq) for seq in token_ids])
    seq_index = torch.repeat_interleave(torch.arange(len(token_ids)), lengths)  # [num_flat]
    index = torch.stack([seq_index, torch.tensor(flat)]).to(device)  # [2, num_flat]
    ones = torch.ones(len(flat), device=device)
    counts.index_put_((index[0], index[1]), ones, accumulate=True)
    return counts


def sampling_probs(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """The distribution each non-greedy row samples from ([num_rows, vocab]): temperature, then
    top-k and top-p, then min-p, then softmax."""
    vocab_size = logits.shape[1]
    params = torch.tensor(
        [
            [
                r.params.temperature,
                r.params.top_k if 0 < r.params.top_k < vocab_size else vocab_size,
                r.params.top_p,
                r.params.min_p,
            ]
            for r in rows
        ],
        dtype=torch.float32,
        device=logits.device,
    )  # [num_rows, 4]
    temperature, top_k, top_p, min_p = params.unsqueeze(-1).unbind(dim=1)  # each [num_rows, 1]

    logits = logits / temperature
    if any(0 < r.params.top_k < vocab_size or r.params.top_p < 1.0 for r in rows):
        logits = _apply_top_k_top_p(logits, top_k, top_p)
    if any(r.params.min_p > 0.0 for r in rows):
        logits = _apply_min_p(logits, min_p)
    return logits.softmax(dim=-1)  # [num_rows, vocab]


def _sample_random(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Samples one token per row of `logits` ([num_rows, vocab]), all rows non-greedy."""
    probs = sampling_probs(logits, rows)
    noise = _exponential_noise(probs, rows)
    return probs.div_(noise).argmax(dim=-1)


def _apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Keeps the top_k largest logits, then the smallest prefix whose mass reaches top_p.

    top_k and top_p are [num_rows, 1]; top_k == vocab and top_p == 1 disable them. The top token
    is always kept: the mass before it is 0 < top_p.
    """
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True)  # [num_rows, vocab] each
    positions = torch.arange(logits.shape[1], device=logits.device)  # [vocab]
    sorted_logits = sorted_logits.masked_fill(positions >= top_k, float("-inf"))
    sorted_probs = sorted_logits.softmax(dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # [num_rows, vocab]
    # top_p == 1 must keep everything even when float32 rounding lets mass_before exceed 1.
    outside_nucleus = (mass_before >= top_p) & (top_p < 1.0)
    sorted_logits = sorted_logits.masked_fill(outside_nucleus, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, sorted_ids, sorted_logits)


def _apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drops tokens whose probability is below min_p ([num_rows, 1]) times the row's maximum."""
    probs = logits.softmax(dim=-1)  # [num_rows, vocab]
    threshold = probs.amax(dim=-1, keepdim=True) * min_p  # [num_rows, 1]
    return logits.masked_fill(probs < threshold, float("-inf"))


def exponential_draw(
    vocab_size: int, generator: torch.Generator, device: torch.device
) -> torch.Tensor:
    """A seeded row's Exp(1) noise for one token: [vocab] float32, one draw of its generator."""
    noise = torch.empty(vocab_size, device=device).exponential_(generator=generator)
    # A zero draw would turn a zero probability into 0/0 = nan, which argmax would pick.
    return noise.clamp_min_(torch.finfo(noise.dtype).tiny)


def _exponential_noise(probs: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Exp(1) noise like `probs`: seeded rows from their own generator, the rest in one draw."""
    noise = torch.empty_like(probs)  # [num_rows, vocab]
    if any(r.generator is None for r in rows):
        noise.exponential_().clamp_min_(torch.finfo(noise.dtype).tiny)
    for i, row in enumerate(rows):
        if row.generator is not None:
            noise[i] = exponential_draw(probs.shape[1], row.generator, probs.device)
        elif row.params.seed is not None:
            raise ValueError(f"sampling row {i} has seed={row.params.seed} but no generator")
    return noise


def collect(
    raw_logits: torch.Tensor,
    token_ids: torch.Tensor,
    rows: Sequence[SamplingRow],
    logprob_rows: Sequence[int],
) -> SamplerOutput:
    """Moves token ids and logprobs to the host in one sync (as float64, exact for ids < 2**53)."""
    num_rows = len(rows)
    parts = [token_ids.double()]  # [num_rows]
    max_top = 0
    if logprob_rows:
        index = torch.tensor(logprob_rows, device=raw_logits.device)
        logprobs = raw_logits[index].log_softmax(dim=-1)  # [num_logprob_rows, vocab]
        sampled = logprobs.gather(-1, token_ids[index].unsqueeze(-1)).squeeze(-1)
        max_top = min(max(rows[i].params.logprobs or 0 for i in logprob_rows), logprobs.shape[1])
        top_values, top_ids = logprobs.topk(max_top, dim=-1)  # [num_logprob_rows, max_top] each
        parts += [sampled.double(), top_values.double().flatten(), top_ids.double().flatten()]
    values = torch.cat(parts).tolist()  # the host sync

    ids = [int(v) for v in values[:num_rows]]
    out_logprobs: list[Logprob | None] = [None] * num_rows
    num_lp = len(logprob_rows)
    sampled_lps = values[num_rows : num_rows + num_lp]
    top_values_flat = values[num_rows + num_lp : num_rows + num_lp + num_lp * max_top]
    top_ids_flat = values[num_rows + num_lp + num_lp * max_top :]
    for j, i in enumerate(logprob_rows):
        k = rows[i].params.logprobs or 0
        start = j * max_top
        top = [
            (int(top_ids_flat[start + t]), top_values_flat[start + t])
            for t in range(min(k, max_top))
        ]
        out_logprobs[i] = Logprob(token_id=ids[i], logprob=sampled_lps[j], top=top)
    return SamplerOutput(ids, out_logprobs)
