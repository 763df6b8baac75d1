"""Specification of `pdserve.bench.workload`: lengths, arrivals, scaling and prompt prefixes."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest

from pdserve.bench.traces import TraceRow
from pdserve.bench.workload import (
    RequestSpec,
    WorkloadConfig,
    arrival_offsets,
    build_prompts,
    make_specs,
    sample_lengths,
    with_rate,
)

WORDS = [f"w{i}" for i in range(50)]


class WordTokenizer:
    """One token per space-separated word, plus a BOS."""

    words = WORDS
    separator = " "

    def count(self, prompts: list[str]) -> list[int]:
        return [len(p.split()) + 1 for p in prompts]


class MergingTokenizer(WordTokenizer):
    """Like WordTokenizer, but "w1 w2" is a single token: counts drift and must be nudged."""

    def count(self, prompts: list[str]) -> list[int]:
        return [len(p.split()) + 1 - p.count("w1 w2") for p in prompts]


def tokens(prompt: str) -> list[str]:
    return ["<s>", *prompt.split()]


def spec(index: int, input_len: int, hash_ids: tuple[int, ...] = ()) -> RequestSpec:
    return RequestSpec(index, 0.0, input_len, 4, hash_ids)


def test_trace_lengths_and_times_are_scaled_then_clipped():
    trace = [TraceRow(0.0, 1000, 100), TraceRow(2.0, 3000, 7), TraceRow(5.0, 10, 1)]
    cfg = WorkloadConfig(time_scale=0.5, length_scale=0.1, max_input_len=200, max_output_len=8)
    specs = make_specs(cfg, trace)
    assert [s.send_at_s for s in specs] == [0.0, 1.0, 2.5]
    assert [s.input_len for s in specs] == [100, 200, 1]  # 300 clipped; 1 rounds up from 0
    assert [s.output_len for s in specs] == [8, 1, 1]


def test_num_requests_takes_the_first_trace_rows():
    trace = [TraceRow(float(i), 10 + i, 5) for i in range(10)]
    specs = make_specs(WorkloadConfig(num_requests=3), trace)
    assert [s.input_len for s in specs] == [10, 11, 12]


def test_request_rate_replaces_trace_timing():
    trace = [TraceRow(float(i) * 100, 10, 5) for i in range(2000)]
    specs = make_specs(WorkloadConfig(request_rate=50.0), trace)
    duration = specs[-1].send_at_s
    assert 1999 / duration == pytest.approx(50.0, rel=0.1)


def test_random_dataset_defaults_to_all_at_once_with_fixed_lengths():
    specs = make_specs(WorkloadConfig(input_len=64, output_len=8))
    assert len(specs) == 200
    assert {(s.send_at_s, s.input_len, s.output_len) for s in specs} == {(0.0, 64, 8)}


@pytest.mark.parametrize("dist", ["uniform", "lognormal"])
def test_random_lengths_have_the_requested_mean(dist):
    lengths = sample_lengths(20000, 500, dist, 0.5, np.random.default_rng(0))
    assert np.mean(lengths) == pytest.approx(500, rel=0.03)
    assert min(lengths) >= 1


def test_uniform_lengths_stay_within_the_spread():
    lengths = sample_lengths(5000, 100, "uniform", 0.2, np.random.default_rng(0))
    assert (min(lengths), max(lengths)) == (80, 120)


def test_poisson_arrivals_have_the_requested_rate_and_exponential_gaps():
    offsets = arrival_offsets(20000, 10.0, 1.0, seed=3)
    gaps = np.diff(offsets)
    assert offsets[0] == 0.0
    assert np.mean(gaps) == pytest.approx(0.1, rel=0.05)
    assert np.std(gaps) / np.mean(gaps) == pytest.approx(1.0, rel=0.05)  # CV of an exponential


def test_burstiness_below_one_makes_gaps_more_variable_at_the_same_rate():
    gaps = np.diff(arrival_offsets(20000, 10.0, 0.25, seed=3))
    assert np.mean(gaps) == pytest.approx(0.1, rel=0.05)
    assert np.std(gaps) / np.mean(gaps) == pytest.approx(2.0, rel=0.1)  # 1/sqrt(shape)


def test_infinite_rate_sends_everything_at_once():
    assert arrival_offsets(5, math.inf, 1.0, 0) == [0.0] * 5


def test_same_seed_same_workload():
    cfg = WorkloadConfig(num_requests=20, length_dist="lognormal", request_rate=4.0, seed=7)
    assert make_specs(cfg) == make_specs(cfg)
    assert make_specs(cfg) != make_specs(WorkloadConfig(**{**cfg.__dict__, "seed": 8}))


@pytest.mark.parametrize(
    "overrides",
    [
        {"input_len": 0},
        {"num_requests": 0},
        {"length_dist": "zipf"},
        {"length_spread": 1.5, "length_dist": "uniform"},
        {"time_scale": 0.0},
        {"length_scale": -1.0},
        {"burstiness": 0.0},
        {"request_rate": 0.0},
        {"max_output_len": 0},
    ],
)
def test_invalid_workload_settings_raise_value_errors(overrides):
    with pytest.raises(ValueError, match=next(iter(overrides))):
        WorkloadConfig(**overrides)


def test_prompts_have_the_intended_token_counts():
    specs = [spec(i, n) for i, n in enumerate([1, 2, 17, 300])]
    requests = build_prompts(specs, WordTokenizer())
    assert [r.prompt_len for r in requests] == [2, 2, 17, 300]  # 1 token cannot hold BOS + a word
    assert [len(tokens(r.prompt)) for r in requests] == [2, 2, 17, 300]


def test_requests_sharing_leading_hash_ids_share_exactly_those_blocks():
    block = 8
    specs = [spec(0, 41, (1, 2, 3, 4, 5, 6)), spec(1, 41, (1, 2, 9, 10, 11, 12)), spec(2, 41, (7,))]
    a, b, c = (tokens(r.prompt) for r in build_prompts(specs, WordTokenizer(), 0, block))
    common = len(os.path.commonprefix([a, b]))
    assert 1 + 2 * block <= common < 1 + 3 * block  # BOS + two shared blocks, then apart
    assert a[1 + 2 * block : 1 + 3 * block] != b[1 + 2 * block : 1 + 3 * block]
    assert len(os.path.commonprefix([a, c])) < 1 + block


def test_a_block_is_the_same_text_wherever_it_appears_and_is_cut_at_the_prompt_end():
    block = 8
    long, short = build_prompts(
        [spec(0, 30, (5, 6, 7, 8)), spec(1, 13, (5, 6))], WordTokenizer(), 0, block
    )
    assert tokens(long.prompt)[:13] == tokens(short.prompt)  # block 6 cut after 4 of 8 words


def test_words_past_the_hash_blocks_are_unique_per_request():
    specs = [spec(0, 60, (1,)), spec(1, 60, (1,))]
    a, b = (tokens(r.prompt) for r in build_prompts(specs, WordTokenizer(), 0, 8))
    assert a[:9] == b[:9] and a[9:] != b[9:]


def test_seed_changes_the_text_but_not_the_lengths():
    specs = [spec(0, 50, (1, 2))]
    one = build_prompts(specs, WordTokenizer(), seed=1, block_tokens=8)[0]
    two = build_prompts(specs, WordTokenizer(), seed=2, block_tokens=8)[0]
    assert one.prompt != two.prompt and one.prompt_len == two.prompt_len == 50


def test_prompts_are_nudged_when_the_tokenizer_merges_words():
    specs = [spec(i, 200) for i in range(20)]
    requests = build_prompts(specs, MergingTokenizer())
    assert sum("w1 w2" in r.prompt for r in requests) > 0  # the merge did happen
    assert all(r.prompt_len == 200 for r in requests)
    assert MergingTokenizer().count([r.prompt for r in requests]) == [200] * 20


def test_with_rate_keeps_prompts_and_changes_only_send_times():
    requests = build_prompts([spec(i, 10) for i in range(50)], WordTokenizer())
    timed = with_rate(requests, 5.0, 1.0, seed=0)
    assert [r.prompt for r in timed] == [r.prompt for r in requests]
    assert timed[0].send_at_s == 0.0 and timed[-1].send_at_s > 0


@pytest.fixture(scope="module")
def stories_tokenizer(stories_path):
    from pdserve.bench.tokenizer import load_tokenizer

    return load_tokenizer(stories_path)


@pytest.mark.parametrize("chat", [False, True])
def test_prompts_have_exact_lengths_in_a_real_tokenizer(stories_tokenizer, chat):
    from pdserve.bench.tokenizer import HFPromptTokenizer

    specs = [spec(i, n, (1, 2, 3) if i % 2 else (1, 4)) for i, n in enumerate([5, 64, 130, 400])]
    requests = build_prompts(specs, HFPromptTokenizer(stories_tokenizer, chat), 0, 32)
    for r in requests:
        if chat:
            messages = [{"role": "user", "content": r.prompt}]
            out = stories_tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True
            )
            ids = out if isinstance(out, list) else out["input_ids"]
        else:
            ids = stories_tokenizer(r.prompt).input_ids
        assert len(ids) == r.input_len == r.prompt_len


def test_shared_hash_ids_give_shared_token_prefixes_in_a_real_tokenizer(stories_tokenizer):
    from pdserve.bench.tokenizer import HFPromptTokenizer

    specs = [spec(0, 200, (0, 1, 2, 3)), spec(1, 200, (0, 1, 9, 10))]
    a, b = (
        stories_tokenizer(r.prompt).input_ids
        for r in build_prompts(specs, HFPromptTokenizer(stories_tokenizer), 0, 50)
    )
    common = len(os.path.commonprefix([a, b]))
    assert 1 + 100 <= common < 1 + 150


def test_byte_level_vocabularies_without_words_get_character_prompts(tmp_path):
    from pdserve.bench.tokenizer import HFPromptTokenizer, load_tokenizer
    from pdserve.models.make import write_tokenizer

    write_tokenizer(tmp_path, vocab_size=1024, max_length=4096)  # `pdserve make-model`'s kind
    hf = load_tokenizer(tmp_path)
    tokenizer = HFPromptTokenizer(hf)
    assert tokenizer.separator == "" and "a" in tokenizer.words
    specs = [spec(0, 100, (1, 2)), spec(1, 300, (1, 3))]
    a, b = build_prompts(specs, tokenizer, 0, 40)
    assert len(hf(a.prompt).input_ids) == 100 and len(hf(b.prompt).input_ids) == 300
    assert len(os.path.commonprefix([hf(a.prompt).input_ids, hf(b.prompt).input_ids])) >= 1 + 40
