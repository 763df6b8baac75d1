"""What a user sets for the HTTP frontend (`ServerConfig`) and for one request (`RequestLimits`).

Each field is a setting of `pdserve serve` (see `pdserve.config.settings`); the request limits
name their flag when a request goes beyond them. No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pdserve.config.settings import (
    POSITIVE,
    Check,
    at_least,
    check_settings,
    format_size,
    in_range,
    internal,
    parse_size,
    setting,
)

ADMISSION_GROUP = "SLOs and admission (see docs/ARCHITECTURE.md)"
LIMITS_GROUP = "request limits (each checked before any work; a 400 beyond, 413/431 for sizes)"


def _limit(default: int, what: str) -> Any:
    return setting(default, group=LIMITS_GROUP, help=f"most {what}", checks=(at_least(1),))


@dataclass(frozen=True)
class RequestLimits:
    """What one API request may ask for: checked before any work is done (a 400 beyond).

    The HTTP layer bounds the rest: the body size (`ServerConfig.max_body_bytes`, 413) and the
    request head (431); token counts are bounded by the model's context."""

    max_n: int = _limit(128, "completions per prompt (n, best_of)")
    max_prompts: int = _limit(256, "prompts in one /v1/completions request")
    max_sequences: int = _limit(512, "completions in one request (prompts x n)")
    max_stop: int = _limit(16, "stop strings per request")
    max_stop_chars: int = _limit(1000, "characters in one stop string")
    max_stop_token_ids: int = _limit(256, "stop token ids per request")
    max_logprobs: int = _limit(20, "logprobs / top_logprobs")
    max_messages: int = _limit(4096, "chat messages per request")
    max_tools: int = _limit(128, "tools offered in one chat request")
    max_grammar_chars: int = _limit(
        65536, "characters of a schema, regex or grammar (as JSON text), or of all tools"
    )

    def __post_init__(self) -> None:
        check_settings(self)


@dataclass(frozen=True)
class ServerConfig:
    """HTTP frontend settings. Binds 127.0.0.1 unless told otherwise."""

    profile: str | None = setting(
        None,
        choices=("chat", "batch", "mixed"),
        help="a scenario's settings as defaults that any flag overrides: chat (TTFT first), "
        "batch (throughput first), mixed (P:D split that follows the load); see "
        "docs/ARCHITECTURE.md, Scenario profiles",
    )
    host: str = setting("127.0.0.1", help="address to bind; 0.0.0.0 exposes the server")
    port: int = setting(8000, help="port to listen on", checks=(in_range(0, 65535),))
    api_key: str | None = setting(
        None,
        help="require 'Authorization: Bearer KEY' on /v1 routes (default: $PDSERVE_API_KEY if set)",
    )
    served_model_name: str | None = setting(
        None, help="model id clients send (default: the --model path)"
    )
    chat_template: str | None = setting(
        None, metavar="FILE", help="Jinja chat template overriding the tokenizer's"
    )
    max_waiting_requests: int | None = setting(
        None,
        help="answer 503 when this many requests wait for their first token",
        checks=(at_least(0),),
    )
    queue_timeout_s: float | None = setting(
        None,
        flag="queue-timeout",
        metavar="SECONDS",
        help="end a request with 503 if it is not scheduled within this time",
        checks=(POSITIVE,),
    )
    slo_admission: bool = setting(
        False,
        group=ADMISSION_GROUP,
        help="refuse (503 + Retry-After) a request whose predicted TTFT is beyond the --slo "
        "TTFT target, instead of serving it late",
    )
    admission_margin: float = setting(
        0.0,
        group=ADMISSION_GROUP,
        metavar="FRACTION",
        help="refuse only when the predicted TTFT exceeds the target by more than this share of it",
        checks=(Check(lambda v: v >= 0, "must be >= 0"),),
    )
    truncate_prompt: str = setting(
        "error",
        choices=("error", "left"),
        help="a prompt longer than the context: error (400) or left (keep its most recent "
        "tokens; the dropped count is in usage.prompt_tokens_details.truncated_tokens)",
    )
    max_body_bytes: int = setting(
        16 << 20,
        parse=parse_size,
        show=format_size,
        group=LIMITS_GROUP,
        help="413 above this body size, e.g. 16MiB",
        checks=(POSITIVE,),
    )
    max_header_bytes: int = setting(
        64 << 10,
        parse=parse_size,
        show=format_size,
        group=LIMITS_GROUP,
        help="431 above this size of request line plus headers, e.g. 64KiB",
        checks=(at_least(1024),),
    )
    public_metrics: bool = setting(
        False, help="with --api-key: serve /metrics without the key (default: /metrics needs it)"
    )
    short_time_slices: bool = setting(
        False,
        help="the frontend's threads and the workers' message threads on 0.1-ms scheduler "
        "slices (Linux 6.12+): a token leaves a machine whose cores run a step sooner, at some "
        "cost in throughput (docs/PERFORMANCE.md, 'Tokens out of a busy machine')",
    )
    tool_call_parser: str = setting(
        "auto",
        choices=("auto", "hermes", "llama3_json", "mistral"),
        help="how tool calls are read from the model's text (auto: from the chat template and "
        "the architecture: Qwen -> hermes, Llama -> llama3_json, Mistral -> mistral)",
    )
    limits: RequestLimits = internal(
        default_factory=RequestLimits, why="its own settings: the request limits flags"
    )

    def __post_init__(self) -> None:
        check_settings(self)
