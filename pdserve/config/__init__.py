"""Configuration: frozen dataclasses validated on construction (no torch here).

`model` parses a checkpoint's `config.json`; `engine`, `server` and `disagg` hold what a user sets,
each field declared once with its flag, help and checks (`settings`), from which the CLI is
generated (`pdserve.commands.flags`). Invalid values raise `ValueError` naming the field and the
value. Import the names from here.
"""

from pdserve.config.disagg import DisaggConfig, worker_specs
from pdserve.config.engine import CacheConfig, EngineArgs, SchedulerConfig, SpecConfig
from pdserve.config.model import SUPPORTED_ARCHITECTURES, ModelConfig, RopeConfig
from pdserve.config.server import RequestLimits, ServerConfig
from pdserve.config.settings import parse_size

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "CacheConfig",
    "DisaggConfig",
    "EngineArgs",
    "ModelConfig",
    "RequestLimits",
    "RopeConfig",
    "SchedulerConfig",
    "SpecConfig",
    "ServerConfig",
    "parse_size",
    "worker_specs",
]
