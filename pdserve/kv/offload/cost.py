"""Load a block back from a tier, or compute it again: whichever this machine does faster.

Loading n blocks costs n * block_bytes / load_bandwidth; recomputing them costs
n * block_size / prefill_rate. Both rates are measured as the engine runs (exponential averages
of the tiers' verified reads, checksum included, and of prefill-only steps), so the rule follows
the model and the machine: a big model's prompt is far dearer to recompute than to read back, and
a tiny model's can be cheaper. Until both rates have been seen, a hit is loaded (that is how
the load rate gets measured). `always` loads every hit (for tests and for measuring the tier).
"""

from __future__ import annotations


class ReloadCost:
    def __init__(self, block_bytes: int, block_size: int, always: bool = False) -> None:
        self.block_bytes = block_bytes
        self.block_size = block_size
        self.always = always
        self.load_bytes_per_s: float | None = None
        self.prefill_tokens_per_s: float | None = None
        self.alpha = 0.2

    def _avg(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.alpha) * old + self.alpha * new

    def observe_load(self, num_bytes: int, seconds: float) -> None:
        if num_bytes > 0 and seconds > 0:
            self.load_bytes_per_s = self._avg(self.load_bytes_per_s, num_bytes / seconds)

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        if num_tokens > 0 and seconds > 0:
            self.prefill_tokens_per_s = self._avg(self.prefill_tokens_per_s, num_tokens / seconds)

    def load_s(self, num_blocks: int) -> float | None:
        if self.load_bytes_per_s is None:
            return None
        return num_blocks * self.block_bytes / self.load_bytes_per_s

    def recompute_s(self, num_blocks: int) -> float | None:
        if self.prefill_tokens_per_s is None:
            return None
        return num_blocks * self.block_size / self.prefill_tokens_per_s

    def worth_loading(self, num_blocks: int) -> bool:
        if self.always:
            return True
        load, compute = self.load_s(num_blocks), self.recompute_s(num_blocks)
        return load is None or compute is None or load < compute
