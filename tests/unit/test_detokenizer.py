"""IncrementalDetokenizer: streamed text equals the full decode, stop strings cut it."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from pdserve.frontend.detokenizer import MAX_PENDING_TOKENS, IncrementalDetokenizer

MODEL_DIR = Path(__file__).resolve().parents[3] / "shared" / "models" / "stories260K"
BOS_ID, EOS_ID = 1, 2
BYTE_FALLBACK_OFFSET = 3  # stories260K: ids 3..258 are <0x00>..<0xFF>

STORY = (
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the "
    "park with her big red ball. One day, she saw a small dog under a tree.\n"
    '"Hello, little dog!" said Lily. "Do you want to play with me?"\n'
    "The dog wagged its tail and barked happily. They ran and jumped all day long, until the "
    "sun went down. Lily's mom called her home for dinner. Lily hugged the dog and said, "
    '"See you tomorrow, my friend." The dog was happy, and Lily was happy too.  The end.'
)
MULTI_BYTE_TEXTS = ["café", "5 €", "I like 🐶 dogs", "你好, 世界", "naïve 😀 😀"]


@pytest.fixture(scope="module")
def llama_tokenizer():
    if not MODEL_DIR.is_dir():
        pytest.skip(f"missing {MODEL_DIR}")
    return AutoTokenizer.from_pretrained(MODEL_DIR)


@pytest.fixture(scope="module")
def byte_level_tokenizer():
    """GPT-2 style byte-level BPE: the 256 byte tokens plus two merges that cut characters."""
    byte_chars = _gpt2_byte_chars()
    vocab = {byte_chars[b]: b for b in range(256)}
    merge_pairs = [(0xE4, 0xBD), (0xA0, 0xE5)]  # "你" = E4 BD A0, "好" = E5 A5 BD
    merges = []
    for first, second in merge_pairs:
        pair = (byte_chars[first], byte_chars[second])
        vocab["".join(pair)] = len(vocab)
        merges.append(pair)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=backend)


def _gpt2_byte_chars() -> dict[int, str]:
    """GPT-2's byte -> printable char table: printable Latin-1 bytes map to themselves."""
    printable = {*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    chars, num_shifted = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + num_shifted)
            num_shifted += 1
    return chars


def byte_fallback_ids(text: str) -> list[int]:
    return [BYTE_FALLBACK_OFFSET + b for b in text.encode()]


def stream(
    detok: IncrementalDetokenizer, output_ids: Sequence[int], step: int = 1
) -> tuple[list[str], str | None]:
    """Feeds ids `step` at a time, taking a delta after each; returns (deltas, stop string)."""
    deltas, stop = [], None
    for start in range(0, len(output_ids), step):
        stop = detok.add_tokens(output_ids[start : start + step])
        deltas.append(detok.take_delta(finished=stop is not None))
        if stop is not None:
            return deltas, stop
    deltas.append(detok.take_delta(finished=True))
    return deltas, stop


def continuation(tokenizer, prompt_ids: list[int], output_ids: list[int]) -> str:
    """The text that `output_ids` add to the decoded prompt."""
    prompt_text = tokenizer.decode(prompt_ids, skip_special_tokens=True)
    full_text = tokenizer.decode(prompt_ids + output_ids, skip_special_tokens=True)
    return full_text[len(prompt_text) :]


def test_streaming_a_long_story_equals_full_decode(llama_tokenizer):
    output_ids = llama_tokenizer.encode(STORY, add_special_tokens=False)
    detok = IncrementalDetokenizer(llama_tokenizer, [BOS_ID])

    deltas, stop = stream(detok, output_ids)

    assert stop is None
    assert detok.output_text == llama_tokenizer.decode(output_ids) == "".join(deltas)
    assert detok.token_ids == output_ids
    assert detok.num_output_tokens == len(output_ids)


def test_streaming_without_prompt_equals_full_decode(llama_tokenizer):
    output_ids = llama_tokenizer.encode(STORY, add_special_tokens=False)
    detok = IncrementalDetokenizer(llama_tokenizer, [])

    deltas, _ = stream(detok, output_ids)

    assert "".join(deltas) == detok.output_text == llama_tokenizer.decode(output_ids)


@pytest.mark.parametrize("num_prompt_tokens", [1, 3, 17, 40])
def test_first_output_token_keeps_its_leading_space(llama_tokenizer, num_prompt_tokens):
    ids = llama_tokenizer.encode(STORY)  # with <s>
    prompt_ids, output_ids = ids[:num_prompt_tokens], ids[num_prompt_tokens:]
    detok = IncrementalDetokenizer(llama_tokenizer, prompt_ids)

    deltas, _ = stream(detok, output_ids)

    expected = continuation(llama_tokenizer, prompt_ids, output_ids)
    assert "".join(deltas) == detok.output_text == expected
    if num_prompt_tokens > 1:
        assert expected.startswith(" ")


