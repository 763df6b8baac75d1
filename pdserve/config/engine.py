"""What a user sets for one engine (`EngineArgs`), and the cache and scheduler configs it resolves to.

`EngineArgs` is the one table of engine settings: the CLI flags of `generate` and `serve` (with
per-pool variants for disaggregated serving) and the keyword arguments of `LLM` are all generated
from, and checked by, its fields. `CacheConfig` and `SchedulerConfig` have no defaults of their
own: they are what `EngineArgs` resolves to once the model is known. No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from pdserve.config.settings import (
    POSITIVE,
    POWER_OF_TWO,
    Check,
    at_least,
    check_settings,
    format_size,
    parse_size,
    setting,
)

KV_GROUP = "KV cache"
SCHEDULER_GROUP = "scheduler"
SPEC_GROUP = "speculative decoding"
DEFAULT_KV_CACHE_BYTES = 1 << 30  # when neither --kv-cache-memory nor --num-kv-blocks is given
MAX_SCHEDULER_STEPS = 64  # the most decode steps one schedule may run (--num-scheduler-steps)


def _is_size(value: str | int) -> bool:
    try:
        return parse_size(value) > 0
    except (TypeError, ValueError):
        return False


_DEVICE = Check(lambda v: v in ("cpu", "cuda") or v.startswith("cuda:"), "must be cpu or cuda[:N]")
_SIZE = Check(_is_size, "must be a size > 0, e.g. 512MiB, 2GiB, 1e9")


def _is_tier_stack(value: tuple[str, ...]) -> bool:
    from pdserve.kv.offload.spec import parse_tiers

    try:
        parse_tiers(value)
        return True
    except ValueError:
        return False


_STEPS = Check(lambda v: 1 <= v <= MAX_SCHEDULER_STEPS, f"must be in [1, {MAX_SCHEDULER_STEPS}]")
_TIERS = Check(
    _is_tier_stack,
    "must be cpu:SIZE, disk:PATH:SIZE or both in that order, e.g. cpu:4GiB disk:/var/kv:64GiB",
)


@dataclass(frozen=True)
class CacheConfig:
    """The KV cache of one engine, resolved from `EngineArgs.cache_config()`."""

    block_size: int
    num_blocks: int | None  # set directly, or derived from memory_bytes
    memory_bytes: int | None
    enable_prefix_caching: bool


@dataclass(frozen=True)
class SchedulerConfig:
    """The scheduler's limits, resolved from `EngineArgs.scheduler_config()`."""

    max_num_batched_tokens: int  # token budget of one step
    max_num_seqs: int
    enable_chunked_prefill: bool
    long_prefill_token_threshold: int  # 0: a prefill chunk may take the whole budget
    max_model_len: int  # the model's context, or the user's cap
    prefill_first: bool  # a new prompt's chunk before the chunks of prompts in prefill
    reserved_kv_fraction: float  # of the KV blocks, kept free for the running requests
    priority_aging_s: float  # a waiting request gains one priority level per this wait
    priority_preemption: bool  # an urgent prompt runs alone; it may preempt lax requests
    speculation: SpecConfig | None  # None: one token per decode step
    num_scheduler_steps: int  # decode steps one schedule may run back to back (a burst)


@dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding (`pdserve.spec`): what proposes tokens and when it may."""

    method: str  # "ngram": the continuation of the latest earlier match of the recent tokens;
    # "draft": what a draft model (`draft_model`, or the model's own first `draft_layers`) says
    num_tokens: int  # at most this many proposed per request and step
    ngram_min: int  # the shortest suffix that may match
    ngram_max: int  # the longest suffix tried first
    max_batch: int  # no proposals while more requests than this decode (compute-bound steps)
    min_acceptance: float  # a request whose recent acceptance falls below this pauses proposing
    adaptive: bool  # False: propose whenever there is a match (within max_batch), for tests
    draft_model: str | None = None  # draft: a model folder with the same tokenizer
    draft_layers: int | None = None  # draft: the target's first N layers (self-speculation)


@dataclass(frozen=True)
class EngineArgs:
    """Everything the user can set for one engine; the CLI and `LLM(**kwargs)` both build this."""

    model: str = setting(help="Hugging Face model folder (config.json, safetensors, tokenizer)")
    tokenizer: str | None = setting(None, help="tokenizer folder (default: the model folder)")
    device: str = setting("cpu", help="cpu, cuda or cuda:N", checks=(_DEVICE,))
    dtype: str = setting(
        "auto",
        choices=("auto", "float32", "bfloat16", "float16"),
        help="weights and KV cache dtype (auto: float32 on CPU, bfloat16 on CUDA)",
    )
    seed: int = setting(0, help="seed for unseeded sampling")
    max_model_len: int | None = setting(
        None, help="cap the context length (default: the model's)", checks=(at_least(1),)
    )
    block_size: int = setting(
        16, group=KV_GROUP, per_pool=True, help="tokens per KV block", checks=(POWER_OF_TWO,)
    )
    num_kv_blocks: int | None = setting(
        None,
        group=KV_GROUP,
        per_pool=True,
        help="KV cache size in blocks (overrides --kv-cache-memory)",
        checks=(at_least(1),),
    )
    kv_cache_memory: str | int | None = setting(
        None,
        parse=str,
        group=KV_GROUP,
        per_pool=True,
        help=f"KV cache size, e.g. 2GiB (default: {format_size(DEFAULT_KV_CACHE_BYTES)})",
        checks=(_SIZE,),
    )
    enable_prefix_caching: bool = setting(
        True, flag="no-prefix-caching", group=KV_GROUP, help="turn prefix caching off"
    )
    kv_offload: tuple[str, ...] = setting(
        (),
        group=KV_GROUP,
        help="an offload tier for blocks evicted from the KV cache, loaded back instead of "
        "recomputed: cpu:SIZE (host memory, shared by a server's workers) or disk:PATH:SIZE; "
        "repeat to stack cpu then disk (see docs/ARCHITECTURE.md, 'KV offload tiers')",
        checks=(_TIERS,),
    )
    kv_offload_reload: str = setting(
        "auto",
        choices=("auto", "always"),
        group=KV_GROUP,
        help="load a tier hit back: auto when measured faster than recomputing it, or always",
    )
    max_num_batched_tokens: int = setting(
        2048,
        group=SCHEDULER_GROUP,
        per_pool=True,
        help="token budget of one step",
        checks=(at_least(1),),
    )
    max_num_seqs: int = setting(
        64,
        group=SCHEDULER_GROUP,
        per_pool=True,
        help="most requests running at once",
        checks=(at_least(1),),
    )
    enable_chunked_prefill: bool = setting(
        True,
        flag="no-chunked-prefill",
        group=SCHEDULER_GROUP,
        help="prefill each prompt in one step",
    )
    long_prefill_token_threshold: int = setting(
        0,
        group=SCHEDULER_GROUP,
        per_pool=True,
        help="largest prefill chunk of one request per step (0: the whole budget)",
        checks=(at_least(0),),
    )
    prefill_first: bool = setting(
        False,
        group=SCHEDULER_GROUP,
        help="schedule a new prompt's chunk before the chunks of prompts already in prefill "
        "(every running decode still gets its token each step)",
    )
    reserved_kv_fraction: float = setting(
        0.0,
        group=SCHEDULER_GROUP,
        metavar="FRACTION",
        help="admit new requests only while this share of the KV blocks stays free for the "
        "running ones",
        checks=(Check(lambda v: 0 <= v <= 0.5, "must be in [0, 0.5]"),),
    )
    priority_aging_s: float = setting(
        60.0,
        group=SCHEDULER_GROUP,
        metavar="SECONDS",
        help="a waiting request gains one priority level per this many seconds waited (lower "
        "`priority` values are admitted first; aging keeps low priorities from starving)",
        checks=(POSITIVE,),
    )
    priority_preemption: bool = setting(
        False,
        group=SCHEDULER_GROUP,
        help="while a prompt of a more urgent `priority` is in prefill, less urgent requests "
        "get no tokens (their streams pause) and that prompt is not held to "
        "--long-prefill-token-threshold, and a waiting urgent request preempts less urgent "
        "running ones for a sequence slot or KV blocks",
    )
    num_scheduler_steps: int = setting(
        1,
        group=SCHEDULER_GROUP,
        per_pool=True,
        metavar="N",
        help="run up to N decode steps per schedule, in one native call, when every running "
        "request decodes greedily (no logprobs, penalties or grammar) and no queued request "
        "could start (none, or every --max-num-seqs slot taken): the host's per-step work is "
        "paid once per N tokens, and the tokens reach clients N at a time (a request that "
        "arrives meanwhile waits for the burst to end)",
        checks=(_STEPS,),
    )
    speculative_method: str = setting(
        "none",
        choices=("none", "ngram", "draft"),
        group=SPEC_GROUP,
        help="propose tokens for decoding requests and verify them in one forward, losslessly "
        "(greedy: identical tokens; sampled: the same distribution): ngram looks the recent "
        "tokens up in the prompt and output so far; draft asks a smaller model "
        "(--draft-model or --draft-layers; see pdserve/spec)",
    )
    draft_model: str | None = setting(
        None,
        group=SPEC_GROUP,
        help="draft: a model folder with the target's tokenizer and vocabulary; it runs with its "
        "own paged KV cache (the same blocks, counted in the KV memory)",
    )
    draft_layers: int | None = setting(
        None,
        group=SPEC_GROUP,
        help="draft: the target model's own first N layers and output head (self-speculation: "
        "works for any model and shares the target's KV cache of those layers)",
        checks=(at_least(1),),
    )
    num_speculative_tokens: int = setting(
        4, group=SPEC_GROUP, help="tokens proposed per request and step", checks=(at_least(1),)
    )
    speculative_ngram_min: int = setting(
        2, group=SPEC_GROUP, help="ngram: the shortest suffix that may match", checks=(at_least(1),)
    )
    speculative_ngram_max: int = setting(
        4, group=SPEC_GROUP, help="ngram: the longest suffix, tried first", checks=(at_least(1),)
    )
    speculative_max_batch: int = setting(
        8,
        group=SPEC_GROUP,
        help="propose only while at most this many requests decode (beyond, a decode step is no "
        "longer bandwidth-bound and verifying costs more than it saves)",
        checks=(at_least(1),),
    )
    speculative_min_acceptance: float = setting(
        0.3,
        group=SPEC_GROUP,
        help="a request whose recent share of accepted proposals falls below this stops "
        "proposing for a while",
    )
    speculative_adaptive: bool = setting(
        True,
        flag="no-speculative-adaptive",
        group=SPEC_GROUP,
        help="propose whenever a match is found (within --speculative-max-batch), even where "
        "the measured step times say it does not pay and acceptance is low",
    )
    tensor_parallel_size: int = setting(
        1,
        metavar="N",
        per_pool=True,
        help="split the model's heads and MLP over N ranks of this engine (this process and "
        "N-1 it starts; CPU, gloo), in any role; pools may differ (KV crosses with every head); "
        "see docs/ARCHITECTURE.md",
        checks=(at_least(1),),
    )
    num_threads: int | None = setting(
        None,
        help="torch CPU threads (default: one per allowed CPU that other processes leave free, "
        "measured at start and again when the load changes; with --tensor-parallel-size: per "
        "rank, unpinned, where the default splits this process's CPUs between the ranks; see "
        "docs/ARCHITECTURE.md)",
        checks=(at_least(0),),
    )
    hardware_profile: str | None = setting(
        None,
        metavar="FILE",
        help="peak FLOP/s and bandwidth for MFU/MBU (see `pdserve profile-hardware`)",
    )
    linear_backend: str = setting(
        "auto",
        choices=("auto", "native", "onednn", "torch"),
        help="matmul kernels (CPU float32): pdserve's own (native, built with cc at first use), "
        "oneDNN with weights prepacked at load, or torch's F.linear; auto takes the first of "
        "native and onednn that works here (see pdserve/models/packed_linear.py); with all but "
        "torch, RMSNorm, rotary and the MLP activation run on pdserve's kernels too",
    )
    attention_backend: str = setting(
        "auto",
        choices=("auto", "native", "sdpa"),
        help="decode and prefill attention: pdserve's CPU kernels that read the paged cache in "
        "place (native, CPU float32, built with cc at first use) or SDPA over gathered copies "
        "(sdpa); auto takes native where it runs (see pdserve/models/attention.py)",
    )
    enforce_eager: bool = setting(
        False,
        help="run every step layer by layer through the torch modules: no fused native decode "
        "step (which needs the native matmul and attention kernels; see "
        "pdserve/models/fused_decode.py)",
    )
    warmup: bool = setting(
        True,
        flag="no-warmup",
        help="skip the startup forward pass of one full step (the token budget's prompt tokens "
        "and max-num-seqs decodes) that makes the first requests' steps as fast as later ones "
        "(see ModelRunner.warm_up)",
    )
    quantization: str = setting(
        "none",
        choices=("none", "int8", "int4"),
        help="weight-only quantization at load: int8 (a scale per output channel) or int4 "
        "(a scale and a minimum per group of input features, calibrated on text the model "
        "samples); the products round their activations to 8 "
        "bits per block of 32 and use integer dot products (AVX-512 VNNI where present); CPU "
        "(see pdserve/models/quant_linear.py)",
    )
    kv_cache_dtype: str = setting(
        "auto",
        choices=("auto", "int8"),
        group=KV_GROUP,
        help="KV cache elements: auto (the model's dtype) or int8 with a float32 scale per token "
        "and KV head (about 0.27x float32's bytes at head_dim 64, so ~3.8x the tokens fit); "
        "disaggregated workers must agree (see pdserve/models/kv_quant.py)",
    )
    quantization_group_size: int = setting(
        32,
        choices=(32, 64, 128),
        help="input features per int4 scale and minimum",
    )
    quantization_calibration_tokens: int = setting(
        4096,
        checks=(at_least(0),),
        help="int4: tokens of text the float model samples at load to calibrate the rounding "
        "(GPTQ against the float model's outputs, layer by layer; about a minute for a 125M "
        "model on 2 cores); 0 rounds each weight to nearest. A tensor-parallel shard always "
        "rounds to nearest (see pdserve/models/calibrate.py)",
    )

    def __post_init__(self) -> None:
        check_settings(self)

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in fields(cls)}

    def cache_config(self) -> CacheConfig:
        memory = None if self.kv_cache_memory is None else parse_size(self.kv_cache_memory)
        if self.num_kv_blocks is None and memory is None:
            memory = DEFAULT_KV_CACHE_BYTES
        return CacheConfig(
            block_size=self.block_size,
            num_blocks=self.num_kv_blocks,
            memory_bytes=memory,
            enable_prefix_caching=self.enable_prefix_caching,
        )

    def scheduler_config(self, max_model_len: int) -> SchedulerConfig:
        """The scheduler's settings; raises ValueError for settings that contradict each other
        (checked here, when an engine starts, not field by field)."""
        drafts = (self.draft_model is not None) + (self.draft_layers is not None)
        if self.speculative_method == "draft" and drafts != 1:
            raise ValueError(
                "invalid speculative_method='draft': give exactly one of draft_model and "
                "draft_layers"
            )
        if self.num_scheduler_steps > 1 and self.speculative_method != "none":
            raise ValueError(
                f"invalid num_scheduler_steps={self.num_scheduler_steps}: speculative decoding "
                "already computes several tokens per step; use one or the other"
            )
        if self.speculative_method != "draft" and drafts:
            raise ValueError(
                f"invalid speculative_method={self.speculative_method!r}: draft_model and "
                "draft_layers need speculative_method='draft'"
            )
        return SchedulerConfig(
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_num_seqs=self.max_num_seqs,
            enable_chunked_prefill=self.enable_chunked_prefill,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            max_model_len=max_model_len,
            prefill_first=self.prefill_first,
            reserved_kv_fraction=self.reserved_kv_fraction,
            priority_aging_s=self.priority_aging_s,
            priority_preemption=self.priority_preemption,
            num_scheduler_steps=self.num_scheduler_steps,
            speculation=None
            if self.speculative_method == "none"
            else SpecConfig(
                method=self.speculative_method,
                num_tokens=self.num_speculative_tokens,
                ngram_min=self.speculative_ngram_min,
                ngram_max=max(self.speculative_ngram_min, self.speculative_ngram_max),
                max_batch=self.speculative_max_batch,
                min_acceptance=self.speculative_min_acceptance,
                adaptive=self.speculative_adaptive,
                draft_model=self.draft_model,
                draft_layers=self.draft_layers,
            ),
        )
