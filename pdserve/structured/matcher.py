"""Engine side of structured output: grammar matchers per request and the token mask per step.

`GrammarCompiler` builds a request's llguidance matcher in a background thread (the engine keeps
stepping meanwhile), reusing compiled grammars (a matcher per distinct grammar, deep-copied per
request). Before a step samples, `fill_bitmask` brings each constrained request's matcher up to
date with its output tokens (however they were produced: sampled here, received with the KV
from a prefill worker, or kept across a preemption) and writes the tokens it allows into one row
of a bitmask; the sampler turns those rows into -inf logits for every other token. A request
whose grammar is complete may only end (EOS).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import llguidance
import torch

from pdserve.structured.spec import PARSER_LIMITS

logger = logging.getLogger("pdserve.structured")
CACHE_SIZE = 64


@dataclass(slots=True)
class GrammarState:
    """One request's matcher and how many of its output tokens it has consumed."""

    matcher: llguidance.LLMatcher
    num_consumed: int = 0


class GrammarCompiler:
    def __init__(self, tokenizer_path: str, vocab_size: int, eos_token_ids: Sequence[int]):
        self.tokenizer_path = tokenizer_path
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="pdserve-grammar")
        self._lock = threading.Lock()
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()

    @property
    def bitmask_width(self) -> int:
        return (self.vocab_size + 31) // 32

    def submit(self, grammar: str) -> Future[GrammarState]:
        return self.pool.submit(self._state, grammar)

    def _state(self, grammar: str) -> GrammarState:
        with self._lock:
            matcher = self._compiled.get(grammar)
            if matcher is None:
                matcher = llguidance.LLMatcher(
                    self._llg_tokenizer(),
                    grammar,
                    log_level=0,
                    limits=llguidance.LLParserLimits(**PARSER_LIMITS),
                )
                if matcher.is_error():
                    raise ValueError(f"invalid grammar: {matcher.get_error()}")
                self._compiled[grammar] = matcher
                while len(self._compiled) > CACHE_SIZE:
                    self._compiled.popitem(last=False)
            self._compiled.move_to_end(grammar)
            return GrammarState(matcher.deep_copy())

    def _llg_tokenizer(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:  # ~1 s, once
            import llguidance.hf

            from pdserve.frontend.tokenizer import load_tokenizer

            hf = load_tokenizer(self.tokenizer_path)
            self._tokenizer = llguidance.hf.from_tokenizer(
                hf, n_vocab=self.vocab_size, eos_token=self.eos_token_ids
            )
        return self._tokenizer

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def fill_bitmask(
    states: Sequence[tuple[GrammarState, Sequence[int]]], bitmask: torch.Tensor
) -> None:
    """Row i of `bitmask` ([n, ceil(vocab/32)] int32, CPU) <- the tokens state i allows next,
    after it consumed the output tokens it has not seen yet."""
    for i, (state, output_token_ids) in enumerate(states):
        new = output_token_ids[state.num_consumed :]
        if new and not state.matcher.consume_tokens(list(new)):
            logger.warning("structured output abandoned: %s", state.matcher.get_error())
        state.num_consumed = len(output_token_ids)
        row = bitmask[i]
        if state.matcher.is_error():  # nothing left to enforce: leave the row unconstrained
            row.fill_(-1)
        else:
            state.matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)


def fill_proposal_bitmask(
    state: GrammarState,
    output_token_ids: Sequence[int],
    proposals: Sequence[int],
    bitmask: torch.Tensor,
) -> None:
    """Rows 0..k of `bitmask` ([k + 1, words]) <- the tokens the grammar allows after the output
    and after each proposal in turn (speculative decoding verifies all k + 1 positions at once).
    The matcher is rolled back to the output afterwards. Positions past the first proposal the
    grammar refuses can never be emitted (that proposal is rejected) and stay unconstrained."""
    fill_bitmask([(state, output_token_ids)], bitmask[:1])
    bitmask[1:].fill_(-1)
    matcher = state.matcher
    if matcher.is_error():
        return
    valid = matcher.validate_tokens(list(proposals))
    for i in range(valid):
        if not matcher.consume_token(proposals[i]):
            valid = i
            break
        matcher.unsafe_compute_mask_ptr(bitmask[i + 1].data_ptr(), bitmask.shape[1] * 4)
    if valid:
        matcher.rollback(valid)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """`logits` ([n, vocab]) with -inf wherever the bit of a token in `bitmask` ([n, words]) is
    0; a new tensor."""
    bits = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = (bitmask.unsqueeze(-1) >> bits) & 1  # [n, words, 32]
    allowed = allowed.flatten(1)[:, : logits.shape[1]].to(logits.device, torch.bool)
    allowed[~allowed.any(dim=-1)] = True  # a row that allows nothing is not constrained at all
    return logits.masked_fill(~allowed, float("-inf"))
