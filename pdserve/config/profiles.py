"""Scenario profiles of `pdserve serve --profile`: what a deployment is for, as concrete settings.

A profile is a set of defaults, by setting name (the fields of `EngineArgs`, `ServerConfig` and
`DisaggConfig`): any flag given on the command line overrides it. The table in
docs/ARCHITECTURE.md ("Scenario profiles") lists the same values; a test keeps the two equal.

- chat: time to first token first. A new prompt's chunk goes before the chunks of prompts already
  in prefill and chunks are 256 tokens (a stream pauses for at most one chunk), requests whose
  predicted TTFT is beyond the SLO are refused at once, over-long prompts keep their most recent
  tokens, a tenth of the KV cache is kept for the streams already running, and a more urgent
  `priority` preempts less urgent requests.
- batch: throughput first. A large step budget and many sequences at once, whole-prompt chunks,
  no latency target at admission.
- mixed: prefill and decode workers whose split follows the load (`--pd-ratio auto`, starting at
  1 prefill + 1 decode worker), with SLO-aware admission.
No torch here.
"""

from __future__ import annotations

from typing import Any

PROFILES: dict[str, dict[str, Any]] = {
    "chat": {
        "prefill_first": True,
        "long_prefill_token_threshold": 256,
        "max_num_batched_tokens": 512,
        "max_num_seqs": 32,
        "reserved_kv_fraction": 0.1,
        "priority_preemption": True,
        "truncate_prompt": "left",
        "slo_admission": True,
    },
    "batch": {
        "prefill_first": False,
        "long_prefill_token_threshold": 0,
        "max_num_batched_tokens": 8192,
        "max_num_seqs": 256,
        "reserved_kv_fraction": 0.0,
        "priority_preemption": False,
        "truncate_prompt": "error",
        "slo_admission": False,
    },
    "mixed": {
        "num_prefill_workers": 1,
        "num_decode_workers": 1,
        "pd_ratio": "auto",
        "long_prefill_token_threshold": 256,
        "max_num_batched_tokens": 512,
        "slo_admission": True,
    },
}


def profile_defaults(name: str | None) -> dict[str, Any]:
    """The settings of profile `name` (none for None)."""
    if name is None:
        return {}
    if name not in PROFILES:
        raise ValueError(f"invalid --profile {name!r}: must be one of {', '.join(PROFILES)}")
    return dict(PROFILES[name])
