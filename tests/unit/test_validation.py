"""The one validator of a tokenized request (`pdserve.validation.EngineLimits`)."""

import pytest

from pdserve.validation import EngineLimits, InvalidRequest


def check(limits: EngineLimits, n: int, max_tokens: int | None, token: int = 1) -> int:
    return limits.check([token] * n, max_tokens)


def test_output_budget_is_max_tokens_or_what_the_context_and_cache_leave():
    assert check(EngineLimits(16, 100), 6, 4) == 4
    assert check(EngineLimits(16, 100), 6, None) == 10
    assert check(EngineLimits(16, 100, kv_capacity=12), 6, None) == 6
    assert check(EngineLimits(16, 100, kv_capacity=12), 6, 0) == 0  # scoring only


@pytest.mark.parametrize(
    ("limits", "n", "max_tokens", "token", "param", "code", "words"),
    [
        (EngineLimits(16, 100), 0, None, 1, "prompt", "invalid_value", "empty"),
        (EngineLimits(16, 100), 3, None, 100, "prompt", "invalid_value", "token id 100"),
        (EngineLimits(16, 100), 3, None, -1, "prompt", "invalid_value", "outside the vocabulary"),
        (EngineLimits(16, 100), 16, None, 1, "prompt", "context_length_exceeded", "16 tokens"),
        (EngineLimits(16, 100), 6, 11, 1, "max_tokens", "context_length_exceeded", "at most 10"),
        (
            EngineLimits(16, 100, max_unchunked_prompt=8),
            9,
            1,
            1,
            "prompt",
            "invalid_value",
            "max_num_batched_tokens (8)",
        ),
        (EngineLimits(64, 100, kv_capacity=12), 6, 7, 1, "max_tokens", "invalid_value", "KV"),
        (EngineLimits(64, 100, kv_capacity=12), 12, None, 1, "prompt", "invalid_value", "KV"),
    ],
)
def test_each_limit_names_the_parameter_and_the_reason(
    limits, n, max_tokens, token, param, code, words
):
    with pytest.raises(InvalidRequest) as e:
        check(limits, n, max_tokens, token)
    assert (e.value.param, e.value.code) == (param, code)
    assert words in str(e.value)


def test_frontend_and_engine_give_the_same_message(tmp_path):
    """The engine core validates with the same code: the offline message is the server's."""
    from pdserve.frontend.errors import APIError
    from pdserve.frontend.inputs import InputProcessor
    from pdserve.types import SamplingParams

    inputs = InputProcessor(tokenizer=None, tokenizer_path=None, chat_template=None)
    inputs.set_model_limits(16, 100)
    with pytest.raises(APIError) as api:
        inputs.check([1] * 6, SamplingParams(max_tokens=11), truncate=None)
    with pytest.raises(InvalidRequest) as core:
        EngineLimits(16, 100, kv_capacity=1000).check([1] * 6, 11)
    assert api.value.status == 400 and str(core.value) in str(api.value.message)
    inputs.close()
