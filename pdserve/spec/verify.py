"""The target model's verdict on one request's proposed tokens: lossless acceptance.

Given the logits of the k + 1 positions a verification step computed (after the request's last
token and after each of its k proposals):

- greedy: the proposals are accepted while they equal the model's argmax; the step emits the
  accepted ones and the model's own token at the first disagreement (or after the last), so the
  output is token for token what one-at-a-time greedy decoding gives;
- sampled: standard speculative rejection sampling, for a proposer that puts all its mass on
  its proposal (prompt lookup): proposal x at position i is kept with probability p_i(x); at
  the first rejection the token is drawn from p_i with x removed (the residual max(p - q, 0)
  normalized), and after k acceptances a bonus token is drawn from p_k. Each emitted token
  then follows the model's distribution `p` (after temperature, top-k, top-p, min-p), the
  distribution plain sampling draws from.
"""

from __future__ import annotations

import torch

from pdserve.runner.sampler import SamplingRow, is_greedy, sampling_probs


def verify(logits: torch.Tensor, proposals: list[int], row: SamplingRow) -> list[int]:
    """logits [k + 1, vocab] for k proposals -> the tokens the step emits (1 to k + 1)."""
    if is_greedy(row.params):
        best = logits.argmax(dim=-1).tolist()
        a = 0
        while a < len(proposals) and proposals[a] == best[a]:
            a += 1
        return proposals[:a] + [best[a]]
    probs = sampling_probs(logits.float(), [row] * logits.shape[0])  # [k + 1, vocab]
    gen = row.generator
    u = torch.rand(len(proposals), generator=gen, device=probs.device).tolist()
    picked = probs[torch.arange(len(proposals)), torch.tensor(proposals)].tolist()
    for i, x in enumerate(proposals):
        if u[i] < picked[i]:
            continue
        residual = probs[i].clone()
        residual[x] = 0.0
        token = torch.multinomial(residual, 1, generator=gen).item()  # normalizes itself
        return proposals[:i] + [token]
    return proposals + [torch.multinomial(probs[-1], 1, generator=gen).item()]
