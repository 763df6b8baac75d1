"""Specification of the sampler: greedy, seeded reproducibility, sampling distributions,
penalties, min_tokens and logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from pdserve.runner.sampler import Sampler, SamplingRow, apply_penalties
from pdserve.types import SamplingParams

EOS = 7
CHI_SQUARE_ALPHA = 1e-3  # a correct sampler fails a distribution test this rarely (seeds are fixed)
NUM_DISTRIBUTION_SAMPLES = 30_000
# A fixed 8-token logit vector with distinct values, for the distribution tests.
LOGITS_8 = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0])


def make_row(
    *, prompt: list[int] | None = None, output: list[int] | None = None, **params
) -> SamplingRow:
    sampling_params = SamplingParams(max_tokens=None, **params)
    generator = None
    if sampling_params.seed is not None:
        generator = torch.Generator().manual_seed(sampling_params.seed)
    return SamplingRow(sampling_params, generator, prompt or [0], output or [])


def make_sampler(eos_token_ids: tuple[int, ...] = (EOS,)) -> Sampler:
    return Sampler(eos_token_ids)


def random_logits(num_rows: int, vocab_size: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(num_rows, vocab_size, generator=torch.Generator().manual_seed(seed)) * 3


def sample_counts(params: dict, num_samples: int = NUM_DISTRIBUTION_SAMPLES) -> torch.Tensor:
    torch.manual_seed(0)
    row = make_row(**params)
    logits = LOGITS_8.expand(num_samples, -1)
    token_ids = make_sampler()(logits, [row] * num_samples).token_ids
    return torch.bincount(torch.tensor(token_ids), minlength=len(LOGITS_8)).double()


def reference_probs(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) -> torch.Tensor:
    """The expected distribution, computed token by token in float64."""
    probs = (LOGITS_8.double() / temperature).softmax(-1).tolist()
    ranked = sorted(range(len(probs)), key=lambda t: -probs[t])
    top_k_set = ranked[:top_k] if top_k > 0 else ranked
    top_k_mass = sum(probs[t] for t in top_k_set)
    nucleus, mass = [], 0.0
    for t in top_k_set:
        if mass >= top_p:
            break
        nucleus.append(t)
        mass += probs[t] / top_k_mass
    kept = [t for t in nucleus if probs[t] >= min_p * max(probs[u] for u in nucleus)]
    expected = torch.zeros(len(probs), dtype=torch.float64)
    expected[kept] = torch.tensor([probs[t] for t in kept], dtype=torch.float64)
    return expected / expected.sum()


def chi_square_passes(observed: torch.Tensor, expected_probs: torch.Tensor) -> bool:
    """Pearson's chi-square goodness-of-fit test at level CHI_SQUARE_ALPHA."""
    expected = expected_probs * observed.sum()
    statistic = ((observed - expected) ** 2 / expected).sum().item()
    df = len(observed) - 1
    try:
        from scipy.stats import chi2
    except ImportError:  # Wilson-Hilferty approximation of the chi-square quantile
        z = 3.0902  # standard normal quantile at 1 - CHI_SQUARE_ALPHA
        critical = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    else:
        critical = chi2.ppf(1 - CHI_SQUARE_ALPHA, df)
    return statistic < critical


def test_greedy_takes_argmax_even_next_to_random_rows():
    logits = random_logits(6, 50)
    rows = [make_row(temperature=0.0) if i % 2 == 0 else make_row() for i in range(6)]

    token_ids = make_sampler()(logits, rows).token_ids

    assert token_ids[::2] == logits.argmax(-1)[::2].tolist()


def test_all_greedy_batch_is_argmax():
    logits = random_logits(4, 50)
    output = make_sampler()(logits, [make_row(temperature=0.0) for _ in range(4)])

    assert output.token_ids == logits.argmax(-1).tolist()
    assert output.logprobs == [None] * 4


def test_top_k_1_equals_greedy_at_temperature_1():
    sampler = make_sampler()
    for step in range(5):
        logits = random_logits(8, 50, seed=step)
        rows = [make_row(temperature=1.0, top_k=1) for _ in range(8)]

        assert sampler(logits, rows).token_ids == logits.argmax(-1).tolist()


