"""The attention seam: a backend handed to the model is the one its layers call, and models/ does
not reach into the runner for it."""

from __future__ import annotations

import ast
from pathlib import Path

import torch

from pdserve.config import ModelConfig
from pdserve.models.attention import AttentionMetadata, PagedSDPABackend, PrefillChunk
from pdserve.models.loader import load_model

MODELS_DIR = Path(__file__).resolve().parents[2] / "pdserve" / "models"


class RecordingBackend:
    """The default backend, noting which layer cache each call attended over."""

    name = "recording"

    def __init__(self) -> None:
        self.inner = PagedSDPABackend()
        self.caches: list[int] = []

    def forward(self, q, k, v, kv_cache, meta):
        self.caches.append(kv_cache.data_ptr())
        return self.inner.forward(q, k, v, kv_cache, meta)


def prefill_meta(n: int) -> AttentionMetadata:
    return AttentionMetadata(
        slot_mapping=torch.arange(n), prefills=[PrefillChunk(0, n, None, None)]
    )


def decode_meta(pos: int) -> AttentionMetadata:
    return AttentionMetadata(
        slot_mapping=torch.tensor([pos]),
        num_decodes=1,
        decode_slots=torch.arange(pos + 1)[None],
        decode_mask=torch.ones(1, 1, 1, pos + 1, dtype=torch.bool),
    )


def test_custom_backend_is_called_once_per_layer_per_step_with_identical_logits(tiny_models):
    cfg = ModelConfig.from_pretrained(tiny_models["llama"])
    assert cfg.num_kv_heads < cfg.num_heads  # grouped-query attention goes through the seam too
    cpu, max_len = torch.device("cpu"), 64
    default = load_model(cfg, cpu, torch.float32, max_len)
    recording = RecordingBackend()
    custom = load_model(cfg, cpu, torch.float32, max_len, attn_backend=recording)
    assert isinstance(default.attn_backend, PagedSDPABackend)
    assert custom.attn_backend is recording

    def caches() -> list[torch.Tensor]:
        shape = (cfg.num_layers, 2, max_len, cfg.num_kv_heads, cfg.head_dim)
        return list(torch.zeros(shape).unbind(0))

    default_caches, custom_caches = caches(), caches()
    layer_ptrs = [c.data_ptr() for c in custom_caches]
    prompt = list(range(3, 13))
    ids, positions, meta = torch.tensor(prompt), torch.arange(len(prompt)), prefill_meta(10)
    for step in range(4):  # a prefill, then three decodes of the greedy token
        logits = [
            model.compute_logits(model(ids, positions, kv, meta))
            for model, kv in ((default, default_caches), (custom, custom_caches))
        ]
        assert torch.equal(logits[0], logits[1])
        assert recording.caches == layer_ptrs * (step + 1)
        pos = int(positions[-1]) + 1
        ids, positions, meta = logits[0][-1:].argmax(-1), torch.tensor([pos]), decode_meta(pos)


def test_models_do_not_import_the_runner():
    for path in MODELS_DIR.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                names = [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            assert not any(n.startswith("pdserve.runner") for n in names), path.name


def test_loading_draws_no_random_weights_the_checkpoint_overwrites(tiny_models, monkeypatch):
    """The model tree is built on the meta device and filled from the checkpoint. A random init
    there is not only wasted: on meta it runs torch's reference ops, whose import of
    torch._dynamo cost about 2 s of every engine start."""

    def refuse(*args, **kwargs):
        raise AssertionError("a weight was initialised at random before loading")

    monkeypatch.setattr(torch.nn.init, "normal_", refuse)
    cfg = ModelConfig.from_pretrained(tiny_models["llama"])
    model = load_model(cfg, torch.device("cpu"), torch.float32, 64)
    assert model.embed_tokens.weight.device.type == "cpu"
