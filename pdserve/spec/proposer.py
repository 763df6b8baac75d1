"""Which decoding requests propose tokens this step, and how many: the adaptive rule.

Prompt lookup's proposals are made here (torch-free, at scheduling); a draft model's are made by
the runner at the start of the step, so for it `propose` only says how many (`DRAFT`
placeholders the runner replaces, `pdserve.spec.draft`).

A request proposes only when speculation can pay and stay lossless here:

- it pays on this engine, measured: the rule keeps the recent time of a plain decode step and
  of a verifying step (exponential averages over the steps of each kind) and the tokens each
  decoding request got from a verifying step (1 + accepted proposals / decoding requests,
  averaged the same way, so requests that did not propose count too); speculation stays on
  while a verifying step yields more tokens per second and request than plain decoding,
  yield / t_verify >= 1 / t_decode. Where it does not (a model so small that a step is
  overhead, not weights; a batch large enough that verifying k + 1 tokens a request is
  compute-bound), it is off, and tried again for one step every `PROBE_EVERY` steps (or more:
  so that the tries cost at most 2.5% of the time, 40 * t_verify / t_decode steps) to notice
  a change of load. A try (and the first one, before anything is measured) lets only one
  request propose: it costs one request's verification (and a draft model's catch-up of one
  prompt), not a batch's;
- at most `max_batch` requests decode (beyond, a decode step is compute-bound anyway);
- its proposals have been right often enough: an exponential average of its acceptance rate
  (accepted / proposed per step, weight 0.5) at or above `min_acceptance`; below, it stops
  proposing for a pause that doubles each time (4, 8, ... up to 64 steps), then tries again;
- it is not a prefill worker's request (which hands its KV off after one token). Grammars,
  penalties, logprobs, min_tokens and seeds all speculate: verification constrains each
  position as plain sampling would (`pdserve.spec.verify`);
- the proposal fits: never past `max_tokens` (the step emits up to k + 1 tokens) nor the
  model's context.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pdserve.config import SpecConfig
from pdserve.request import Request
from pdserve.spec import ngram
from pdserve.types import KVRole

DRAFT = -1  # a proposal the draft model makes at the start of the step
PAUSE_MIN, PAUSE_MAX = 4, 64
EMA_WEIGHT = 0.5  # of a request's acceptance per verified step
STEP_WEIGHT = 0.2  # of a step's time in the average of its kind
PROBE_EVERY = 64  # steps between two tries while speculation does not pay


@dataclass(slots=True)
class SpecState:
    """A request's speculation record (`Request.spec`)."""

    proposed: int = 0  # tokens proposed over the request's life
    accepted: int = 0
    acceptance: float = 1.0  # recent acceptance rate (exponential average)
    pause_left: int = 0  # steps to go without proposing
    next_pause: int = PAUSE_MIN
    index: ngram.NgramIndex | None = field(default=None, repr=False)  # of the request's tokens
    # a draft model with its own KV cache: positions it holds for this request (runner side)
    draft_computed: int = 0
    draft_preemptions: int = 0  # the request's preemptions when it last drafted


def speculable(request: Request) -> bool:
    return request.kv_role != KVRole.SEND  # a prefill worker hands it off after one token


class Proposer:
    def __init__(self, config: SpecConfig, max_model_len: int) -> None:
        if config.method not in ("ngram", "draft"):
            raise ValueError(f"invalid speculative_method={config.method!r}: ngram or draft")
        self.config = config
        self.max_model_len = max_model_len
        self.t_decode: float | None = None  # seconds of a plain decode step, recently
        self.t_verify: float | None = None  # of a step that verified proposals
        # tokens each decoding request got from a verifying step, recently (accepted
        # proposals included, requests that did not propose too)
        self.yield_per_request = 1.0 + config.num_tokens
        self.idle_steps = 0  # decode steps since speculation last ran while it did not pay
        self.on = True  # this step may speculate (`begin_step`)
        self.probing = False  # this step is a try: only one request proposes
        self.step_accepted = 0  # proposals accepted in this step so far (`record`)

    def pays(self) -> bool:
        """Whether a verifying step is expected to yield tokens faster than a plain one, per
        decoding request: yield / t_verify >= 1 / t_decode (both measured)."""
        if self.t_decode is None or self.t_verify is None:
            return False
        return self.yield_per_request / self.t_verify >= 1 / self.t_decode

    def begin_step(self, num_decoding: int) -> bool:
        """Decide once per step whether requests may propose in it."""
        self.on = self.probing = False
        self.step_accepted = 0
        if num_decoding == 0 or num_decoding > self.config.max_batch:
            return False
        if not self.config.adaptive or self.pays():
            self.idle_steps = 0
            self.on = True
        elif self.t_verify is None:  # never tried: a try at once
            self.on = self.probing = True
        elif self.t_decode is not None:
            self.idle_steps += 1
            if self.idle_steps >= self.probe_every():  # one try, to notice a change
                self.idle_steps = 0
                self.on = self.probing = True
        return self.on

    def probe_every(self) -> int:
        """Steps between two tries while speculation does not pay: a try costs t_verify where a
        plain step costs t_decode, so tries cost <= 2.5% of the time."""
        if self.t_decode is None or self.t_verify is None:
            return PROBE_EVERY
        return max(PROBE_EVERY, math.ceil(40 * self.t_verify / self.t_decode))

    def observe_step(
        self, speculated: bool, decode_only: bool, seconds: float, num_decoding: int = 1
    ) -> None:
        """A step's time, by kind: one that verified proposals (after `record` saw each of
        them; `num_decoding` requests decoded in it), or a plain decode-only one."""
        if speculated:
            self.t_verify = _ema(self.t_verify, seconds)
            tokens = 1 + self.step_accepted / max(num_decoding, 1)
            self.yield_per_request += STEP_WEIGHT * (tokens - self.yield_per_request)
        elif decode_only:
            self.t_decode = _ema(self.t_decode, seconds)
        self.step_accepted = 0

    def propose(self, request: Request, budget: int) -> list[int]:
        """Tokens to verify after the request's last one this step ([]: decode one as usual),
        at most `budget`."""
        c = self.config
        if not self.on or budget <= 0 or not speculable(request):
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
        if c.method == "draft":
            proposal = [DRAFT] * k
        else:
            if state.index is None:
                state.index = ngram.NgramIndex(c.ngram_min, c.ngram_max)
            state.index.update(request.all_token_ids)
            proposal = state.index.propose(request.all_token_ids, k)
        if proposal and self.probing:  # a try costs one request's verification, not a batch's
            self.on = False
        return proposal

    def record(self, request: Request, proposed: int, accepted: int) -> None:
        """After verification: update the request's acceptance and pause it when low."""
        state = request.spec
        state.proposed += proposed
        state.accepted += accepted
        state.acceptance += EMA_WEIGHT * (accepted / proposed - state.acceptance)
        self.step_accepted += accepted
        if self.config.adaptive and state.acceptance < self.config.min_acceptance:
            state.pause_left = state.next_pause
            state.next_pause = min(2 * state.next_pause, PAUSE_MAX)
            state.acceptance = self.config.min_acceptance  # a fresh start after the pause


def _ema(old: float | None, new: float) -> float:
    return new if old is None else old + STEP_WEIGHT * (new - old)