@pytest.mark.parametrize("text", MULTI_BYTE_TEXTS)
def test_byte_fallback_characters_never_stream_replacement_chars(llama_tokenizer, text):
    prompt_ids = llama_tokenizer.encode("Once upon a time")
    for output_ids in (byte_fallback_ids(text), llama_tokenizer.encode(text)[1:]):
        detok = IncrementalDetokenizer(llama_tokenizer, prompt_ids)

        deltas, _ = stream(detok, output_ids)

        assert not any("\ufffd" in delta for delta in deltas)
        assert "".join(deltas) == continuation(llama_tokenizer, prompt_ids, output_ids)
        assert text.split()[-1] in detok.output_text


def test_byte_fallback_ids_of_a_character_emit_it_once_complete(llama_tokenizer):
    detok = IncrementalDetokenizer(llama_tokenizer, [BOS_ID])
    emoji_ids = byte_fallback_ids("😀")  # four byte tokens

    for token_id in emoji_ids[:-1]:
        detok.add_tokens([token_id])
        assert detok.take_delta(finished=False) == ""
    detok.add_tokens(emoji_ids[-1:])

    assert detok.take_delta(finished=False) == "😀"


def test_invalid_bytes_do_not_grow_the_window_without_bound(llama_tokenizer):
    detok = IncrementalDetokenizer(llama_tokenizer, [BOS_ID])
    stray_continuation_byte = byte_fallback_ids("é")[1]

    detok.add_tokens([stray_continuation_byte] * (3 * MAX_PENDING_TOKENS))

    delta = detok.take_delta(finished=False)

    assert delta.count("\ufffd") >= 2 * MAX_PENDING_TOKENS  # emitted while still running


@pytest.mark.parametrize("step", [1, 2, 1000])
def test_stop_string_spanning_tokens_cuts_the_output(llama_tokenizer, step):
    output_ids = llama_tokenizer.encode(STORY, add_special_tokens=False)
    stop = "little girl"  # tokens "▁little", "▁girl"
    detok = IncrementalDetokenizer(llama_tokenizer, [BOS_ID], stop=[stop])

    deltas, matched = stream(detok, output_ids, step)

    assert matched == stop == detok.stop_reason
    assert detok.output_text == "Once upon a time, there was a "
    assert "".join(deltas) == detok.output_text
    assert llama_tokenizer.decode(detok.token_ids).endswith(stop)


def test_stop_string_is_kept_when_include_stop_str_in_output(llama_tokenizer):
    output_ids = llama_tokenizer.encode(STORY, add_special_tokens=False)
    detok = IncrementalDetokenizer(
        llama_tokenizer, [BOS_ID], stop=["little girl"], include_stop_str_in_output=True
    )

    deltas, _ = stream(detok, output_ids)

    assert detok.output_text == "Once upon a time, there was a little girl"
    assert "".join(deltas) == detok.output_text


def test_stop_string_ending_inside_a_token_drops_the_rest_of_it(llama_tokenizer):
    output_ids = llama_tokenizer.encode(STORY, add_special_tokens=False)
    detok = IncrementalDetokenizer(llama_tokenizer, [BOS_ID], stop=["upo"])

    stream(detok, output_ids)

    assert detok.output_text == "Once "


def test_earliest_stop_string_wins_when_several_match_in_one_step(llama_tokenizer):
    output_ids = llama_tokenizer.encode(STORY, add_special_tokens=False)
    detok = IncrementalDetokenizer(llama_tokenizer, [BOS_ID], stop=["time", "upon"])

    matched = detok.add_tokens(output_ids)

    assert matched == "upon"
    assert detok.output_text == "Once "


def test_tokens_after_the_stop_are_dropped_and_ignored(llama_tokenizer):
    output_ids = llama_tokenizer.encode(STORY, add_special_tokens=False)
    detok = IncrementalDetokenizer(llama_tokenizer, [BOS_ID], stop=["time"])

    assert detok.add_tokens(output_ids) == "time"
    assert detok.add_tokens(output_ids) is None

    assert detok.num_output_tokens == 4  # "▁Once", "▁upon", "▁a", "▁time"
    assert detok.output_text == "Once upon a "


def test_stop_strings_wait_for_min_tokens(llama_tokenizer):
    output_ids = llama_tokenizer.encode(STORY, add_special_tokens=False)
    detok = IncrementalDetokenizer(llama_tokenizer, [BOS_ID], stop=["Lily"], min_tokens=20)

    stream(detok, output_ids)

    assert detok.output_text.count("Lily") == 1  # the name at token < 20 does not stop
    assert detok.output_text.endswith("said ")


@pytest.mark.parametrize("stops", [["upon a mouse"], ["park with him", "dog!!"], ["Lily's dad"]])
def test_take_delta_never_streams_a_partial_stop_string(llama_tokenizer, stops):
    output_ids = llama_tokenizer.encode(STORY, add_special_tokens=False)
    detok = IncrementalDetokenizer(llama_tokenizer, [BOS_ID], stop=stops)
    streamed = ""

    for token_id in output_ids:
        assert detok.add_tokens([token_id]) is None
        streamed += detok.take_delta(finished=False)
        text = detok.output_text
        assert text.startswith(streamed)
        for s in stops:  # a tail that may grow into a stop string is still withheld
            tails = [n for n in range(1, len(s)) if text.endswith(s[:n])]
            assert all(len(text) - n >= len(streamed) for n in tails)
    streamed += detok.take_delta(finished=True)

    assert streamed == detok.output_text == llama_tokenizer.decode(output_ids)


