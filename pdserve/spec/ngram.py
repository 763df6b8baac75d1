"""Prompt lookup: propose what followed the latest earlier occurrence of the last n tokens.

`propose` searches the tokens directly (the reference); `NgramIndex` gives the same answer from
a table it keeps up to date as tokens are appended, so a lookup costs a few dictionary probes
however long the request is (the scheduler asks every decoding request every step).
"""

from __future__ import annotations

from collections.abc import Sequence


def propose(tokens: Sequence[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Up to `k` tokens that followed the most recent earlier occurrence of the longest suffix of
    `tokens` of `n_max` down to `n_min` tokens; [] when no suffix recurs. The match must end
    before the suffix itself starts, so a proposal is always tokens already seen."""
    n_tokens = len(tokens)
    for n in range(min(n_max, n_tokens - 1), n_min - 1, -1):
        suffix = list(tokens[n_tokens - n :])
        first = suffix[0]
        # latest start i < n_tokens - n with tokens[i : i + n] == suffix
        for i in range(n_tokens - n - 1, -1, -1):
            if tokens[i] == first and list(tokens[i : i + n]) == suffix:
                follow = tokens[i + n : i + n + k]
                if follow:
                    return list(follow)
    return []


class NgramIndex:
    """For each n-gram (n_min <= n <= n_max) of a growing token list that some token follows,
    where it last started. Feed it with `update(tokens)` after tokens are appended."""

    def __init__(self, n_min: int, n_max: int) -> None:
        self.n_min, self.n_max = n_min, n_max
        self.last: dict[tuple[int, ...], int] = {}
        self.seen = 0  # tokens indexed: every n-gram ending before position seen - 1

    def update(self, tokens: Sequence[int]) -> None:
        for end in range(
            max(self.seen, 1), len(tokens)
        ):  # token `end` follows n-grams ending at end - 1
            for n in range(self.n_min, min(self.n_max, end) + 1):
                self.last[tuple(tokens[end - n : end])] = end - n
        self.seen = len(tokens)

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """What `propose(tokens, k, n_min, n_max)` returns (call `update` first)."""
        n_tokens = len(tokens)
        for n in range(min(self.n_max, n_tokens - 1), self.n_min - 1, -1):
            i = self.last.get(tuple(tokens[n_tokens - n :]))
            if i is not None:
                return list(tokens[i + n : i + n + k])
        return []
