"""A draft model's proposals (`--speculative-method draft`): k tokens for each speculating
request, made at the start of the step by a smaller model over the request's paged blocks.

Two drafts:

- self-speculation (`--draft-layers N`): the target's own first N layers, then its final norm
  and output head. Their keys and values are the target's in those layers (the same weights
  over the same tokens), so the draft reads and writes the target's caches of layers 0..N-1 and
  never has anything to catch up: the target computes them for every token.
- a draft model (`--draft-model DIR`, same vocabulary): its own weights and its own KV cache,
  one slot per slot of the target's, addressed through the same block tables. It fills a
  request's cache lazily: a request's first pass feeds every token the draft has not seen yet
  (the whole prompt on its first speculative step, after that the one or two tokens the last
  verification added). What the draft holds only ever shapes a guess: stale draft KV (of a
  block another request reused) costs acceptance, never correctness, since the target verifies
  every token; a preemption restarts the request's draft cache all the same.

A step's drafting is k passes over the speculating requests: the first as a mixed step (decode
rows, and the catch-up chunks), the others as decode steps (the fused decode step where the
draft has one); each pass takes one row of logits per request and one token from it: greedy,
the argmax; sampled with a seed, argmax(q / e) with the request's next Exp(1) draws (peeked, the
generator is restored: verification draws the same ones, so draft and target agree where q and
p do); sampled without a seed, a draw from q, which verification's rejection test then needs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from pdserve.runner.sampler import SamplingRow, exponential_draw, is_greedy, sampling_probs
from pdserve.sched.scheduler import ScheduledRequest
from pdserve.spec.proposer import SpecState

# (block table, position of the first token, tokens) per run -> the step's inputs
Layout = Callable[[list[tuple[list[int], int, list[int]]]], tuple]


class Drafter:
    """Fills the `DRAFT` placeholders of a step's speculating requests (`propose`)."""

    def __init__(
        self, model: nn.Module, kv_caches: list[torch.Tensor], layout: Layout, shared: bool
    ) -> None:
        self.model = model  # runs len(kv_caches) layers (all of a draft model's)
        self.vocab_size = model.config.vocab_size
        self.device = kv_caches[0].device
        self.kv_caches = kv_caches
        self.layout = layout
        self.shared = shared  # the caches are the target's: nothing to catch up
        self.name = f"{len(kv_caches)} layers of the target" if shared else "draft model"

    def propose(
        self,
        items: Sequence[ScheduledRequest],
        block_tables: dict[str, list[int]],
        rows: Sequence[SamplingRow],
    ) -> list[torch.Tensor | None]:
        """Replace each item's proposals by the draft's; per item, the draft's distributions
        [k, vocab] where verification needs them (sampled without a seed), else None."""
        ks = [len(item.spec_tokens) for item in items]
        tables = [block_tables[item.request.request_id] for item in items]
        noise = [self._peek_noise(row, k) for row, k in zip(rows, ks)]
        qs: list[list[torch.Tensor]] = [[] for _ in items]
        # the first pass: each request's unseen tokens up to its last one
        runs = []
        for item, table in zip(items, tables):
            req = item.request
            n = req.num_computed_tokens
            start = n if self.shared else self._unseen(req.spec, req.metrics.num_preemptions, n)
            runs.append((table, start, req.all_token_ids[start : n + 1]))
            if not self.shared:
                req.spec.draft_computed = n + len(item.spec_tokens)  # written by the k passes
        active = list(range(len(items)))
        for j in range(max(ks)):
            tokens = self._pass(runs, [rows[i] for i in active], [noise[i] for i in active], j)
            for i, (token, q) in zip(active, tokens):
                items[i].spec_tokens[j] = token
                if q is not None:
                    qs[i].append(q)
            active = [i for i in active if ks[i] > j + 1]
            n_of = [items[i].request.num_computed_tokens for i in active]
            runs = [(tables[i], n + j + 1, [items[i].spec_tokens[j]]) for i, n in zip(active, n_of)]
        return [torch.stack(q) if q else None for q in qs]

    @staticmethod
    def _unseen(state: SpecState, preemptions: int, num_computed: int) -> int:
        """The first position of the request the draft's own cache does not hold."""
        if state.draft_preemptions != preemptions:
            state.draft_computed, state.draft_preemptions = 0, preemptions
        return min(state.draft_computed, num_computed)

    def _pass(self, runs, rows, noise, j) -> list[tuple[int, torch.Tensor | None]]:
        """One forward of the draft; one token (and its q, where kept) per run."""
        input_ids, positions, meta, last_rows = self.layout(runs)
        hidden = self.model(input_ids, positions, self.kv_caches, meta)
        logits = self.model.compute_logits(hidden[torch.tensor(last_rows)])
        out: list[tuple[int, torch.Tensor | None]] = []
        greedy = logits.argmax(dim=-1).tolist()
        for r, (row, e) in enumerate(zip(rows, noise)):
            if is_greedy(row.params):
                out.append((greedy[r], None))
                continue
            q = sampling_probs(logits[r : r + 1], [row])[0]
            if e is not None:  # seeded: the draws verification will make
                out.append((int((q / e[j]).argmax()), None))
            else:
                out.append((int(torch.multinomial(q, 1)), q))
        return out

    def _peek_noise(self, row: SamplingRow, k: int) -> torch.Tensor | None:
        """A seeded sampled row's next k Exp(1) draws, its generator left where it was."""
        gen = row.generator
        if gen is None or is_greedy(row.params):
            return None
        state = gen.get_state()
        draws = [exponential_draw(self.vocab_size, gen, self.device) for _ in range(k)]
        gen.set_state(state)
        return torch.stack(draws)