def run_steps(
    target: SamplingRow, position: int, others: list[SamplingRow], num_steps: int = 6
) -> list[int]:
    """Samples `target` at `position` among `others` for several steps; returns its tokens."""
    sampler = make_sampler()
    target_logits = random_logits(num_steps, 64, seed=99) / 3  # soft: many plausible tokens
    sampled = []
    for step in range(num_steps):
        rows = others[:position] + [target] + others[position:]
        logits = random_logits(len(rows), 64, seed=step)
        logits[position] = target_logits[step]
        token_id = sampler(logits, rows).token_ids[position]
        target.output_token_ids = [*target.output_token_ids, token_id]
        sampled.append(token_id)
    return sampled


def test_seeded_row_is_independent_of_batch_and_position():
    target_params = dict(seed=1234, temperature=0.9, top_p=0.95)
    alone = run_steps(make_row(**target_params), position=0, others=[])

    others = [
        make_row(seed=1, top_k=5),
        make_row(),
        make_row(seed=2, min_p=0.1),
        make_row(temperature=0.0),
        make_row(top_p=0.5, repetition_penalty=1.3),
        make_row(seed=3, temperature=1.5),
        make_row(min_tokens=3),
    ]
    in_batch = run_steps(make_row(**target_params), position=5, others=others)

    assert in_batch == alone
    assert len(set(alone)) > 1  # the row really samples


def test_different_seeds_give_different_tokens():
    logits = torch.zeros(1, 1000)
    sampler = make_sampler()
    rows = [make_row(seed=1), make_row(seed=2)]

    tokens = [[sampler(logits, [row]).token_ids[0] for _ in range(5)] for row in rows]

    assert tokens[0] != tokens[1]


@pytest.mark.parametrize(
    "params",
    [
        dict(temperature=0.7),
        dict(temperature=1.0, top_k=3),
        dict(temperature=1.0, top_p=0.7),
        dict(temperature=1.0, min_p=0.2),
        dict(temperature=1.5, top_k=6, top_p=0.9, min_p=0.3),
    ],
    ids=["temperature", "top_k", "top_p", "min_p", "combined"],
)
def test_sampling_distribution_matches_expected(params):
    expected = reference_probs(**params)
    counts = sample_counts(params)

    kept = expected > 0
    assert counts[~kept].sum() == 0, "sampled a token outside the kept set"
    assert chi_square_passes(counts[kept], expected[kept])


def test_reference_keeps_the_hand_checked_sets():
    # probs at temperature 1 ~ [.403, .244, .148, .090, .055, .033, .020, .007]
    assert (reference_probs(top_k=3) > 0).tolist() == [True] * 3 + [False] * 5
    # .403 + .244 = .647 < .7 <= .795: three tokens
    assert (reference_probs(top_p=0.7) > 0).tolist() == [True] * 3 + [False] * 5
    # min_p keeps p >= .2 * .403 = .081: four tokens
    assert (reference_probs(min_p=0.2) > 0).tolist() == [True] * 4 + [False] * 4
    # temperature 1.5 ~ [.307, .220, .158, .113, .081, .058, ...]: top-6, renormalised mass
    # reaches .9 at the fifth token, min_p drops p < .3 * .307 = .092: four tokens
    combined = reference_probs(temperature=1.5, top_k=6, top_p=0.9, min_p=0.3)
    assert (combined > 0).tolist() == [True] * 4 + [False] * 4


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits():
    logits = torch.tensor([[2.0, -1.0, 0.5, -0.5, 3.0, 1.0]])
    row = make_row(prompt=[0, 1], output=[2, 3], repetition_penalty=2.0)

    penalized = apply_penalties(logits, [row], [0])

    assert penalized.tolist() == [[1.0, -2.0, 0.25, -1.0, 3.0, 1.0]]


