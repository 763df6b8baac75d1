"""The config dataclasses are the one table of settings: every field has a flag (or says why not),
every flag round-trips into its field, and per-pool flags are checked like their base flag."""

from __future__ import annotations

from dataclasses import MISSING, fields

import msgspec
import pytest

from pdserve.cli import build_parser, parse_args
from pdserve.commands.flags import from_args
from pdserve.commands.serve import disagg_config_from, server_config_from
from pdserve.config import (
    CacheConfig,
    DisaggConfig,
    EngineArgs,
    RequestLimits,
    SchedulerConfig,
    ServerConfig,
    worker_specs,
)
from pdserve.config.profiles import PROFILES
from pdserve.config.settings import option, options, pool_options, undeclared
from pdserve.types import KVTransportKind, PrefillFailurePolicy, RoleControl

SETTINGS_CLASSES = (EngineArgs, ServerConfig, RequestLimits, DisaggConfig)

# A valid value other than the default for every setting: a new setting must add one here.
SAMPLES = {
    EngineArgs: dict(
        model="m",
        tokenizer="tok",
        device="cuda:1",
        dtype="bfloat16",
        seed=7,
        max_model_len=512,
        block_size=32,
        num_kv_blocks=100,
        kv_cache_memory="2GiB",
        enable_prefix_caching=False,
        max_num_batched_tokens=512,
        max_num_seqs=8,
        enable_chunked_prefill=False,
        long_prefill_token_threshold=64,
        prefill_first=True,
        reserved_kv_fraction=0.25,
        priority_aging_s=3.5,
        priority_preemption=True,
        num_scheduler_steps=4,
        num_threads=3,
        tensor_parallel_size=2,
        hardware_profile="hw.json",
        linear_backend="torch",
        attention_backend="sdpa",
        enforce_eager=True,
        warmup=False,
        speculative_method="draft",  # both drafts: refused when an engine starts, not here
        draft_model="draft",
        draft_layers=2,
        num_speculative_tokens=6,
        speculative_ngram_min=3,
        speculative_ngram_max=5,
        speculative_max_batch=4,
        speculative_min_acceptance=0.5,
        speculative_adaptive=False,
        quantization="int8",
        quantization_group_size=128,
        quantization_calibration_tokens=1024,
        kv_cache_dtype="int8",
        kv_offload=("cpu:1GiB", "disk:/var/kv:8GiB"),
        kv_offload_reload="always",
    ),
    ServerConfig: dict(
        profile="batch",
        host="0.0.0.0",
        port=9001,
        api_key="k",
        served_model_name="name",
        chat_template="t.jinja",
        max_waiting_requests=5,
        queue_timeout_s=2.5,
        slo_admission=True,
        admission_margin=0.5,
        truncate_prompt="left",
        max_body_bytes=1 << 20,
        max_header_bytes=8192,
        public_metrics=True,
        short_time_slices=True,
        tool_call_parser="hermes",
    ),
    RequestLimits: dict(
        max_n=2,
        max_prompts=3,
        max_sequences=4,
        max_stop=5,
        max_stop_chars=6,
        max_stop_token_ids=7,
        max_logprobs=8,
        max_messages=9,
        max_tools=10,
        max_grammar_chars=11,
    ),
    DisaggConfig: dict(
        num_prefill_workers=2,
        num_decode_workers=3,
        kv_transport=KVTransportKind.TCP,
        kv_host="10.0.0.2",
        kv_transfer_timeout_s=4.5,
        min_prompt_tokens=16,
        on_prefill_failure=PrefillFailurePolicy.FAIL,
        prefill_cpus=("0", "1"),
        decode_cpus=("2-3",),
        restart_workers=True,
        pd_ratio=RoleControl.AUTO,
        slo="ttft_ms=1500,tpot_ms=80",
        pd_min_dwell_s=12.0,
        pd_merge=False,  # refused with ray_address: test_pd_merge_rules covers the flag
        ray_address="10.0.0.1:6379",
        ray_cpus_per_worker=4.0,
        ray_gpus_per_worker=1.0,
        ray_prefill_labels="pool=prefill",
        ray_decode_labels="pool=decode,zone=b",
    ),
}

# An invalid value for every per-pool setting, with the reason the error must give.
INVALID = {
    "block_size": ("12", "power of two"),
    "num_kv_blocks": ("0", ">= 1"),
    "kv_cache_memory": ("lots", "size"),
    "max_num_batched_tokens": ("0", ">= 1"),
    "max_num_seqs": ("0", ">= 1"),
    "long_prefill_token_threshold": ("-1", ">= 0"),
    "num_scheduler_steps": ("65", "in [1, 64]"),
    "tensor_parallel_size": ("0", ">= 1"),
}


def parse_serve(*argv: str):
    return build_parser(["serve"]).parse_args(["serve", "--model", "m", *argv])