def test_take_delta_withholds_at_most_the_longest_stop_prefix(llama_tokenizer):
    ids = llama_tokenizer.encode("Once upon a", add_special_tokens=False)
    detok = IncrementalDetokenizer(llama_tokenizer, [BOS_ID], stop=["a mouse", "zzz"])

    detok.add_tokens(ids)

    assert detok.take_delta(finished=False) == "Once upon "  # "a" may start "a mouse"
    assert detok.take_delta(finished=True) == "a"


def test_skip_special_tokens_hides_eos(llama_tokenizer):
    output_ids = llama_tokenizer.encode("The end.", add_special_tokens=False) + [EOS_ID]
    hidden = IncrementalDetokenizer(llama_tokenizer, [BOS_ID])
    shown = IncrementalDetokenizer(llama_tokenizer, [BOS_ID], skip_special_tokens=False)

    hidden_deltas, _ = stream(hidden, output_ids)
    shown_deltas, _ = stream(shown, output_ids)

    assert "".join(hidden_deltas) == hidden.output_text == "The end."
    assert "".join(shown_deltas) == shown.output_text == "The end.</s>"


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_output_after_a_special_token_starts_without_a_space(llama_tokenizer, skip_special_tokens):
    prompt_ids = [*llama_tokenizer.encode("Once upon"), EOS_ID]
    output_ids = llama_tokenizer.encode("a time", add_special_tokens=False)
    detok = IncrementalDetokenizer(
        llama_tokenizer, prompt_ids, skip_special_tokens=skip_special_tokens
    )

    deltas, _ = stream(detok, output_ids)

    assert "".join(deltas) == detok.output_text == llama_tokenizer.decode(output_ids) == "a time"


def test_skip_special_tokens_hides_eos_in_the_middle(llama_tokenizer):
    output_ids = [*llama_tokenizer.encode("The end.", add_special_tokens=False), EOS_ID]
    output_ids += llama_tokenizer.encode("Once", add_special_tokens=False)
    detok = IncrementalDetokenizer(llama_tokenizer, [BOS_ID])

    deltas, _ = stream(detok, output_ids)

    assert "</s>" not in detok.output_text
    assert "".join(deltas) == detok.output_text == llama_tokenizer.decode(output_ids, True)


@pytest.mark.parametrize("text", MULTI_BYTE_TEXTS + [STORY])
def test_byte_level_bpe_multi_byte_characters_stream_whole(byte_level_tokenizer, text):
    output_ids = byte_level_tokenizer.encode(text, add_special_tokens=False)
    prompt_ids = byte_level_tokenizer.encode("héllo ", add_special_tokens=False)
    detok = IncrementalDetokenizer(byte_level_tokenizer, prompt_ids)

    deltas, _ = stream(detok, output_ids)

    assert not any("\ufffd" in delta for delta in deltas)
    assert "".join(deltas) == detok.output_text == byte_level_tokenizer.decode(output_ids) == text


def test_byte_level_bpe_merged_tokens_that_cut_characters(byte_level_tokenizer):
    output_ids = byte_level_tokenizer.encode("你好", add_special_tokens=False)
    detok = IncrementalDetokenizer(byte_level_tokenizer, [])

    deltas, _ = stream(detok, output_ids)

    assert len(output_ids) == 4  # [E4 BD] [A0 E5] [A5] [BD]
    assert deltas == ["", "", "", "你好", ""]


def test_byte_level_bpe_stop_string_with_multi_byte_characters(byte_level_tokenizer):
    output_ids = byte_level_tokenizer.encode("I like 🐶 dogs 你好 a lot", add_special_tokens=False)
    detok = IncrementalDetokenizer(byte_level_tokenizer, [], stop=["你好"])

    deltas, matched = stream(detok, output_ids)

    assert matched == "你好"
    assert "".join(deltas) == detok.output_text == "I like 🐶 dogs "


def first_stop_cut(text: str, stops: list[str]) -> str:
    """Reference: cut `text` before the stop string that completes first (char by char)."""
    ends = [(text.find(s) + len(s), text.find(s)) for s in stops if s in text]
    return text[: min(ends)[1]] if ends else text


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="ab c", max_size=40),
    stops=st.lists(st.text(alphabet="ab c", min_size=1, max_size=4), min_size=1, max_size=3),
)
def test_stop_strings_match_a_char_by_char_reference(byte_level_tokenizer, text, stops):
    output_ids = byte_level_tokenizer.encode(text, add_special_tokens=False)  # a token per char
    detok = IncrementalDetokenizer(byte_level_tokenizer, [], stop=stops)
    streamed = ""

    for token_id in output_ids:
        if detok.add_tokens([token_id]) is not None:
            break
        streamed += detok.take_delta(finished=False)
        assert not any(stop in streamed for stop in stops)
    streamed += detok.take_delta(finished=True)

    assert streamed == detok.output_text == first_stop_cut(text, stops)
