"""Speculative decoding's parts: prompt lookup, the adaptive rule, the scheduler's budget and
bookkeeping for verified steps (no torch there), and the verifier's losslessness (greedy exact,
sampled checked by a chi-square test against the model's own distribution)."""

from __future__ import annotations

import pytest
import torch

from pdserve.config import EngineArgs
from pdserve.kv.manager import KVCacheManager
from pdserve.request import Request
from pdserve.runner.sampler import Sampler, SamplingRow, sampling_probs
from pdserve.sched.scheduler import Scheduler
from pdserve.spec.ngram import NgramIndex, propose
from pdserve.spec.verify import verify
from pdserve.types import RequestStatus, SamplingParams, Verdict

BS = 4


@pytest.mark.parametrize(
    ("tokens", "k", "n_min", "n_max", "want"),
    [
        ([1, 2, 3, 4, 1, 2], 3, 1, 3, [3, 4, 1]),  # the suffix [1, 2] recurs at 0
        ([1, 2, 3, 4, 5], 3, 1, 3, []),  # nothing recurs
        ([7, 1, 2, 9, 5, 1, 2], 4, 2, 2, [9, 5, 1, 2]),
        ([1, 2, 8, 3, 2, 9, 1, 2], 1, 1, 2, [8]),  # the longest suffix ([1, 2]) wins over [2]
        ([5, 2, 6, 2], 2, 1, 1, [6, 2]),  # the latest earlier match of [2] (at 1)
        ([1, 2, 3, 1, 2], 5, 3, 3, []),  # no match of length 3: n_min is respected
        ([4, 4], 3, 1, 2, [4]),  # a proposal is only tokens already seen
    ],
)
def test_prompt_lookup(tokens, k, n_min, n_max, want):
    assert propose(tokens, k, n_min, n_max) == want


def test_the_index_answers_as_the_search_does_as_tokens_grow():
    import random

    rng = random.Random(0)
    for _ in range(2000):
        tokens = [rng.randint(0, 4) for _ in range(rng.randint(1, 60))]
        n_min = rng.randint(1, 3)
        n_max, k = rng.randint(n_min, 5), rng.randint(1, 5)
        index = NgramIndex(n_min, n_max)
        index.update(tokens[: rng.randint(0, len(tokens))])  # fed in two growths
        index.update(tokens)
        assert index.propose(tokens, k) == propose(tokens, k, n_min, n_max)


def make_request(rid, prompt, max_tokens=16, **params):
    p = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **params)
    return Request(rid, prompt, p, max_tokens, eos_token_ids=(2,))


def make_scheduler(num_blocks=64, budget=64, **settings):
    settings.setdefault("speculative_method", "ngram")
    args = EngineArgs(model="m", max_num_batched_tokens=budget, **settings)
    return Scheduler(args.scheduler_config(128), KVCacheManager(num_blocks, BS))


REPEATING = [
    10,
    11,
    12,
    13,
    14,
    10,
    11,
    12,
]  # ends in a suffix that recurs: proposes [13, 14, 10, 11]


def decoding(sched, request, first_token):
    """Admit the request, run its prefill, and give it its first output token."""
    sched.add_request(request)
    plan = sched.schedule()
    assert plan.scheduled[0].num_new_tokens == request.num_prompt_tokens
    sched.update(plan, [first_token])


def test_a_decoding_request_with_a_match_is_budgeted_its_proposals():
    sched = make_scheduler()
    r = make_request("a", REPEATING[:-1])
    decoding(sched, r, 12)  # all tokens now REPEATING
    plan = sched.schedule()
    (item,) = plan.scheduled
    assert item.spec_tokens == [13, 14, 10, 11] and item.num_new_tokens == 5 and item.sample
    assert plan.num_decode_tokens == 5
    # the model agrees with the first two proposals, then says 99
    out = sched.update(plan, [], speculated={"a": Verdict([13, 14, 99])})
    assert out[0].new_token_ids == [13, 14, 99]
    assert r.output_token_ids == [12, 13, 14, 99]
    assert r.num_computed_tokens == r.num_tokens - 1  # the 99 is the one left to compute
    assert (r.metrics.num_spec_proposed, r.metrics.num_spec_accepted) == (4, 2)
    assert (out[0].num_spec_proposed, out[0].num_spec_accepted) == (4, 2)


