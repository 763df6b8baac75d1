"""Engine configuration: frozen dataclasses validated on construction (no torch here).

`ModelConfig` is what the engine needs from a Hugging Face `config.json`, parsed once; the others
are the knobs a user sets (`EngineArgs` on the command line, keyword arguments of `LLM`). Invalid
values raise `ValueError` naming the field and the value.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from pdserve.types import KVTransportKind, PrefillFailurePolicy, Role

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "MistralForCausalLM",
)


def _require(ok: bool, name: str, value: object, why: str) -> None:
    if not ok:
        raise ValueError(f"invalid {name}={value!r}: {why}")


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"  # "default" | "llama3" | "linear"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> RopeConfig:
        """Read the classic top-level `rope_theta`/`rope_scaling` or transformers 5 `rope_parameters`."""
        params = dict(cfg.get("rope_parameters") or {})
        scaling = dict(cfg.get("rope_scaling") or {})
        merged = {**scaling, **params}
        theta = merged.get("rope_theta", cfg.get("rope_theta", 10000.0))
        rope_type = merged.get("rope_type", merged.get("type", "default")) or "default"
        if rope_type not in ("default", "llama3", "linear"):
            raise ValueError(
                f"invalid rope_scaling.rope_type={rope_type!r}: supported are default, llama3, linear"
            )
        return cls(
            theta=float(theta),
            rope_type=rope_type,
            factor=float(merged.get("factor", 1.0)),
            low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
            high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(
                merged.get("original_max_position_embeddings", 8192)
            ),
        )


@dataclass(frozen=True)
class ModelConfig:
    """The shapes and options of a Llama-family checkpoint."""

    path: str
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope: RopeConfig
    tie_word_embeddings: bool
    qkv_bias: bool  # Qwen2
    qk_norm: bool  # Qwen3
    torch_dtype: str
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    sliding_window: int | None = None

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        if not path.is_dir():
            raise ValueError(f"invalid model={str(path)!r}: no such folder")
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise ValueError(f"invalid model={str(path)!r}: no config.json in that folder")
        try:
            cfg = json.loads(cfg_file.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"invalid model config {cfg_file}: not valid JSON ({e})") from None
        gen_file = path / "generation_config.json"
        gen = json.loads(gen_file.read_text()) if gen_file.is_file() else {}
        return cls.from_hf_dict(cfg, str(path), gen)

    @classmethod
    def from_hf_dict(
        cls, cfg: dict[str, Any], path: str = "", generation: dict[str, Any] | None = None
    ) -> ModelConfig:
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else None
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"invalid architectures={archs!r}: supported are {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        required = (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
        )
        missing = [k for k in required if k not in cfg]
        if missing:
            raise ValueError(f"invalid model config: missing field(s) {', '.join(missing)}")
        num_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        head_dim = cfg.get("head_dim") or hidden // num_heads
        eos = _eos_ids(cfg, generation or {})
        window = cfg.get("sliding_window")
        if arch == "Qwen2ForCausalLM" and not cfg.get("use_sliding_window", False):
            window = None
        return cls(
            path=path,
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope=RopeConfig.from_hf(cfg),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos,
            sliding_window=int(window) if window else None,
        )

    def __post_init__(self) -> None:
        _require(
            self.num_heads % self.num_kv_heads == 0,
            "num_key_value_heads",
            self.num_kv_heads,
            f"must divide num_attention_heads ({self.num_heads})",
        )

    @property
    def max_model_len(self) -> int:
        """Longest sequence the engine serves. Sliding-window attention is not implemented, so a
        model with a window is capped at the window, where full attention is exact."""
        if self.sliding_window is not None:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings


def _eos_ids(cfg: dict[str, Any], gen: dict[str, Any]) -> tuple[int, ...]:
    ids: list[int] = []
    for src in (gen.get("eos_token_id"), cfg.get("eos_token_id")):
        if src is None:
            continue
        for i in src if isinstance(src, list) else [src]:
            if i not in ids:
                ids.append(int(i))
    return tuple(ids)


_SIZE_RE = re.compile(r"^\s*([0-9.]+(?:e[0-9]+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}


def parse_size(text: str | int) -> int:
    """'2GiB' -> 2147483648, '512MB' -> 512000000, 1024 -> 1024."""
    if isinstance(text, int):
        return text
    m = _SIZE_RE.match(text)
    if not m:
        raise ValueError(f"invalid size {text!r}: expected e.g. 512MiB, 2GiB, 1e9")
    num, unit = float(m.group(1)), (m.group(2) or "").lower()
    base = unit[:1]
    mult = 1024 ** "bkmgt".index(base) if "i" in unit and base != "b" else _UNITS[base]
    return int(num * mult)


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    num_blocks: int | None = None  # set directly, or derived from memory_bytes
    memory_bytes: int | None = None
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        _require(
            self.block_size >= 1 and (self.block_size & (self.block_size - 1)) == 0,
            "block_size",
            self.block_size,
            "must be a power of two",
        )
        _require(
            self.num_blocks is None or self.num_blocks >= 1,
            "num_kv_blocks",
            self.num_blocks,
            "must be >= 1",
        )
        _require(
            self.memory_bytes is None or self.memory_bytes > 0,
            "kv_cache_memory",
            self.memory_bytes,
            "must be > 0",
        )


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 2048  # token budget of one step
    max_num_seqs: int = 64
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0  # 0: a prefill chunk may take the whole budget
    max_model_len: int = 0  # filled in from the model when 0

    def __post_init__(self) -> None:
        _require(
            self.max_num_batched_tokens >= 1,
            "max_num_batched_tokens",
            self.max_num_batched_tokens,
            "must be >= 1",
        )
        _require(self.max_num_seqs >= 1, "max_num_seqs", self.max_num_seqs, "must be >= 1")
        _require(
            self.long_prefill_token_threshold >= 0,
            "long_prefill_token_threshold",
            self.long_prefill_token_threshold,
            "must be >= 0",
        )


@dataclass(frozen=True)
class EngineArgs:
    """Everything the user can set for one engine; the CLI and `LLM(**kwargs)` both build this."""

    model: str
    tokenizer: str | None = None
    device: str = "cpu"
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on CUDA
    seed: int = 0
    max_model_len: int | None = None
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory: str | int | None = None  # e.g. "2GiB"; default: 1 GiB on CPU
    enable_prefix_caching: bool = True
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    num_threads: int | None = None
    hardware_profile: str | None = None
    linear_backend: str = "auto"  # auto | onednn | torch (see pdserve/models/packed_linear.py)

    def __post_init__(self) -> None:
        _require(
            self.device in ("cpu", "cuda") or self.device.startswith("cuda:"),
            "device",
            self.device,
            "must be cpu or cuda[:N]",
        )
        _require(
            self.dtype in ("auto", "float32", "bfloat16", "float16"),
            "dtype",
            self.dtype,
            "must be auto, float32, bfloat16 or float16",
        )
        _require(
            self.linear_backend in ("auto", "onednn", "torch"),
            "linear_backend",
            self.linear_backend,
            "must be auto, onednn or torch",
        )
        _require(
            self.max_model_len is None or self.max_model_len >= 1,
            "max_model_len",
            self.max_model_len,
            "must be >= 1",
        )

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in fields(cls)}

    def cache_config(self) -> CacheConfig:
        memory = None if self.kv_cache_memory is None else parse_size(self.kv_cache_memory)
        if self.num_kv_blocks is None and memory is None:
            memory = 1 << 30
        return CacheConfig(
            block_size=self.block_size,
            num_blocks=self.num_kv_blocks,
            memory_bytes=memory,
            enable_prefix_caching=self.enable_prefix_caching,
        )

    def scheduler_config(self, max_model_len: int) -> SchedulerConfig:
        return SchedulerConfig(
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_num_seqs=self.max_num_seqs,
            enable_chunked_prefill=self.enable_chunked_prefill,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            max_model_len=max_model_len,
        )


@dataclass(frozen=True)
class RequestLimits:
    """What one API request may ask for: checked before any work is done (a 400 beyond).

    The HTTP layer bounds the rest: the body size (`ServerConfig.max_body_bytes`, 413) and the
    request head (431); token counts are bounded by the model's context."""

    max_n: int = 128  # completions per prompt (`n`, `best_of`)
    max_prompts: int = 256  # prompts in one /v1/completions request
    max_sequences: int = 512  # prompts x n: the core requests one API request may start
    max_stop: int = 16  # stop strings
    max_stop_chars: int = 1000  # characters in one stop string
    max_stop_token_ids: int = 256
    max_logprobs: int = 20  # `logprobs` / `top_logprobs`
    max_messages: int = 4096  # chat messages
    max_tools: int = 128  # tools offered in one chat request
    max_grammar_chars: int = 65536  # a schema, regex or grammar (as JSON text), or all tools

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            _require(value >= 1, f.name, value, "must be >= 1")


