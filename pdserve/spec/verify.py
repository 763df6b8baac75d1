"""The target model's verdict on one request's proposed tokens: lossless acceptance.

Given the logits of the k + 1 positions a verification step computed (after the request's last
token and after each of its k proposals), each position is first constrained exactly as plain
sampling would constrain it (`Sampler.constrain`: penalties, min_tokens, the grammar's mask,
with the accepted proposals before it counted as output), then:

- greedy: the proposals are accepted while they equal the model's argmax; the step emits the
  accepted ones and the model's own token at the first disagreement (or after the last), so the
  output is token for token what one-at-a-time greedy decoding gives;
- sampled, unseeded: standard speculative rejection sampling. Proposal x at position i, drawn
  by the proposer from q_i, is kept with probability min(1, p_i(x) / q_i(x)); at the first
  rejection the token is drawn from the residual max(p_i - q_i, 0), normalized; after k
  acceptances a bonus token is drawn from p_k. Prompt lookup puts all its mass on its proposal
  (q_i(x) = 1: keep with probability p_i(x), else draw from p_i with x removed); a draft model
  hands in its q. Each emitted token then follows `p` (after temperature, top-k, top-p, min-p),
  the distribution plain sampling draws from;
- sampled with a seed: the token at each position is the one plain sampling would draw there,
  argmax(p_i / e_i) with e_i the request's next Exp(1) draw from its own generator, and a
  proposal is kept while it equals it (a draft model proposes with the same draws, so it agrees
  often). A seeded request's tokens are then the same with or without speculation, whatever
  the batch or the adaptive rule did; the generator advances by one draw per emitted token, as
  plain sampling's does.

Logprobs of the emitted tokens come from the raw logits of their positions, as plain sampling's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pdserve.runner.sampler import (
    Sampler,
    SamplingRow,
    TokenMasks,
    collect,
    exponential_draw,
    is_greedy,
    sampling_probs,
)
from pdserve.types import Verdict


def verify(
    sampler: Sampler,
    logits: torch.Tensor,
    proposals: Sequence[int],
    rows: Sequence[SamplingRow],
    masks: TokenMasks | None = None,
    draft_probs: torch.Tensor | None = None,
) -> Verdict:
    """logits [k + 1, vocab] for k proposals, `rows` the sampling row of each position (its
    output so far including the proposals before it), `masks` the grammar's per position,
    `draft_probs` [k, vocab] the proposer's distributions (None: a point mass on each proposal)
    -> the tokens the step emits (1 to k + 1) and their logprobs."""
    raw = logits.float()
    constrained = sampler.constrain(raw, rows, masks)
    params, k = rows[0].params, len(proposals)
    if is_greedy(params):
        best = constrained.argmax(dim=-1).tolist()
        a = 0
        while a < k and proposals[a] == best[a]:
            a += 1
        tokens = list(proposals[:a]) + [best[a]]
    elif rows[0].generator is not None:
        tokens = _seeded(sampling_probs(constrained, rows), proposals, rows[0].generator)
    else:
        tokens = _rejection(sampling_probs(constrained, rows), proposals, draft_probs)
    e = len(tokens)
    if params.logprobs is None:
        return Verdict(tokens, None)
    out = collect(raw[:e], torch.tensor(tokens, device=raw.device), rows[:e], range(e))
    return Verdict(tokens, out.logprobs)


def _seeded(probs: torch.Tensor, proposals: Sequence[int], gen: torch.Generator) -> list[int]:
    """Position by position, the token plain sampling draws there; stop at the first that is
    not the proposal (or after the last proposal)."""
    tokens = []
    for i in range(len(proposals) + 1):
        noise = exponential_draw(probs.shape[1], gen, probs.device)
        token = int((probs[i] / noise).argmax())
        tokens.append(token)
        if i == len(proposals) or token != proposals[i]:
            break
    return tokens


def _rejection(
    probs: torch.Tensor, proposals: Sequence[int], draft_probs: torch.Tensor | None
) -> list[int]:
    k = len(proposals)
    index = torch.arange(k)
    chosen = torch.tensor(list(proposals))
    p = probs[index, chosen].tolist()
    q = [1.0] * k if draft_probs is None else draft_probs[index, chosen].tolist()
    u = torch.rand(k, device=probs.device).tolist()
    for i, x in enumerate(proposals):
        if u[i] * q[i] < p[i]:  # kept with probability min(1, p / q)
            continue
        if draft_probs is None:
            residual = probs[i].clone()
            residual[x] = 0.0
        else:
            residual = (probs[i] - draft_probs[i]).clamp_min_(0.0)
        if not residual.sum() > 0:  # p == q up to rounding: nothing to correct
            residual = probs[i]
        token = int(torch.multinomial(residual, 1))  # normalizes itself
        return list(proposals[:i]) + [token]
    return list(proposals) + [int(torch.multinomial(probs[-1], 1))]
