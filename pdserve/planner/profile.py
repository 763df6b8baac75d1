"""A deployment's cost model: step times per worker size, and KV transfer times (no torch).

A `Profile` is what the simulator needs to know of the hardware and the model: how long a step
of a given shape takes on a worker of N threads (CPU) or devices (`step_models`), how long a
prompt's KV takes to reach another worker (`transfers`, per transport), and how many bytes of KV
a token holds. `pdserve profile` measures one on this machine (`kind: "measured"`); for hardware
that is not here, `analytic_profile` builds one from datasheet peaks (`kind: "analytic"`, which
the output says). Profiles are JSON files.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from pdserve.planner.step_model import StepModel, step_model_from_dict


@dataclass(frozen=True)
class TransferModel:
    """Time to move `n` bytes of KV from a prefill to a decode worker: latency + n / rate.
    Layers ship while later layers compute, so only the last layer's share is exposed after a
    prefill (`exposed_seconds`)."""

    latency_s: float
    bytes_per_s: float

    def exposed_seconds(self, num_bytes: float, num_layers: int) -> float:
        return self.latency_s + num_bytes / max(num_layers, 1) / self.bytes_per_s


@dataclass
class Profile:
    kind: str  # "measured" (on this machine) or "analytic" (datasheet peaks, efficiency factors)
    description: str  # the hardware and the model, in words
    kv_bytes_per_token: int
    num_layers: int
    step_models: dict[int, StepModel]  # by threads (CPU) or devices per worker
    transfers: dict[str, TransferModel] = field(default_factory=dict)  # by transport
    notes: list[str] = field(default_factory=list)  # how it was measured or assumed

    def step_model(self, size: int) -> StepModel:
        """The model of a worker of `size` threads or devices (the nearest measured size)."""
        if size in self.step_models:
            return self.step_models[size]
        return self.step_models[min(self.step_models, key=lambda s: (abs(s - size), -s))]

    def transfer(self, transport: str) -> TransferModel:
        if transport not in self.transfers:
            raise KeyError(f"the profile has no KV transfer model for transport {transport!r}")
        return self.transfers[transport]

    # ---- JSON ------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {
            "kind": self.kind,
            "description": self.description,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "num_layers": self.num_layers,
            "step_models": {str(k): m.to_dict() for k, m in sorted(self.step_models.items())},
            "transfers": {
                k: {"latency_s": t.latency_s, "bytes_per_s": t.bytes_per_s}
                for k, t in self.transfers.items()
            },
            "notes": self.notes,
        }

    @classmethod
    def from_dict(cls, d: dict) -> Profile:
        return cls(
            kind=d["kind"],
            description=d["description"],
            kv_bytes_per_token=int(d["kv_bytes_per_token"]),
            num_layers=int(d["num_layers"]),
            step_models={int(k): step_model_from_dict(m) for k, m in d["step_models"].items()},
            transfers={k: TransferModel(**t) for k, t in d.get("transfers", {}).items()},
            notes=list(d.get("notes", [])),
        )

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        return cls.from_dict(json.loads(Path(path).read_text()))
