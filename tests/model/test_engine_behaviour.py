"""Engine behaviour on the real tiny model: sampling, stop conditions, n > 1, aborts, bad input.

After every scenario the KV pool must be whole: every block free or cached and unreferenced.
"""

from __future__ import annotations

import json
import shutil

import pytest

from pdserve import LLM, SamplingParams
from pdserve.config import EngineArgs
from pdserve.engine.llm_engine import LLMEngine, load_tokenizer


@pytest.fixture(scope="module")
def llm(stories_path):
    return LLM(stories_path)


@pytest.fixture(scope="module")
def period_eos_llm(stories_path, tmp_path_factory):
    """stories260K never emits its EOS (id 2: llama2.c separates stories with BOS), so nothing
    would show EOS at work. This copy of the model declares "." its EOS: the model's own greedy
    continuation of [1] then reaches EOS at the end of its first sentence, 15 tokens in."""
    folder = tmp_path_factory.mktemp("period_eos") / "stories260K"
    shutil.copytree(stories_path, folder)
    period = load_tokenizer(stories_path).convert_tokens_to_ids(".")
    for name in ("config.json", "generation_config.json"):
        cfg = json.loads((folder / name).read_text())
        cfg["eos_token_id"] = period
        (folder / name).write_text(json.dumps(cfg))
    llm = LLM(str(folder))
    assert llm.engine.core.model_config.eos_token_ids == (period,)
    return llm


@pytest.fixture(autouse=True)
def pool_whole_after(request):
    yield
    for name in ("llm", "period_eos_llm"):
        if name in request.fixturenames:
            request.getfixturevalue(name).engine.core.kv.pool.check_whole()


def test_seeded_request_same_alone_and_in_batch(llm):
    p = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=40)
    alone = llm.generate(["Once upon a time"], p)[0].token_ids
    others = [SamplingParams(temperature=0.8, max_tokens=30, seed=s) for s in (None, 7, None)]
    batch = llm.generate(
        ["Lily went", "Once upon a time", "The dog", "Tim had a"],
        [others[0], p, others[1], others[2]],
    )
    assert batch[1].token_ids == alone
    assert llm.generate(["Once upon a time"], p)[0].token_ids == alone


def test_top_k_1_equals_greedy(llm):
    greedy = llm.generate(["Tim and Lily"], SamplingParams(temperature=0, max_tokens=30))[0]
    topk1 = llm.generate(["Tim and Lily"], SamplingParams(temperature=1.0, top_k=1, max_tokens=30))[
        0
    ]
    assert topk1.token_ids == greedy.token_ids


def test_stop_string_ends_output_before_it(llm):
    full = llm.generate([[1]], SamplingParams(temperature=0, max_tokens=60))[0].text
    out = llm.generate([[1]], SamplingParams(temperature=0, max_tokens=60, stop=["Lily."]))[0]
    assert out.finish_reason == "stop" and out.outputs[0].stop_reason == "Lily."
    assert out.text == full[: full.index("Lily.")]
    kept = llm.generate(
        [[1]],
        SamplingParams(
            temperature=0, max_tokens=60, stop=["Lily."], include_stop_str_in_output=True
        ),
    )[0]
    assert kept.text == full[: full.index("Lily.") + len("Lily.")]


def test_stop_token_ids_and_eos(llm, period_eos_llm):
    full = llm.generate([[1]], SamplingParams(temperature=0, max_tokens=20))[0].token_ids
    out = llm.generate(
        [[1]], SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[full[5]])
    )[0]
    assert out.token_ids == full[: full.index(full[5]) + 1]
    assert out.finish_reason == "stop" and out.outputs[0].stop_reason == full[5]

    # The model's EOS ends the output (kept as its last token id), with no stop reason.
    (eos,) = period_eos_llm.engine.core.model_config.eos_token_ids
    assert eos not in full[:10] and eos in full  # it comes early, but not at once
    out = period_eos_llm.generate([[1]], SamplingParams(temperature=0, max_tokens=20))[0]
    assert out.token_ids == full[: full.index(eos) + 1]
    assert out.finish_reason == "stop" and out.outputs[0].stop_reason is None
    assert out.text.endswith("Lily.")