def test_blocks_that_held_only_rejected_proposals_go_back():
    sched = make_scheduler(num_speculative_tokens=8)
    r = make_request("a", list(range(10, 19)) * 2)  # 18 tokens, then 10: the motif again
    decoding(sched, r, 10)
    plan = sched.schedule()
    assert plan.scheduled[0].spec_tokens == list(range(11, 19))  # 18 + 1 + 8 = 27 tokens
    assert len(sched.kv.block_ids("a")) == 7  # blocks of 4
    sched.update(plan, [], speculated={"a": Verdict([99])})  # all rejected: 20 tokens, 5 blocks
    assert len(sched.kv.block_ids("a")) == 5
    assert sched.kv.num_free_blocks() == 64 - 5
    while sched.has_unfinished:
        plan = sched.schedule()
        spec = {
            s.request.request_id: Verdict(s.spec_tokens[:1] + [7])
            for s in plan.scheduled
            if s.spec_tokens
        }
        sched.update(
            plan, [7] * sum(s.sample and not s.spec_tokens for s in plan.scheduled), speculated=spec
        )
    sched.kv.pool.check_whole()


def test_proposals_stop_at_a_stop_token_and_never_pass_max_tokens():
    sched = make_scheduler()
    r = make_request("a", REPEATING[:-1], max_tokens=4, stop_token_ids=[14])
    decoding(sched, r, 12)
    plan = sched.schedule()
    assert len(plan.scheduled[0].spec_tokens) == 2  # 3 left to emit: 2 proposals + 1 token
    out = sched.update(plan, [], speculated={"a": Verdict([13, 14, 10])})
    assert out[0].new_token_ids == [13, 14] and out[0].finish_reason == "stop"
    assert r.status == RequestStatus.FINISHED_STOPPED and not sched.has_unfinished
    sched.kv.pool.check_whole()


def test_no_proposals_for_large_batches_or_a_short_budget_but_for_any_sampling():
    sched = make_scheduler(speculative_max_batch=1)
    a, b = make_request("a", REPEATING[:-1]), make_request("b", REPEATING[:-1])
    for r in (a, b):
        sched.add_request(r)
    sched.update(sched.schedule(), [12, 12])
    plan = sched.schedule()  # two decode: more than max_batch
    assert [s.spec_tokens for s in plan.scheduled] == [[], []]
    # verification replays logprobs, penalties, min_tokens and seeds position by position
    for params in ({"logprobs": 0}, {"repetition_penalty": 1.2}, {"min_tokens": 8}, {"seed": 1}):
        s2 = make_scheduler()
        r = make_request("c", REPEATING[:-1], **params)
        decoding(s2, r, 12)
        assert s2.schedule().scheduled[0].spec_tokens == [13, 14, 10, 11]
    s3 = make_scheduler(budget=2)
    r = make_request("d", REPEATING[:-1])
    s3.add_request(r)
    while r.num_output_tokens == 0:
        plan = s3.schedule()
        s3.update(plan, [12] * sum(s.sample for s in plan.scheduled))
    assert len(s3.schedule().scheduled[0].spec_tokens) == 1  # the budget leaves room for one


def test_low_acceptance_pauses_proposals_for_a_growing_while():
    sched = make_scheduler(speculative_min_acceptance=0.5)
    r = make_request("a", REPEATING[:-1], max_tokens=100)
    decoding(sched, r, 12)
    pauses = []
    steps_without = 0
    for _ in range(40):
        plan = sched.schedule()
        item = plan.scheduled[0]
        if item.spec_tokens:
            pauses.append(steps_without)
            steps_without = 0
            # reject everything and emit a token that keeps the suffix recurring
            sched.update(plan, [], speculated={"a": Verdict([r.all_token_ids[-5]])})
        else:
            steps_without += 1
            sched.update(plan, [r.all_token_ids[-4]])
    assert r.spec.proposed > 0 and r.spec.accepted == 0
    # acceptance 0 -> EMA 0.5 -> 0.25 < 0.5 after the second rejection: pause 4, then 8, 16
    assert [p for p in pauses if p] == [4, 8, 16]


def row(**params):
    return SamplingRow(SamplingParams(**params), None, [], [])


