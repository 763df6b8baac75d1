"""Random-weight model folders (`pdserve make-model`) load in Hugging Face `transformers` offline,
with the config, weights and tokenizer the presets describe."""

from __future__ import annotations

import json
import os
import stat
import time

import pytest
import torch
from safetensors.torch import load_file

from pdserve.cli import main
from pdserve.models.make import build_config, tensor_specs, write_random_model
from pdserve.models.presets import PRESETS
from pdserve.perf.cost import ModelShape, num_params

ARCHS = ["llama", "qwen2", "qwen3", "mistral"]
TEXT = "Hello, wörld! 你好 \n\t  spaces, tabs and émojis 🙂 <t_300>"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("made")
    return {arch: write_random_model(root / arch, f"{arch}-tiny") for arch in ARCHS}


def load_hf(folder):
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, output_loading_info=True
    )
    return model.eval(), info


def load_tokenizer(folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def read_weights(folder) -> dict[str, torch.Tensor]:
    tensors = {}
    for path in sorted(folder.glob("model*.safetensors")):
        tensors |= load_file(path)
    return tensors


@pytest.mark.parametrize("arch", ARCHS)
def test_folder_loads_in_transformers_with_every_weight(folders, arch):
    model, info = load_hf(folders[arch])
    assert type(model).__name__ == PRESETS[f"{arch}-tiny"]["architectures"][0]
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert not info["mismatched_keys"]
    config = json.loads((folders[arch] / "config.json").read_text())
    assert model.num_parameters() == num_params(ModelShape.from_hf_config(config))
    with torch.no_grad():
        logits = model(torch.tensor([[1, 50, 60, 70]])).logits
    assert logits.shape == (1, 4, 512) and torch.isfinite(logits).all()


@pytest.mark.parametrize("arch", ARCHS)
def test_config_matches_preset(folders, arch):
    config = json.loads((folders[arch] / "config.json").read_text())
    preset = PRESETS[f"{arch}-tiny"]
    for key, value in preset.items():
        assert config[key] == value, key
    assert config["model_type"] == arch
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    assert config["torch_dtype"] == "float32"
    assert "rope_theta" in config and "rope_scaling" in config
    generation = json.loads((folders[arch] / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"]) == (1, 2)


def test_arch_specific_weights(folders):
    qwen2 = read_weights(folders["qwen2"])
    assert qwen2["model.layers.0.self_attn.k_proj.bias"].shape == (32,)
    qwen3 = read_weights(folders["qwen3"])
    assert qwen3["model.layers.1.self_attn.q_norm.weight"].shape == (32,)  # head_dim 32
    assert qwen3["model.layers.1.self_attn.q_proj.weight"].shape == (4 * 32, 64)
    llama = read_weights(folders["llama"])
    assert not any(name.endswith(".bias") for name in llama)
    assert "lm_head.weight" in llama
    assert json.loads((folders["mistral"] / "config.json").read_text())["sliding_window"] is None


def test_weights_follow_the_init_scheme(folders):
    weights = read_weights(folders["qwen2"])
    assert weights["model.embed_tokens.weight"].std().item() == pytest.approx(1.0, rel=0.05)
    down = weights["model.layers.0.mlp.down_proj.weight"]  # fan_in 128
    assert down.std().item() == pytest.approx(128**-0.5, rel=0.1)
    norm = weights["model.layers.0.input_layernorm.weight"]
    assert norm.min().item() >= 0.5 and norm.max().item() <= 1.5
    bias = weights["model.layers.0.self_attn.q_proj.bias"]
    assert bias.std().item() == pytest.approx(0.1, rel=0.3)


@pytest.mark.parametrize("arch", ARCHS)
def test_tokenizer_round_trips_and_matches_vocab(folders, arch):
    tok = load_tokenizer(folders[arch])
    assert len(tok) == 512 == json.loads((folders[arch] / "config.json").read_text())["vocab_size"]
    ids = tok.encode(TEXT)
    assert ids[0] == tok.bos_token_id == 1
    assert tok.eos_token_id == 2
    assert tok.decode(ids, skip_special_tokens=True) == TEXT
    assert max(ids) < 512


def test_every_id_decodes(folders):
    tok = load_tokenizer(folders["llama"])
    assert tok.decode([511]) == "<t_511>"
    assert tok.decode([4 + ord("A")]) == "A"  # byte tokens follow the specials, in byte order
    assert isinstance(tok.decode(list(range(512))), str)


def test_chat_template_renders_with_bos(folders):
    tok = load_tokenizer(folders["llama"])
    messages = [{"role": "user", "content": "hi"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<s><|user|>\nhi</s>\n<|assistant|>\n"


def test_greedy_logits_are_well_separated(folders):
    model, _ = load_hf(folders["llama"])
    with torch.no_grad():
        logits = model(torch.arange(4, 68).unsqueeze(0)).logits[0]
    top2 = logits.topk(2, dim=-1).values
    gaps = top2[:, 0] - top2[:, 1]
    assert gaps.median().item() > 1.0


def test_same_seed_same_weights_other_seed_other_weights(tmp_path):
    a = read_weights(write_random_model(tmp_path / "a", "llama-tiny", seed=3))
    b = read_weights(write_random_model(tmp_path / "b", "llama-tiny", seed=3))
    c = read_weights(write_random_model(tmp_path / "c", "llama-tiny", seed=4))
    assert all(torch.equal(a[name], b[name]) for name in a)
    assert not torch.equal(a["model.norm.weight"], c["model.norm.weight"])


def test_sharded_folder_matches_hf_layout_and_loads(tmp_path):
    single = write_random_model(tmp_path / "single", "llama-tiny")
    sharded = write_random_model(tmp_path / "sharded", "llama-tiny", max_shard_size="150KB")
    files = sorted(p.name for p in sharded.glob("model*.safetensors"))
    n = len(files)
    assert n > 1
    assert files == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    names = [spec.name for spec in tensor_specs(build_config("llama-tiny"))]
    assert sorted(index["weight_map"]) == sorted(names)
    assert set(index["weight_map"].values()) == set(files)
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in read_weights(single).values())
    for name in files:  # every shard but a lone oversized tensor fits the limit
        shard = load_file(sharded / name)
        assert len(shard) == 1 or sum(t.nbytes for t in shard.values()) <= 150_000

    model_a, _ = load_hf(single)
    model_b, info = load_hf(sharded)
    assert not info["missing_keys"]
    ids = torch.tensor([[1, 40, 41, 42]])
    with torch.no_grad():
        assert torch.equal(model_a(ids).logits, model_b(ids).logits)


def test_rewrite_removes_old_shards(tmp_path):
    write_random_model(tmp_path, "llama-tiny", max_shard_size="150KB")
    write_random_model(tmp_path, "llama-tiny")
    assert [p.name for p in tmp_path.glob("model*")] == ["model.safetensors"]


def test_overrides_and_dtype(tmp_path):
    out = write_random_model(
        tmp_path,
        "qwen3-tiny",
        dtype="bfloat16",
        num_hidden_layers=3,
        vocab_size=300,
        max_position_embeddings=128,
        tie_word_embeddings=True,
    )
    config = json.loads((out / "config.json").read_text())
    assert config["num_hidden_layers"] == 3 and config["vocab_size"] == 300
    assert config["max_position_embeddings"] == 128 and config["torch_dtype"] == "bfloat16"
    weights = read_weights(out)
    assert "lm_head.weight" not in weights and "model.layers.2.mlp.up_proj.weight" in weights
    assert all(t.dtype == torch.bfloat16 for t in weights.values())
    assert len(load_tokenizer(out)) == 300


def test_big_preset_configs_load_in_transformers(tmp_path):
    from transformers import AutoConfig

    for preset in ("llama-3.2-1b", "qwen2.5-0.5b", "qwen3-0.6b", "llama-125m"):
        folder = tmp_path / preset
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(build_config(preset)))
        config = AutoConfig.from_pretrained(folder)
        assert config.hidden_size == PRESETS[preset]["hidden_size"]
    llama3 = AutoConfig.from_pretrained(tmp_path / "llama-3.2-1b")
    rope = llama3.rope_parameters
    assert rope["rope_type"] == "llama3" and rope["factor"] == 32.0
    assert rope["rope_theta"] == 500000.0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(preset="gpt2-tiny"), "unknown preset 'gpt2-tiny'.*llama-tiny"),
        (dict(arch="gpt2"), "unknown arch 'gpt2'.*qwen3"),
        (dict(preset="llama-tiny", arch="qwen2"), "does not match"),
        (dict(preset="llama-tiny", num_layers=2), "unknown config field 'num_layers'"),
        (dict(preset="llama-tiny", vocab_size=100), "vocab_size=100"),
        (dict(preset="llama-tiny", num_key_value_heads=3), "num_key_value_heads=3"),
        (dict(preset="llama-tiny", dtype="int8"), "torch_dtype='int8'"),
    ],
)
def test_bad_input_raises_value_error(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        write_random_model(tmp_path, **kwargs)


def test_cli_writes_a_folder(tmp_path, capsys):
    out = tmp_path / "m"
    args = ["make-model", "--arch", "qwen2", "--layers", "3", "--no-tie", "--seed", "7", str(out)]
    assert main(args) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "qwen2" and config["num_hidden_layers"] == 3
    assert config["tie_word_embeddings"] is False
    assert "Qwen2ForCausalLM" in capsys.readouterr().out


def test_weights_get_the_mode_of_any_new_file(tmp_path):
    old = os.umask(0o022)
    try:
        out = write_random_model(tmp_path / "m", "llama-tiny", seed=1)
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()}
    assert modes["model.safetensors"] == modes["config.json"] == 0o644, modes


def test_cli_reports_bad_shapes(tmp_path, capsys):
    args = ["make-model", "--preset", "llama-tiny", "--hidden-size", "65", str(tmp_path)]
    assert main(args) == 2
    assert "hidden_size=65" in capsys.readouterr().err


@pytest.mark.slow
def test_llama_125m_writes_in_seconds_with_125m_params(tmp_path):
    start = time.perf_counter()
    out = write_random_model(tmp_path, "llama-125m")
    elapsed_s = time.perf_counter() - start
    weights = read_weights(out)
    assert sum(t.numel() for t in weights.values()) == pytest.approx(125e6, rel=0.05)
    model, info = load_hf(out)
    assert not info["missing_keys"]
    assert elapsed_s < 30