def argv_of(cls: type, values: dict) -> list[str]:
    out: list[str] = []
    for opt in options(cls):
        value = values[opt.name]
        if opt.kind is bool:
            out += [opt.flag] if value != opt.default else []
        elif opt.kind is tuple:
            out += [arg for item in value for arg in (opt.flag, item)]
        else:
            out += [opt.flag, str(value)]
    return out


@pytest.mark.parametrize("cls", SETTINGS_CLASSES, ids=lambda c: c.__name__)
def test_every_field_is_a_setting_or_says_why_not(cls):
    assert undeclared(cls) == []
    assert set(SAMPLES[cls]) == {o.name for o in options(cls)}


def test_pd_merge_rules():
    ok = disagg_config_from(
        parse_serve("--decode-workers", "2", "--decode-cpus", "0", "--decode-cpus", "1",
                    "--pd-ratio", "auto", "--pd-merge")
    )  # fmt: skip
    assert ok.pd_merge and ok.pd_ratio == RoleControl.AUTO
    for argv, why in (
        (("--decode-workers", "2", "--decode-cpus", "0", "--pd-merge"), "switchable roles"),
        (("--decode-workers", "2", "--pd-ratio", "manual", "--pd-merge"), "CPU set"),
        (("--prefill-workers", "1", "--decode-cpus", "1", "--pd-ratio", "auto", "--pd-merge"),
         "CPU set"),
        (("--decode-workers", "2", "--decode-cpus", "0", "--pd-ratio", "auto", "--pd-merge",
          "--ray-address", "auto"), "cluster"),
    ):  # fmt: skip
        with pytest.raises(ValueError, match=why):
            disagg_config_from(parse_serve(*argv))
    tp = EngineArgs(model="m", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="tensor-parallel"):
        worker_specs(tp, ok)


def test_every_per_pool_setting_has_an_invalid_example():
    assert set(INVALID) == {o.name for o in pool_options(EngineArgs)}


def test_resolved_configs_have_no_defaults_of_their_own():
    for cls in (CacheConfig, SchedulerConfig):
        assert all(f.default is MISSING for f in fields(cls)), cls


def test_serve_settings_have_distinct_names():
    names = [o.name for cls in SETTINGS_CLASSES for o in options(cls)]
    assert len(names) == len(set(names))  # one argparse namespace holds them all


def test_defaults_round_trip():
    args = parse_serve()
    assert from_args(EngineArgs, args) == EngineArgs(model="m")
    assert from_args(ServerConfig, args) == ServerConfig()
    assert from_args(RequestLimits, args) == RequestLimits()
    assert disagg_config_from(args) == DisaggConfig()


def test_every_flag_round_trips():
    argv = [a for cls in SETTINGS_CLASSES for a in argv_of(cls, SAMPLES[cls])]
    args = build_parser(["serve"]).parse_args(["serve", *argv])
    for cls in SETTINGS_CLASSES:
        assert from_args(cls, args) == cls(**SAMPLES[cls]), cls.__name__
    argv = ["generate", "--prompt", "hi", *argv_of(EngineArgs, SAMPLES[EngineArgs])]
    args = build_parser(["generate"]).parse_args(argv)
    assert from_args(EngineArgs, args) == EngineArgs(**SAMPLES[EngineArgs])


def test_help_shows_each_default_from_its_field(capsys):
    with pytest.raises(SystemExit):
        parse_serve("--help")
    text = " ".join(capsys.readouterr().out.split())
    assert "token budget of one step (default: 2048)" in text
    assert "(default: 16MiB)" in text and "{shm,tcp,auto}" in text


@pytest.mark.parametrize("name", sorted(INVALID))
def test_pool_flags_are_checked_like_their_base_flag(name, capsys):
    text, why = INVALID[name]
    base = option(EngineArgs, name).flag
    for flag in (base, "--prefill-" + base[2:], "--decode-" + base[2:]):
        with pytest.raises(SystemExit) as e:
            parse_serve("--prefill-workers", "1", flag, text)
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert f"argument {flag}: invalid value {text!r}" in err and why in err, err


def test_pool_flags_become_overrides_of_that_pool_only():
    args = parse_serve(
        "--prefill-workers", "1", "--prefill-max-num-batched-tokens", "512",
        "--decode-max-num-seqs", "8", "--decode-kv-cache-memory", "2GiB",
    )  # fmt: skip
    disagg = disagg_config_from(args)
    assert disagg.prefill_overrides == {"max_num_batched_tokens": 512}
    assert disagg.decode_overrides == {"max_num_seqs": 8, "kv_cache_memory": "2GiB"}
    (_, prefill, _), (_, decode, _) = worker_specs(from_args(EngineArgs, args), disagg)
    assert (prefill.max_num_batched_tokens, prefill.max_num_seqs) == (512, 64)
    assert (decode.max_num_batched_tokens, decode.max_num_seqs) == (2048, 8)
    args = parse_serve("--prefill-workers", "1", "--prefill-tensor-parallel-size", "2")
    assert disagg_config_from(args).prefill_overrides == {"tensor_parallel_size": 2}


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"max_num_seqs": 0}, r"decode_overrides\['max_num_seqs'\]=0: must be >= 1"),
        ({"device": "cuda"}, "'device': not a per-pool setting"),
        ({"block_size": "16"}, "must be an integer"),
    ],
)
def test_overrides_given_in_code_are_checked_too(overrides, match):
    with pytest.raises(ValueError, match=match):
        DisaggConfig(num_prefill_workers=1, decode_overrides=overrides)


