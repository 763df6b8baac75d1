"""`--kv-offload` specs: `cpu:SIZE` (host memory) and `disk:PATH:SIZE`, stacked in that order."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.config.settings import parse_size


@dataclass(frozen=True)
class TierSpec:
    kind: str  # "cpu" or "disk"
    capacity_bytes: int
    path: str | None = None  # disk: the directory


def parse_tier(text: str) -> TierSpec:
    try:
        return _parse(text)
    except ValueError as e:
        if str(e).startswith("invalid kv_offload"):
            raise
        raise ValueError(f"invalid kv_offload {text!r}: {e}") from None


def _parse(text: str) -> TierSpec:
    kind, _, rest = text.partition(":")
    if kind == "cpu" and rest and ":" not in rest:
        size = parse_size(rest)
        path = None
    elif kind == "disk" and ":" in rest:
        path, _, size_text = rest.rpartition(":")
        size = parse_size(size_text)
        if not path:
            raise ValueError(f"invalid kv_offload {text!r}: the disk tier needs a directory")
    else:
        raise ValueError(f"invalid kv_offload {text!r}: expected cpu:SIZE or disk:PATH:SIZE")
    if size <= 0:
        raise ValueError(f"invalid kv_offload {text!r}: the size must be > 0")
    return TierSpec(kind, size, path)


def parse_tiers(texts: tuple[str, ...] | list[str]) -> list[TierSpec]:
    """The stack, top first: at most one host tier, then at most one disk tier."""
    specs = [parse_tier(t) for t in texts]
    kinds = [s.kind for s in specs]
    if kinds not in ([], ["cpu"], ["disk"], ["cpu", "disk"]):
        raise ValueError(
            f"invalid kv_offload {list(texts)}: at most one cpu tier, then at most one disk tier"
        )
    return specs
