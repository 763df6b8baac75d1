"""Config parsing: both rope config styles, EOS ids, sizes, and clear errors."""

from __future__ import annotations

import pytest

from pdserve.config import EngineArgs, ModelConfig, RopeConfig, parse_size

BASE = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 100,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "eos_token_id": 2,
}


def test_classic_and_transformers5_rope_styles_agree():
    scaling = {
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    classic = RopeConfig.from_hf({"rope_theta": 500000.0, "rope_scaling": scaling})
    v5 = RopeConfig.from_hf({"rope_parameters": {"rope_theta": 500000.0, **scaling}})
    assert classic == v5
    assert classic.theta == 500000.0 and classic.rope_type == "llama3" and classic.factor == 32.0


def test_rope_defaults_and_unknown_type():
    assert RopeConfig.from_hf({}) == RopeConfig()
    with pytest.raises(ValueError, match="yarn"):
        RopeConfig.from_hf({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}})


def test_eos_ids_merge_generation_config():
    cfg = ModelConfig.from_hf_dict(BASE, generation={"eos_token_id": [2, 7]})
    assert cfg.eos_token_ids == (2, 7)
    assert cfg.head_dim == 16 and cfg.num_kv_heads == 2


def test_qwen_flags_and_mistral_window_caps_context():
    q2 = ModelConfig.from_hf_dict(
        {**BASE, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 32}
    )
    assert q2.qkv_bias and not q2.qk_norm and q2.sliding_window is None
    q3 = ModelConfig.from_hf_dict({**BASE, "architectures": ["Qwen3ForCausalLM"]})
    assert q3.qk_norm and not q3.qkv_bias
    m = ModelConfig.from_hf_dict(
        {
            **BASE,
            "architectures": ["MistralForCausalLM"],
            "sliding_window": 256,
            "max_position_embeddings": 4096,
        }
    )
    assert m.max_model_len == 256  # full attention is exact up to the window


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"architectures": ["BertModel"]}, "BertModel"),
        ({"architectures": []}, "architectures"),
        ({"num_key_value_heads": 3}, "num_key_value_heads=3"),
    ],
)
def test_bad_model_configs(change, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf_dict({**BASE, **change})


def test_missing_field_is_named():
    cfg = dict(BASE)
    del cfg["num_hidden_layers"]
    with pytest.raises(ValueError, match="num_hidden_layers"):
        ModelConfig.from_hf_dict(cfg)


def test_missing_config_file(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        ModelConfig.from_pretrained(tmp_path)


@pytest.mark.parametrize(
    ("text", "value"),
    [("2GiB", 2 << 30), ("512MiB", 512 << 20), ("1GB", 10**9), ("1e3", 1000), (4096, 4096)],
)
def test_parse_size(text, value):
    assert parse_size(text) == value


def test_bad_sizes_and_args():
    with pytest.raises(ValueError, match="lots"):
        parse_size("lots")
    with pytest.raises(ValueError, match="block_size=12"):
        EngineArgs(model="x", block_size=12)
    with pytest.raises(ValueError, match="device='tpu'"):
        EngineArgs(model="x", device="tpu")
    with pytest.raises(ValueError, match="dtype='int8'"):
        EngineArgs(model="x", dtype="int8")


def test_worker_specs_per_pool_overrides_and_cpus():
    from pdserve.config import DisaggConfig, worker_specs

    args = EngineArgs(model="m", max_num_batched_tokens=2048)
    assert [(r, c) for r, _, c in worker_specs(args, DisaggConfig())] == [("both", None)]
    d = DisaggConfig(
        num_prefill_workers=1,
        num_decode_workers=2,
        prefill_cpus=("0",),
        decode_cpus=("1",),
        prefill_overrides={"max_num_batched_tokens": 512},
        decode_overrides={"max_num_seqs": 8},
    )
    specs = worker_specs(args, d)
    assert [(r, c) for r, _, c in specs] == [("prefill", "0"), ("decode", "1"), ("decode", "1")]
    assert specs[0][1].max_num_batched_tokens == 512 and specs[1][1].max_num_seqs == 8
    assert specs[1][1].max_num_batched_tokens == 2048


def test_ray_placement_settings():
    """On a cluster: KV over tcp, a worker's threads are its actor's CPUs (unless set), and
    this host's CPU sets are not passed on."""
    from pdserve.config import DisaggConfig, worker_specs
    from pdserve.config.disagg import parse_labels

    assert parse_labels(" pool = prefill ,zone=a") == {"pool": "prefill", "zone": "a"}
    assert parse_labels("") == {}
    d = DisaggConfig(
        num_prefill_workers=1,
        ray_address="auto",
        ray_cpus_per_worker=4,
        prefill_cpus=("0",),
    )
    assert d.kv_transport == "tcp"
    specs = worker_specs(EngineArgs(model="m"), d)
    assert [(r, a.num_threads, c) for r, a, c in specs] == [
        ("prefill", 4, None),
        ("decode", 4, None),
    ]
    specs = worker_specs(EngineArgs(model="m", num_threads=2), d)
    assert [a.num_threads for _, a, _ in specs] == [2, 2]
    assert DisaggConfig(num_prefill_workers=1).kv_transport == "shm"  # no cluster: unchanged


def test_tensor_parallel_size_is_set_per_pool():
    from pdserve.config import DisaggConfig, worker_specs

    args = EngineArgs(model="m", tensor_parallel_size=2)
    d = DisaggConfig(num_decode_workers=2, pd_ratio="manual")
    assert [a.tensor_parallel_size for _, a, _ in worker_specs(args, d)] == [2, 2]
    d = DisaggConfig(num_prefill_workers=1, decode_overrides={"tensor_parallel_size": 1})
    specs = worker_specs(args, d)
    assert [(r, a.tensor_parallel_size) for r, a, _ in specs] == [("prefill", 2), ("decode", 1)]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_decode_workers": 0}, "decode_workers=0"),
        ({"num_decode_workers": 1, "pd_ratio": "auto"}, "at least two workers"),
        ({"num_prefill_workers": 1, "kv_transport": "rdma"}, "kv_transport='rdma'"),
        ({"num_prefill_workers": 1, "prefill_overrides": {"bogus": 1}}, "bogus"),
        ({"num_prefill_workers": 1, "on_prefill_failure": "retry"}, "on_prefill_failure"),
        ({"ray_prefill_labels": "pool"}, "ray_prefill_labels='pool'.*KEY=VALUE"),
        ({"ray_decode_labels": "a=1,=2"}, "ray_decode_labels"),
        ({"ray_cpus_per_worker": 0}, "ray_cpus_per_worker=0"),
    ],
)
def test_bad_disagg_configs(kwargs, match):
    from pdserve.config import DisaggConfig

    with pytest.raises(ValueError, match=match):
        DisaggConfig(**kwargs)