SAMPLER = Sampler(eos_token_ids=(2,))


def test_greedy_verification_keeps_the_agreeing_prefix_and_the_models_token():
    logits = torch.full((4, 10), -1.0)
    for pos, best in enumerate([3, 5, 7, 1]):
        logits[pos, best] = 5.0

    def tokens(proposals):
        rows = [row(temperature=0)] * (len(proposals) + 1)
        return verify(SAMPLER, logits[: len(proposals) + 1], proposals, rows).tokens

    assert tokens([3, 5, 2]) == [3, 5, 7]
    assert tokens([3, 5, 7]) == [3, 5, 7, 1]  # all + a bonus
    assert tokens([4, 5, 7]) == [3]


def test_verification_constrains_each_position_as_plain_sampling_would():
    """Position j is judged with the proposals before it as output: a repetition penalty that
    turns the argmax away from an already-proposed token rejects a proposal that repeats it;
    min_tokens bans EOS exactly at the positions that are still short; logprobs come per token."""
    logits = torch.zeros(3, 10)
    logits[:, 4] = 2.0
    logits[:, 6] = 1.9
    penalized = [SamplingRow(SamplingParams(temperature=0, repetition_penalty=1.5), None, [1],
                             [9] + [4] * j) for j in range(3)]  # fmt: skip
    v = verify(SAMPLER, logits, [4, 4], penalized)
    assert v.tokens == [4, 6] and v.logprobs is None  # 4 once, then 2.0 / 1.5 < 1.9
    eos = torch.zeros(3, 10)
    eos[:, 2] = 5.0  # EOS is the argmax everywhere
    short = [SamplingRow(SamplingParams(temperature=0, min_tokens=3, logprobs=1), None, [1],
                         [9] + [7] * j) for j in range(3)]  # fmt: skip
    v = verify(SAMPLER, eos, [7, 2], short)  # output 1, 2, then 3 tokens long
    assert v.tokens[0] != 2 and len(v.tokens) == 1  # banned at position 0: 7 is not the pick
    assert len(v.logprobs) == 1 and v.logprobs[0].token_id == v.tokens[0]
    assert v.logprobs[0].logprob == pytest.approx(float(eos[0].log_softmax(-1)[v.tokens[0]]))


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "drew a token of probability zero"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


SAMPLED = [{"temperature": 1.0}, {"temperature": 0.7, "top_k": 5}, {"top_p": 0.8}]


@pytest.fixture
def one_thread():
    """Tens of thousands of ops on 8-token rows: no OpenMP regions around each."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def draws(logits, proposals, rows, n=10000):
    first, second = torch.zeros(8), torch.zeros(8)
    for _ in range(n):
        out = verify(SAMPLER, logits, proposals, rows).tokens
        first[out[0]] += 1
        if out[0] == proposals[0]:
            second[out[1]] += 1
    return first, second


# 10,000 verifications each (3-7 s): plain temperature in the default run, top-k and top-p in the
# slow suite (to shorten the default run, which a 2-core Zen 1 takes over five minutes)
DISTRIBUTIONS = [SAMPLED[0], *(pytest.param(p, marks=pytest.mark.slow) for p in SAMPLED[1:])]


@pytest.mark.parametrize("params", DISTRIBUTIONS)
@pytest.mark.parametrize("proposer", ["point mass", "draft"])
def test_sampled_verification_follows_the_models_distribution(params, proposer, one_thread):
    """Over many draws, the first emitted token follows p_0, and the second (given the first
    proposal was kept) follows p_1, whatever the proposals and whatever distribution q a draft
    drew them from: a chi-square test at p = 0.001 for 8 categories (critical value 24.3)."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 8, generator=g) * 1.5
    rows = [SamplingRow(SamplingParams(**params), None, [], [])] * 3
    probs = sampling_probs(logits, rows)
    torch.manual_seed(0)
    q = None
    if proposer == "draft":  # a draft that disagrees with the model, proposals drawn from it
        q = torch.softmax(torch.randn(2, 8, generator=g) * 2.0, dim=-1)
        firsts, seconds = torch.zeros(8), torch.zeros(8)
        for _ in range(10000):
            proposals = [int(torch.multinomial(q[0], 1)), int(torch.multinomial(q[1], 1))]
            out = verify(SAMPLER, logits, proposals, rows, draft_probs=q).tokens
            firsts[out[0]] += 1
            if len(out) > 1:  # the first proposal was kept
                seconds[out[1]] += 1
        first, second = firsts, seconds
    else:
        proposals = [int(probs[0].argmax()), int(probs[1].argmin())]  # a likely, an unlikely
        first, second = draws(logits, proposals, rows)
    assert chi_square(first, probs[0]) < 24.3
    assert chi_square(second, probs[1]) < 24.3


