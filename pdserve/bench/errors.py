"""The benchmark's user-facing error: printed by the CLI as one line, with exit code 2."""

from __future__ import annotations


class BenchError(ValueError):
    """A problem the user can fix (bad input file or flag, unreachable server), not a bug."""
