"""Prompt lookup: propose what followed the latest earlier occurrence of the last n tokens."""

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