def test_enum_settings_take_their_choices_from_the_enum():
    assert option(DisaggConfig, "kv_transport").choices == tuple(KVTransportKind)
    assert option(DisaggConfig, "on_prefill_failure").choices == tuple(PrefillFailurePolicy)
    assert DisaggConfig(kv_transport="tcp").kv_transport is KVTransportKind.TCP
    with pytest.raises(SystemExit):
        parse_serve("--kv-transport", "rdma")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_num_seqs": 0}, "max_num_seqs=0: must be >= 1"),
        ({"max_num_seqs": "8"}, "max_num_seqs='8': must be an integer"),
        ({"kv_cache_memory": "lots"}, "kv_cache_memory='lots'"),
        ({"linear_backend": "mkl"}, "must be one of auto, native, onednn, torch"),
        ({"attention_backend": "flash"}, "must be one of auto, native, sdpa"),
        ({"quantization": "fp8"}, "must be one of none, int8, int4"),
        ({"quantization_group_size": 48}, "must be one of 32, 64, 128"),
        (
            {"quantization_calibration_tokens": -1},
            "quantization_calibration_tokens=-1: must be >= 0",
        ),
        ({"kv_cache_dtype": "fp8"}, "must be one of auto, int8"),
        ({"kv_offload": ("gpu:1GiB",)}, "must be cpu:SIZE, disk:PATH:SIZE or both"),
        ({"kv_offload_reload": "never"}, "must be one of auto, always"),
    ],
)
def test_engine_args_in_code_are_checked_like_flags(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EngineArgs(model="m", **kwargs)


def test_engine_args_cross_to_workers_as_json_unchanged():
    args = EngineArgs(**SAMPLES[EngineArgs])
    assert msgspec.json.decode(msgspec.json.encode(args), type=EngineArgs) == args


# ---- scenario profiles ---------------------------------------------------------------------------
def serve_configs(*argv: str):
    _, args = parse_args(["serve", "--model", "m", *argv])
    return from_args(EngineArgs, args), server_config_from(args), disagg_config_from(args)


def setting_values(*configs) -> dict:
    return {o.name: getattr(c, o.name) for c in configs for o in options(type(c))}


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_a_profile_resolves_to_its_settings(name):
    values = setting_values(*serve_configs("--profile", name))
    for key, expected in PROFILES[name].items():
        assert values[key] == expected, key
    # everything it does not name keeps the default
    default = setting_values(*serve_configs())
    changed = {k for k in values if values[k] != default[k]}
    assert changed <= set(PROFILES[name]) | {"profile"}


def test_any_flag_overrides_the_profile():
    engine, server, disagg = serve_configs(
        "--profile", "chat", "--no-prefill-first", "--max-num-batched-tokens", "300",
        "--truncate-prompt", "error",
    )  # fmt: skip
    assert not engine.prefill_first and engine.max_num_batched_tokens == 300
    assert server.truncate_prompt == "error"
    assert server.slo_admission and engine.long_prefill_token_threshold == 256  # the rest holds
    _, _, disagg = serve_configs("--profile", "mixed", "--pd-ratio", "manual")
    assert disagg.pd_ratio == RoleControl.MANUAL and disagg.num_prefill_workers == 1


def test_the_docs_list_each_profile_as_the_code_defines_it():
    """docs/ARCHITECTURE.md, "Scenario profiles": one row per setting, one column per profile."""
    from pathlib import Path

    text = (Path(__file__).parents[2] / "docs" / "ARCHITECTURE.md").read_text()
    table = text[text.index("| setting | chat | batch | mixed |") :].split("\n\n")[0]
    rows = [line.strip("|").split("|") for line in table.splitlines()[2:]]
    documented = {name: {} for name in PROFILES}
    for flag, *cells in rows:
        flag = flag.strip().strip("`")
        name = next(o.name for cls in SETTINGS_CLASSES for o in options(cls) if o.flag == flag)
        for profile, cell in zip(PROFILES, cells, strict=True):
            cell = cell.strip().strip("`")
            if cell != "":
                documented[profile][name] = cell
    for profile, settings in PROFILES.items():
        shown = {k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in settings.items()}
        assert documented[profile] == shown, profile
