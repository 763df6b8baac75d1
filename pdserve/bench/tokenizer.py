"""The target model's tokenizer, as prompt construction needs it: one-token words and a counter.

Loads a Hugging Face tokenizer folder (the same files the server loads) and adapts it to
`workload.PromptTokenizer`. Counting follows the endpoint: `/v1/completions` encodes the prompt
with special tokens (BOS), `/v1/chat/completions` applies the chat template with the generation
prompt, as OpenAI-compatible servers do.
"""

from __future__ import annotations

import string
from collections import Counter
from pathlib import Path
from typing import Any

from pdserve.bench.errors import BenchError

_DECODE_BATCH = 8192
_MIN_WORDS = 16  # fewer one-token words than this: write prompts with characters


def load_tokenizer(path: str | Path) -> Any:
    """The server's tokenizer (`pdserve.frontend.tokenizer`), with a one-line error when it
    cannot load."""
    if not Path(path).is_dir():
        raise BenchError(f"tokenizer folder not found: {path}")
    from pdserve.frontend.tokenizer import load_tokenizer as load

    try:
        return load(path)
    except ValueError as e:  # says which folder already
        raise BenchError(_first_line(e)) from None
    except Exception as e:  # transformers raises many kinds; the user needs only the gist
        raise BenchError(f"cannot load a tokenizer from {path}: {_first_line(e)}") from None


class HFPromptTokenizer:
    """A Hugging Face tokenizer seen as `workload.PromptTokenizer`."""

    def __init__(self, tokenizer: Any, chat: bool = False) -> None:
        self.tokenizer = tokenizer
        self.chat = chat
        self.offset = 0  # added to every count: what the server counts beyond the tokenizer
        if chat and not getattr(tokenizer, "chat_template", None):
            raise BenchError(
                "the tokenizer has no chat template: use --endpoint completions or pass "
                "--tokenizer with one"
            )
        self.words, self.separator = prompt_alphabet(tokenizer)
        if not self.words:
            raise BenchError("the tokenizer has no single-token words to build prompts from")

    def count(self, prompts: list[str]) -> list[int]:
        if self.chat:  # the template writes any BOS itself, as in `apply_chat_template`
            texts = [self._chat_text(p) for p in prompts]
            ids = self.tokenizer(texts, add_special_tokens=False, verbose=False).input_ids
        else:
            ids = self.tokenizer(prompts, add_special_tokens=True, verbose=False).input_ids
        return [len(x) + self.offset for x in ids]

    def _chat_text(self, prompt: str) -> str:
        return self.tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
        )


def prompt_alphabet(tokenizer: Any) -> tuple[list[str], str]:
    """The units prompts are written with, and what joins them: words joined by spaces when the
    vocabulary has enough of them, else characters that stay one token each when concatenated
    (byte-level vocabularies without merges, like `pdserve make-model`'s)."""
    words = single_token_words(tokenizer)
    if len(words) >= _MIN_WORDS:
        return words, " "
    chars = single_token_chars(tokenizer)
    return (chars, "") if len(chars) > len(words) else (words, " ")


def single_token_chars(tokenizer: Any) -> list[str]:
    """ASCII letters and digits that are one token each, also when any two are concatenated."""
    candidates = list(string.ascii_letters + string.digits)
    chars = [c for c, n in zip(candidates, _num_tokens(tokenizer, candidates)) if n == 1]
    pairs = [(a, b) for a in chars for b in chars]
    counts = _num_tokens(tokenizer, [a + b for a, b in pairs])
    merging = {pair for pair, n in zip(pairs, counts) if n != 2}
    while merging:  # drop the character in most merging pairs until none is left
        worst = Counter(c for pair in merging for c in pair).most_common(1)[0][0]
        chars.remove(worst)
        merging = {pair for pair in merging if worst not in pair}
    return chars


def single_token_words(tokenizer: Any) -> list[str]:
    """ASCII words that encode to exactly one token both first in a text and after a space
    (`"w w"` is two tokens), in vocabulary order: the alphabet of benchmark prompts."""
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    ids = [i for i in range(len(tokenizer)) if i not in special]
    candidates: dict[str, None] = {}
    for start in range(0, len(ids), _DECODE_BATCH):
        texts = tokenizer.batch_decode([[i] for i in ids[start : start + _DECODE_BATCH]])
        for text in texts:
            word = text.strip()
            if word.isascii() and word.isalpha():
                candidates[word] = None
    words = list(candidates)
    pair_counts = _num_tokens(tokenizer, [f"{w} {w}" for w in words])
    return [w for w, n in zip(words, pair_counts) if n == 2]


def _num_tokens(tokenizer: Any, texts: list[str]) -> list[int]:
    if not texts:
        return []
    ids = tokenizer(texts, add_special_tokens=False, verbose=False).input_ids
    return [len(x) for x in ids]


def _first_line(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else e.__class__.__name__
