"""Incremental detokenization and stop-string matching for one output sequence.

Each new token decodes a small window of ids, `[prefix_offset:]`, and emits only the text that
window adds beyond `[prefix_offset:read_offset]`. The window starts inside the prompt tail, so a
SentencePiece token's leading space comes out as the full decode renders it, and text is held back
while it ends in U+FFFD (a multi-byte character split over byte tokens). Stop strings are searched
only in the new text plus a tail of `len(stop) - 1` chars; `take_delta` withholds any tail that
could still grow into a stop string, so streamed text never contains one.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

# Prompt tokens kept in front of the output so the first window has left context.
# The context starts after the last special token: text after a special token (a BOS, a chat
# turn marker) decodes as a fresh start, the way `tokenizer.decode(output_ids)` renders it.
NUM_PROMPT_CONTEXT_TOKENS = 5
# A valid UTF-8 character needs at most 4 byte tokens. A window that stays undecodable for longer
# holds invalid bytes (or empty special tokens); emit it as is rather than let the window grow.
MAX_PENDING_TOKENS = 8

_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns one sequence's output token ids into text, token by token, and finds stop strings.

    Usage per engine step: `stop = add_tokens(new_ids)`; finish the request if `stop` is not None;
    then stream `take_delta(finished)`. After `take_delta(finished=True)`, `output_text` (cut at
    the stop string, if one hit) equals `tokenizer.decode(output_ids)` when the prompt is empty or
    ends in a special token such as BOS; after prompt text it equals what the full decode adds to
    the prompt's, so a SentencePiece word keeps its leading space. Valid UTF-8 comes out exactly;
    runs of invalid bytes may render their U+FFFD differently from a one-shot decode.
    """

    __slots__ = (
        "_decode",
        "_ids",
        "_num_prompt_context",
        "_prefix_offset",
        "_read_offset",
        "_text",
        "_num_sent_chars",
        "_stop",
        "_include_stop_str",
        "_min_tokens",
        "stop_reason",
    )

    def __init__(
        self,
        tokenizer,
        prompt_token_ids: Sequence[int],
        *,
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
    ) -> None:
        """`min_tokens`: stop strings only count once the output has at least this many tokens."""
        self._decode = _make_decode(tokenizer, skip_special_tokens)
        context = _prompt_context(tokenizer, prompt_token_ids)
        self._ids: list[int] = context  # prompt context, then every output id
        self._num_prompt_context = len(context)
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._text = ""
        self._num_sent_chars = 0
        self._stop = tuple(stop)
        self._include_stop_str = include_stop_str_in_output
        self._min_tokens = min_tokens
        self.stop_reason: str | None = None  # the stop string that ended the text, if any

    @property
    def output_text(self) -> str:
        """All text so far; text after a matched stop string is never included."""
        return self._text

    @property
    def token_ids(self) -> list[int]:
        """Output token ids accepted so far (a copy)."""
        return self._ids[self._num_prompt_context :]

    @property
    def num_output_tokens(self) -> int:
        return len(self._ids) - self._num_prompt_context

    @property
    def stopped(self) -> bool:
        return self.stop_reason is not None

    def add_tokens(self, new_token_ids: Sequence[int]) -> str | None:
        """Append newly generated ids; returns the stop string that matched, else None.

        When a stop string matches, the request must finish: ids after the one that completed it
        are dropped (`num_output_tokens` says how many were kept) and later calls are ignored.
        """
        if self.stop_reason is not None:
            return None
        for token_id in new_token_ids:
            self._ids.append(token_id)
            delta = self._decode_next()
            if not delta:
                continue
            num_old_chars = len(self._text)
            self._text += delta
            if self._stop and self.num_output_tokens >= self._min_tokens:
                stop = self._match_stop(num_old_chars)
                if stop is not None:
                    return stop
        return None

    def take_delta(self, finished: bool) -> str:
        """Text not handed out yet.

        While running, a tail that could still be the start of a stop string (at most
        `len(longest stop) - 1` chars) is withheld. `finished=True` flushes everything, including
        bytes still waiting for the rest of their character.
        """
        if finished and self.stop_reason is None:
            self._flush_pending()
        end = len(self._text)
        if not finished and self.stop_reason is None and self._stop:
            end -= self._num_chars_to_withhold()
        delta = self._text[self._num_sent_chars : end]
        self._num_sent_chars = end
        return delta

    def _decode_next(self) -> str:
        """Decodes the window after one appended id; returns the text it adds, or ""."""
        ids = self._ids
        prefix_text = self._decode(ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(ids[self._prefix_offset :])
        incomplete = len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT_CHAR)
        if incomplete and len(ids) - self._read_offset < MAX_PENDING_TOKENS:
            return ""  # wait for the rest of the character
        self._prefix_offset = self._read_offset
        self._read_offset = len(ids)
        return new_text[len(prefix_text) :]

    def _flush_pending(self) -> None:
        """Emits ids held back because they ended in an incomplete character."""
        if self._read_offset == len(self._ids):
            return
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        self._prefix_offset = self._read_offset = len(self._ids)
        self._text += new_text[len(prefix_text) :]

    def _match_stop(self, num_old_chars: int) -> str | None:
        """Finds the earliest stop string that ends in the text after `num_old_chars`."""
        text = self._text
        best_stop, best_index = None, len(text)
        for stop in self._stop:
            index = text.find(stop, max(0, num_old_chars - len(stop) + 1), best_index + len(stop))
            if index != -1 and index < best_index:
                best_stop, best_index = stop, index
        if best_stop is None:
            return None
        end = best_index + len(best_stop) if self._include_stop_str else best_index
        self._text = text[:end]
        self.stop_reason = best_stop
        return best_stop

    def _num_chars_to_withhold(self) -> int:
        """Length of the longest unsent tail of the text that is a proper prefix of a stop."""
        text = self._text
        num_unsent = len(text) - self._num_sent_chars
        if num_unsent == 0:
            return 0
        last_char = text[-1]
        longest = 0
        for stop in self._stop:
            # Only prefixes ending in the text's last char can match; rfind jumps between them.
            end = stop.rfind(last_char, 0, min(len(stop) - 1, num_unsent))
            while end >= longest:
                if text.endswith(stop[: end + 1]):
                    longest = end + 1
                    break
                end = stop.rfind(last_char, 0, end)
        return longest


def _prompt_context(tokenizer, prompt_token_ids: Sequence[int]) -> list[int]:
    """The prompt tail that precedes the output in the first window (see the module constant)."""
    context = list(prompt_token_ids[-NUM_PROMPT_CONTEXT_TOKENS:])
    special_ids = set(getattr(tokenizer, "all_special_ids", ()))
    for index in range(len(context) - 1, -1, -1):
        if context[index] in special_ids:
            return context[index + 1 :]
    return context


def _make_decode(tokenizer, skip_special_tokens: bool) -> Callable[[list[int]], str]:
    """The cheapest call that decodes ids exactly as `tokenizer.decode` does.

    Hugging Face fast tokenizers wrap a Rust `tokenizers.Tokenizer`; calling it directly skips
    the Python layers. Tokenizers that post-process text (`clean_up_tokenization_spaces`) keep the
    full `tokenizer.decode` path.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return functools.partial(backend.decode, skip_special_tokens=skip_special_tokens)
    return functools.partial(tokenizer.decode, skip_special_tokens=skip_special_tokens)