@dataclass(frozen=True)
class ServerConfig:
    """HTTP frontend settings. Binds 127.0.0.1 unless told otherwise."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: str | None = None  # default: the model folder's path
    chat_template: str | None = None  # a Jinja file overriding the tokenizer's template
    max_waiting_requests: int | None = None  # 503 beyond this many requests not yet started
    queue_timeout_s: float | None = None  # 503 for a request unscheduled this long
    max_body_bytes: int = 16 << 20
    max_header_bytes: int = 64 << 10  # request line + headers; 431 beyond
    public_metrics: bool = False  # with an API key: serve /metrics without it
    tool_call_parser: str = "auto"  # auto | hermes | llama3_json | mistral
    limits: RequestLimits = field(default_factory=RequestLimits)

    def __post_init__(self) -> None:
        _require(0 <= self.port < 65536, "port", self.port, "must be in [0, 65535]")
        _require(
            self.max_waiting_requests is None or self.max_waiting_requests >= 0,
            "max_waiting_requests",
            self.max_waiting_requests,
            "must be >= 0",
        )
        _require(
            self.queue_timeout_s is None or self.queue_timeout_s > 0,
            "queue_timeout",
            self.queue_timeout_s,
            "must be > 0",
        )
        _require(self.max_body_bytes > 0, "max_body_bytes", self.max_body_bytes, "must be > 0")
        _require(
            self.tool_call_parser in ("auto", "hermes", "llama3_json", "mistral"),
            "tool_call_parser",
            self.tool_call_parser,
            "must be auto, hermes, llama3_json or mistral",
        )
        _require(
            self.max_header_bytes >= 1024,
            "max_header_bytes",
            self.max_header_bytes,
            "must be >= 1024",
        )


@dataclass(frozen=True)
class DisaggConfig:
    """Worker pools. `num_prefill_workers == 0` is the colocated default (one worker, role both)."""

    num_prefill_workers: int = 0
    num_decode_workers: int = 1
    kv_transport: KVTransportKind = KVTransportKind.SHM
    kv_host: str = "127.0.0.1"  # where decode workers bind their TCP KV channel
    kv_transfer_timeout_s: float = 30.0
    min_prompt_tokens: int = 0  # shorter prompts are prefilled on the decode worker
    on_prefill_failure: PrefillFailurePolicy = PrefillFailurePolicy.RECOMPUTE
    prefill_cpus: tuple[str, ...] = ()  # one CPU set per prefill worker (cycled), e.g. ("0",)
    decode_cpus: tuple[str, ...] = ()
    prefill_overrides: dict[str, Any] = field(default_factory=dict)  # EngineArgs fields
    decode_overrides: dict[str, Any] = field(default_factory=dict)
    restart_workers: bool = False

    def __post_init__(self) -> None:
        _require(
            self.num_prefill_workers >= 0,
            "prefill_workers",
            self.num_prefill_workers,
            "must be >= 0",
        )
        _require(
            self.num_decode_workers >= 1, "decode_workers", self.num_decode_workers, "must be >= 1"
        )
        _require(
            self.num_prefill_workers > 0 or self.num_decode_workers == 1,
            "decode_workers",
            self.num_decode_workers,
            "more than one needs --prefill-workers >= 1",
        )
        _require(
            self.kv_transport in KVTransportKind.__members__.values(),
            "kv_transport",
            self.kv_transport,
            "must be shm or tcp",
        )
        object.__setattr__(self, "kv_transport", KVTransportKind(self.kv_transport))
        _require(
            self.kv_transfer_timeout_s > 0,
            "kv_transfer_timeout",
            self.kv_transfer_timeout_s,
            "must be > 0",
        )
        _require(
            self.on_prefill_failure in PrefillFailurePolicy.__members__.values(),
            "on_prefill_failure",
            self.on_prefill_failure,
            "must be recompute or fail",
        )
        policy = PrefillFailurePolicy(self.on_prefill_failure)
        object.__setattr__(self, "on_prefill_failure", policy)
        allowed = EngineArgs.field_names() - {"model", "tokenizer"}
        for name in (*self.prefill_overrides, *self.decode_overrides):
            _require(name in allowed, "pool override", name, "is not an engine argument")

    @property
    def disaggregated(self) -> bool:
        return self.num_prefill_workers > 0


def worker_specs(
    args: EngineArgs, disagg: DisaggConfig
) -> list[tuple[Role, EngineArgs, str | None]]:
    """(role, engine args, CPU set) of every worker, prefill workers first."""
    if not disagg.disaggregated:
        cpus = disagg.decode_cpus[0] if disagg.decode_cpus else None
        return [(Role.BOTH, args, cpus)]
    out = []
    # oneDNN's spinning threads and per-shape kernel builds hurt when several engine processes
    # share cores: disaggregated pools keep F.linear unless the user asks for oneDNN.
    if args.linear_backend == "auto":
        args = replace(args, linear_backend="torch")
    for role, n, overrides, cpus in (
        (Role.PREFILL, disagg.num_prefill_workers, disagg.prefill_overrides, disagg.prefill_cpus),
        (Role.DECODE, disagg.num_decode_workers, disagg.decode_overrides, disagg.decode_cpus),
    ):
        pool_args = replace(args, **overrides)
        for i in range(n):
            out.append((role, pool_args, cpus[i % len(cpus)] if cpus else None))
    return out
