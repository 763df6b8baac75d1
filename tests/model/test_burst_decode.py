"""Bursts (`--num-scheduler-steps`) end to end: several greedy decode steps per native call.

The tokens are transformers' greedy tokens (the reference) and the engine's own of one step per
schedule, in batches whose requests end at different lengths, with a stop token met inside a
burst, and with int8 weights and KV; bursts really run (the native call is counted), and every
KV block comes back. The scheduler's side alone is tests/unit/test_sched_bursts.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.kernels import build

pytestmark = pytest.mark.skipif(not build.compiler_present(), reason="no C compiler here")

PROMPT_LENS = [3, 17, 40, 9]
NEW_TOKENS = 29  # not a multiple of the bursts: the last one is cut at the length


def prompts(vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(3)
    return [rng.integers(3, vocab, n).tolist() for n in PROMPT_LENS]


def greedy(max_tokens: int = NEW_TOKENS, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def counting_bursts(llm: LLM) -> list[int]:
    """The step count of every burst `llm`'s fused decode step runs from now on."""
    fused = llm.engine.core.runner.model.fused_decode
    calls: list[int] = []
    run = fused.burst
    fused.burst = lambda tokens, pos, slots, steps, caches: (
        calls.append(steps) or run(tokens, pos, slots, steps, caches)
    )
    return calls


def all_blocks_back(llm: LLM) -> bool:
    kv = llm.engine.core.kv
    return kv.num_free_blocks() == kv.num_blocks and not kv.req_block_ids


def test_bursts_give_transformers_greedy_tokens(tiny_models):
    from transformers import AutoModelForCausalLM

    path = tiny_models["llama"]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    batch = prompts(hf.config.vocab_size)
    refs = []
    for p in batch:
        ids = torch.tensor([p])
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=NEW_TOKENS, eos_token_id=None, pad_token_id=0)  # fmt: skip
        refs.append(out[0, len(p) :].tolist())
    llm = LLM(path, num_scheduler_steps=8)
    bursts = counting_bursts(llm)
    outs = llm.generate(batch, greedy())
    assert [o.outputs[0].token_ids for o in outs] == refs
    # the first token comes from the prompt step, then 28 in bursts of 8, 8, 8 and 4
    assert bursts == [8, 8, 8, 4]
    assert all_blocks_back(llm)


@pytest.mark.parametrize("kw", [{}, {"quantization": "int8", "kv_cache_dtype": "int8"}])
def test_bursts_give_the_tokens_of_one_step_per_schedule(tiny_models, kw):
    """Requests of different lengths in one batch: each burst ends where the shortest request
    ends, the others go on in the next ones."""
    path = tiny_models["qwen3"]  # per-head q/k norms in the native loop too
    one, many = LLM(path, **kw), LLM(path, num_scheduler_steps=5, **kw)
    batch = prompts(one.engine.core.model_config.vocab_size)
    params = [greedy(n) for n in (7, 29, 12, 1)]
    bursts = counting_bursts(many)
    a, b = one.generate(batch, params), many.generate(batch, params)
    assert [o.outputs[0].token_ids for o in b] == [o.outputs[0].token_ids for o in a]
    assert [len(o.outputs[0].token_ids) for o in b] == [7, 29, 12, 1]
    assert bursts and max(bursts) == 5 and sum(bursts) < 7 + 29 + 12
    assert all_blocks_back(many)


def test_a_stop_token_inside_a_burst_ends_the_output_there(tiny_models):
    path = tiny_models["llama"]
    one, many = LLM(path), LLM(path, num_scheduler_steps=8)
    batch = prompts(one.engine.core.model_config.vocab_size)[:2]
    full = one.generate(batch, greedy())[0].outputs[0].token_ids
    stop = full[11]  # the 12th token: inside the second burst
    cut = full[: full.index(stop) + 1]
    params = greedy(stop_token_ids=[stop])
    a, b = one.generate(batch, params), many.generate(batch, params)
    assert b[0].outputs[0].token_ids == a[0].outputs[0].token_ids == cut
    assert b[0].outputs[0].finish_reason == "stop"
    assert [o.outputs[0].token_ids for o in b] == [o.outputs[0].token_ids for o in a]
    assert all_blocks_back(many)


def test_sampled_requests_and_logprobs_take_one_step_per_schedule(tiny_models):
    llm = LLM(tiny_models["llama"], num_scheduler_steps=8)
    bursts = counting_bursts(llm)
    batch = prompts(llm.engine.core.model_config.vocab_size)[:2]
    llm.generate(batch, [greedy(), SamplingParams(temperature=0.7, max_tokens=9, seed=1)])
    assert bursts and sum(bursts) <= NEW_TOKENS - 9  # none while the sampled one ran
    bursts.clear()
    outs = llm.generate(batch, greedy(logprobs=0))
    assert not bursts and all(len(o.outputs[0].logprobs) == NEW_TOKENS for o in outs)
    assert all_blocks_back(llm)


def test_an_engine_without_the_fused_step_runs_one_step(tiny_models, caplog):
    path = tiny_models["llama"]
    with caplog.at_level("WARNING"):
        llm = LLM(path, num_scheduler_steps=8, enforce_eager=True)
    assert llm.engine.core.max_steps == 1 and "--num-scheduler-steps 8 ignored" in caplog.text
    batch = prompts(llm.engine.core.model_config.vocab_size)
    a = llm.generate(batch, greedy())
    b = LLM(path).generate(batch, greedy())
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]


def test_a_step_whose_layer_hooks_are_wanted_runs_one_step_of_its_burst(tiny_models):
    """A burst planned where the fused step cannot run it this step (a KV sender's hooks want
    the layers): the runner computes one step through the modules, the scheduler gives the
    burst's other blocks back, and the tokens are the same."""
    path = tiny_models["llama"]
    llm = LLM(path, num_scheduler_steps=8)
    bursts = counting_bursts(llm)
    fired: list[int] = []
    llm.engine.core.runner.add_layer_hook(fired.append, wanted=lambda: True)
    batch = prompts(llm.engine.core.model_config.vocab_size)
    planned = []
    schedule = llm.engine.core.scheduler.schedule

    def recording():
        plan = schedule()
        planned.append(plan.num_steps)
        return plan

    llm.engine.core.scheduler.schedule = recording
    out = llm.generate(batch, greedy())
    ref = LLM(path).generate(batch, greedy())
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in ref]
    assert max(planned) == 8 and not bursts  # planned, never run as bursts
    assert fired and all_blocks_back(llm)
