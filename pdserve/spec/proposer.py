"""Which decoding requests propose tokens this step, and how many: the adaptive rule.

A request proposes only when speculation can pay and stay lossless here:

- the step is bandwidth-bound: at most `max_batch` requests decode (beyond that a decode step
  is compute-bound on the matrix products, and verifying k + 1 tokens per request costs about
  k + 1 times as much as one);
- its proposals have been right often enough: an exponential average of its acceptance rate
  (accepted / proposed per step, weight 0.5) at or above `min_acceptance`; below, it stops
  proposing for a pause that doubles each time (4, 8, ... up to 64 steps), then tries again;
- its sampling has no state that verification does not replay: no grammar, no penalties, no
  logprobs, no pending `min_tokens` (those requests decode one token per step as before);
- the proposal fits: never past `max_tokens` (the step emits up to k + 1 tokens) nor the
  model's context.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.config import SpecConfig
from pdserve.request import Request
from pdserve.spec import ngram

PAUSE_MIN, PAUSE_MAX = 4, 64
EMA_WEIGHT = 0.5


@dataclass(slots=True)
class SpecState:
    """A request's speculation record (`Request.spec`)."""

    proposed: int = 0  # tokens proposed over the request's life
    accepted: int = 0
    steps: int = 0  # steps that verified proposals
    acceptance: float = 1.0  # recent acceptance rate (exponential average)
    pause_left: int = 0  # steps to go without proposing
    next_pause: int = PAUSE_MIN


def speculable(request: Request) -> bool:
    p = request.sampling_params
    return (
        request.grammar_state is None
        and p.logprobs is None
        and p.repetition_penalty == 1.0
        and p.frequency_penalty == 0.0
        and p.presence_penalty == 0.0
        and request.num_output_tokens >= p.min_tokens
    )


class Proposer:
    def __init__(self, config: SpecConfig, max_model_len: int) -> None:
        if config.method != "ngram":
            raise ValueError(f"invalid speculative_method={config.method!r}: choose ngram")
        self.config = config
        self.max_model_len = max_model_len

    def propose(self, request: Request, num_decoding: int, budget: int) -> list[int]:
        """Tokens to verify after the request's last one this step ([]: decode one as usual),
        at most `budget`."""
        c = self.config
        if num_decoding > c.max_batch or budget <= 0 or not speculable(request):
            return []
        state = request.spec
        if state is None:
            state = request.spec = SpecState()
        if state.pause_left > 0:
            state.pause_left -= 1
            return []
        # the step emits up to len(proposal) + 1 tokens: stay within max_tokens and the context
        room = min(
            request.max_tokens - request.num_output_tokens - 1,
            self.max_model_len - request.num_tokens - 1,
        )
        k = min(c.num_tokens, budget, room)
        if k <= 0:
            return []
        return ngram.propose(request.all_token_ids, k, c.ngram_min, c.ngram_max)

    def record(self, request: Request, proposed: int, accepted: int) -> None:
        """After verification: update the request's acceptance and pause it when low."""
        state = request.spec
        state.proposed += proposed
        state.accepted += accepted
        state.steps += 1
        state.acceptance += EMA_WEIGHT * (accepted / proposed - state.acceptance)
        if state.acceptance < self.config.min_acceptance:
            state.pause_left = state.next_pause
            state.next_pause = min(2 * state.next_pause, PAUSE_MAX)
            state.acceptance = self.config.min_acceptance  # a fresh start after the pause