@pytest.mark.parametrize("params", SAMPLED)
def test_a_seeded_verification_emits_what_plain_seeded_sampling_draws(params):
    """Seeded: the tokens are those plain sampling draws from the same generator, one draw per
    emitted token, whatever was proposed; so a seed gives the same tokens with or without
    speculation (and they follow p: plain sampling's are checked in test_sampler.py)."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 8, generator=g) * 1.5
    sp = SamplingParams(**params, seed=5)
    plain_gen, spec_gen = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    plain = [SAMPLER(logits[j : j + 1], [SamplingRow(sp, plain_gen, [], [])]).token_ids[0]
             for j in range(5)]  # fmt: skip
    rows = [SamplingRow(sp, spec_gen, [], [])] * 5
    for proposals in ([], plain[:2] + [(plain[2] + 1) % 8], plain[:4], [(plain[0] + 1) % 8]):
        spec_gen.manual_seed(5)
        out: list[int] = []
        while len(out) < 5:  # one verifying step after another, as the engine runs them
            at = len(out)
            ahead = proposals[at:4] if out == proposals[:at] else []  # proposals still in line
            got = verify(SAMPLER, logits[at : at + len(ahead) + 1], ahead, rows[: len(ahead) + 1])
            out += got.tokens
        assert out[:5] == plain


def test_speculation_runs_only_while_a_verifying_step_yields_tokens_faster():
    from pdserve.spec.proposer import PROBE_EVERY

    sched = make_scheduler(speculative_max_batch=4)
    p = sched.proposer
    assert p.begin_step(1) and p.probing  # nothing measured yet: one try
    p.observe_step(speculated=True, decode_only=False, seconds=0.030)
    assert not p.begin_step(1)  # no plain step measured yet: one, to compare
    p.observe_step(speculated=False, decode_only=True, seconds=0.010)
    p.yield_per_request = 4.0  # 4 tokens a request per verifying step in 30 ms: 133/s vs 100/s
    assert p.pays() and p.begin_step(1) and not p.probing
    p.yield_per_request = 2.0  # 2 tokens per 30 ms: 67/s, slower than plain decoding
    assert not p.pays()
    assert p.probe_every() == 120  # 40 * 30 / 10: the tries cost at most 2.5%
    decisions = [p.begin_step(1) for _ in range(240)]
    assert decisions.count(True) == 2 and decisions[119]
    p.t_verify, p.yield_per_request = 0.012, 1.0  # cheaper: no closer than PROBE_EVERY
    assert not p.pays() and p.probe_every() == PROBE_EVERY
    decisions = [p.begin_step(1) for _ in range(2 * PROBE_EVERY)]
    assert decisions.count(True) == 2 and decisions[PROBE_EVERY - 1]  # one probe every 64
    p.yield_per_request = 5.0
    assert p.pays() and not p.begin_step(5)  # more requests decode than max_batch


def test_a_try_lets_one_request_propose_and_the_yield_counts_every_decoding_request():
    sched = make_scheduler(speculative_adaptive=True)
    for c in "abc":
        sched.add_request(make_request(c, REPEATING[:-1]))
    sched.update(sched.schedule(), [12, 12, 12])  # the three prefills, a first token each
    plan = sched.schedule()  # nothing measured: a try, one request proposes
    assert sched.proposer.probing
    assert [s.spec_tokens for s in plan.scheduled] == [[13, 14, 10, 11], [], []]
    sched.update(plan, [12, 12], speculated={"a": Verdict([13, 14, 10])})  # 2 accepted
    sched.observe_step(plan, 0.030)
    assert sched.proposer.yield_per_request == pytest.approx(5 + 0.2 * (1 + 2 / 3 - 5))