def test_min_tokens_and_ignore_eos_lengths(period_eos_llm):
    llm = period_eos_llm
    (eos,) = llm.engine.core.model_config.eos_token_ids
    early = llm.generate([[1]], SamplingParams(temperature=0, max_tokens=60))[0]
    assert early.finish_reason == "stop" and early.token_ids[-1] == eos
    n_early = len(early.token_ids)
    assert n_early < 20

    # min_tokens: EOS is masked until that many tokens exist, then it may end the output again.
    min_tokens = n_early + 10
    params = SamplingParams(temperature=0, max_tokens=60, min_tokens=min_tokens)
    out = llm.generate([[1]], params)[0]
    assert len(out.token_ids) >= min_tokens
    assert eos not in out.token_ids[:min_tokens]
    assert out.token_ids[: n_early - 1] == early.token_ids[:-1]  # the same text up to the EOS
    assert out.finish_reason == "stop" and out.token_ids[-1] == eos  # a later EOS ends it
    # Stop token ids are held back the same way (this one would end the output at 3 tokens).
    stop_id = early.token_ids[2]
    out = llm.generate(
        [[1]],
        SamplingParams(temperature=0, max_tokens=60, min_tokens=8, stop_token_ids=[stop_id]),
    )[0]
    assert len(out.token_ids) >= 8 and stop_id not in out.token_ids[:8]

    # ignore_eos: the output runs to max_tokens, past every EOS the model emits.
    out = llm.generate([[1]], SamplingParams(temperature=0, max_tokens=300, ignore_eos=True))[0]
    assert len(out.token_ids) == 300 and out.finish_reason == "length"
    assert eos in out.token_ids[:n_early]


def test_n_completions_share_prompt_blocks_and_differ(llm):
    prompt = "Once upon a time there was a big dog named Max who liked to run in the park"
    out = llm.generate([prompt], SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=20))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    # Children 1..3 found the prompt's full blocks published by child 0 in the same step.
    m = [c.metrics.num_cached_tokens for c in out.outputs]
    assert m[0] == 0 and all(x == (len(out.prompt_token_ids) - 1) // 16 * 16 for x in m[1:])


def test_abort_mid_generation_returns_blocks(stories_path):
    engine = LLMEngine(EngineArgs(model=stories_path))
    engine.add_request("a", "Once upon a time", SamplingParams(temperature=0, max_tokens=100))
    engine.add_request("b", "Lily", SamplingParams(temperature=0, max_tokens=5))
    for _ in range(3):
        engine.step()
    engine.abort_request("a")
    while engine.has_unfinished:
        engine.step()
    engine.core.kv.pool.check_whole()
    assert not engine.core.scheduler.requests


def test_logprobs_top_k(llm):
    out = llm.generate(["Lily"], SamplingParams(temperature=0, max_tokens=5, logprobs=3))[0]
    lps = out.outputs[0].logprobs
    assert len(lps) == 5
    for lp, tok in zip(lps, out.token_ids):
        assert lp.token_id == tok and len(lp.top) == 3
        assert lp.top[0][0] == tok  # greedy: the chosen token is the most likely
        assert lp.logprob == pytest.approx(lp.top[0][1])


def test_metrics_are_consistent(llm):
    out = llm.generate(["Once upon"], SamplingParams(temperature=0, max_tokens=10))[0]
    m = out.metrics
    assert m.arrival_time <= m.scheduled_time <= m.first_token_time <= m.finished_time
    assert len(m.token_times) == 10 and len(m.itl) == 9
    assert m.ttft == pytest.approx(m.queue_time + m.prefill_time)
    assert m.tpot == pytest.approx((m.finished_time - m.first_token_time) / 9)


# ---- bad input: a clear ValueError naming the field and the value ------------------------


@pytest.mark.parametrize(
    ("prompt", "params", "match"),
    [
        ("", SamplingParams(), "prompt.*empty"),
        ([], SamplingParams(), "empty"),
        ("x " * 600, SamplingParams(max_tokens=1), "but this model's context is"),
        ("hi", SamplingParams(max_tokens=600), "max_tokens=600"),
        ([1, 99999], SamplingParams(), "token id 99999"),
    ],
)
def test_bad_requests_raise_clear_errors(llm, prompt, params, match):
    with pytest.raises(ValueError, match=match):
        llm.generate([prompt] if prompt != [] else prompt, params)
    assert not llm.engine.has_unfinished


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_tokens": -1}, "max_tokens=-1"),
        ({"temperature": -0.5}, "temperature=-0.5"),
        ({"top_p": 0.0}, "top_p=0.0"),
        ({"top_p": 1.5}, "top_p=1.5"),
        ({"n": 0}, "n=0"),
        ({"min_p": 2.0}, "min_p=2.0"),
        ({"logprobs": 5000}, "logprobs=5000"),
        ({"prompt_logprobs": -1}, "prompt_logprobs=-1"),
        ({"temperature": float("nan")}, "temperature=nan"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty=inf"),
        ({"seed": 2**64}, "seed="),
    ],
)
def test_bad_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_one_bad_prompt_queues_nothing(llm):
    with pytest.raises(ValueError):
        llm.generate(["fine", ""], SamplingParams(max_tokens=2))
    assert not llm.engine.has_unfinished