def test_frequency_and_presence_penalties_use_output_counts_only():
    logits = torch.tensor([[2.0, -1.0, 0.5, -0.5, 3.0, 1.0]])
    row = make_row(prompt=[0, 1], output=[2, 2, 3], frequency_penalty=0.5, presence_penalty=0.25)

    penalized = apply_penalties(logits, [row], [0])

    # token 2: 0.5 - 2 * 0.5 - 0.25; token 3: -0.5 - 0.5 - 0.25; prompt tokens untouched
    assert penalized.tolist() == [[2.0, -1.0, -0.75, -1.25, 3.0, 1.0]]


def test_penalties_apply_in_order_to_selected_rows_only():
    logits = torch.tensor([[2.0, -1.0, 0.5], [2.0, -1.0, 0.5]])
    rows = [
        make_row(prompt=[0], output=[1, 1], repetition_penalty=2.0, frequency_penalty=1.0),
        make_row(prompt=[0], output=[1]),
    ]

    penalized = apply_penalties(logits, rows, [0])

    # token 0: 2 / 2; token 1: -1 * 2 - 2 * 1.0
    assert penalized.tolist() == [[1.0, -4.0, 0.5], [2.0, -1.0, 0.5]]
    assert logits.tolist() == [[2.0, -1.0, 0.5], [2.0, -1.0, 0.5]]


def test_penalties_change_the_greedy_pick():
    logits = torch.tensor([[3.0, 2.9, 0.0]])
    row = make_row(temperature=0.0, output=[0], presence_penalty=0.5)

    assert make_sampler()(logits, [row]).token_ids == [1]


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    logits = torch.zeros(1, 10)
    logits[0, EOS] = 5.0
    logits[0, 3] = 4.0
    logits[0, 1] = 3.0
    sampler = make_sampler()

    def pick(num_output: int) -> int:
        row = make_row(temperature=0.0, min_tokens=2, stop_token_ids=[3], output=[5] * num_output)
        return sampler(logits, [row]).token_ids[0]

    assert pick(0) == 1
    assert pick(1) == 1
    assert pick(2) == EOS


def test_min_tokens_with_ignore_eos_still_masks_stop_ids():
    logits = torch.zeros(1, 10)
    logits[0, EOS] = 5.0
    logits[0, 3] = 4.0
    row = make_row(temperature=0.0, min_tokens=2, stop_token_ids=[3], ignore_eos=True)

    assert make_sampler()(logits, [row]).token_ids == [EOS]


def test_logprobs_match_log_softmax_of_raw_logits():
    logits = random_logits(4, 40)
    raw = logits.clone()
    rows = [
        make_row(logprobs=5, temperature=0.5, repetition_penalty=1.5, output=[1, 2]),
        make_row(logprobs=0),
        make_row(),
        make_row(logprobs=3, temperature=0.0),
    ]

    output = make_sampler()(logits, rows)

    expected = torch.log_softmax(raw, dim=-1)
    assert torch.equal(logits, raw), "sampler modified the logits in place"
    assert output.logprobs[2] is None
    for i, k in [(0, 5), (1, 0), (3, 3)]:
        logprob = output.logprobs[i]
        assert logprob.token_id == output.token_ids[i]
        assert logprob.logprob == pytest.approx(expected[i, logprob.token_id].item(), abs=1e-5)
        assert len(logprob.top) == k
        top_values = [lp for _, lp in logprob.top]
        assert top_values == sorted(top_values, reverse=True)
        want_values, want_ids = expected[i].topk(k) if k else (torch.empty(0), torch.empty(0))
        assert [t for t, _ in logprob.top] == want_ids.tolist()
        assert top_values == pytest.approx(want_values.tolist(), abs=1e-5)


def test_length_mismatch_raises():
    with pytest.raises(ValueError, match="2 sampling rows"):
        make_sampler()(torch.zeros(3, 10), [make_row(), make_row()])


def test_seeded_row_without_generator_raises():
    row = SamplingRow(SamplingParams(seed=5), None, [0], [])

    with pytest.raises(ValueError, match="no generator"):
        make_sampler()(torch.zeros(1, 10), [row])