def test_unknown_architecture(tmp_path, stories_path):
    bad = tmp_path / "m"
    shutil.copytree(stories_path, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        LLM(str(bad))


def test_config_missing_fields(tmp_path, stories_path):
    bad = tmp_path / "m"
    shutil.copytree(stories_path, bad)
    cfg = json.loads((bad / "config.json").read_text())
    del cfg["hidden_size"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="missing field.*hidden_size"):
        LLM(str(bad))


def test_missing_weight_file(tmp_path, stories_path):
    bad = tmp_path / "m"
    shutil.copytree(stories_path, bad)
    (bad / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        LLM(str(bad))


def test_corrupt_weight_file_names_the_file(tmp_path, stories_path):
    bad = tmp_path / "m"
    shutil.copytree(stories_path, bad)
    data = (bad / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="model.safetensors"):
        LLM(str(bad))


def test_missing_tensor_names_the_tensor(tmp_path, stories_path):
    from safetensors.torch import load_file, save_file

    bad = tmp_path / "m"
    shutil.copytree(stories_path, bad)
    tensors = load_file(str(bad / "model.safetensors"))
    del tensors["model.layers.3.mlp.up_proj.weight"]
    save_file(tensors, str(bad / "model.safetensors"))
    with pytest.raises(ValueError, match="model.safetensors: model.layers.3.mlp.up_proj.weight"):
        LLM(str(bad))


def test_wrong_shape_tensor_names_the_tensor(tmp_path, stories_path):
    from safetensors.torch import load_file, save_file

    bad = tmp_path / "m"
    shutil.copytree(stories_path, bad)
    tensors = load_file(str(bad / "model.safetensors"))
    tensors["model.norm.weight"] = tensors["model.norm.weight"][:10].clone()
    save_file(tensors, str(bad / "model.safetensors"))
    with pytest.raises(ValueError, match="model.norm.weight.*shape"):
        LLM(str(bad))


def test_unknown_engine_argument(stories_path):
    with pytest.raises(ValueError, match="max_batch"):
        LLM(stories_path, max_batch=3)


def test_no_max_tokens_runs_to_the_kv_capacity(stories_path):
    small = LLM(stories_path, num_kv_blocks=8)  # 128 token slots, context 512
    out = small.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=None))[0]
    assert len(out.prompt_token_ids) + len(out.token_ids) == 128
    assert out.finish_reason == "length"
    with pytest.raises(ValueError, match="exceed the KV cache"):
        small.generate(["Once upon a time"], SamplingParams(max_tokens=200))
    small.engine.core.kv.pool.check_whole()


@pytest.mark.slow  # ~5 s: two engines with a full warm-up each
def test_startup_warm_up_leaves_no_trace(stories_path):
    """The warm-up forward at startup (on by default) holds no block, records no step, caches
    no prefix, writes no cache row and changes no output: a run after it is token for token a
    run without it."""
    prompts = ["Once upon a time", "The cat sat on the mat and", "Lily went to the park"]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outputs = {}
    for warmup in (True, False):
        engine = LLMEngine(EngineArgs(model=stories_path, warmup=warmup))
        core = engine.core
        assert core.last_step is None
        assert core.kv.num_free_blocks() == core.kv.num_blocks and not core.kv.pool.cached
        assert not any(c.any() for c in core.runner.kv_caches)  # its K/V went to a scratch copy
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, params)
        done = {}
        while engine.has_unfinished:
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0].token_ids
        outputs[warmup] = done
        core.kv.pool.check_whole()
    assert outputs[True] == outputs[False] and len(outputs[True]) == len(prompts)
