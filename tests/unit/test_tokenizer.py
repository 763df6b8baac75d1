"""The torch-free tokenizer loader: the tokenizer `AutoTokenizer` loads, and a frontend that
tokenizes, renders chat, checks grammars, parses tools and detokenizes without importing torch."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from pdserve.frontend.tokenizer import load_tokenizer

TEXTS = [
    "Once upon a time, there was a little girl named Lily.",
    "  leading spaces, trailing ones  ",
    "line one\nline two\n\n\ttab",
    "café, 5 €, 你好, 🐶 and naïve 😀",
    "<s>special</s> text <unk> <pad>",
    "",
]
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hello, who are you?"},
    {"role": "assistant", "content": "A model."},
    {"role": "user", "content": "Tell me a story 🐶"},
]


def model_folders(stories_path: str, tiny_models: dict[str, str]) -> dict[str, str]:
    return {"stories260K": stories_path, **tiny_models}


def with_config(tmp_path: Path, src: str, name: str, tokenizer_class, model_type=None) -> str:
    """A copy of `src`'s tokenizer with `tokenizer_class` (None: removed) and `model_type` ("":
    no config.json)."""
    out = tmp_path / name
    out.mkdir()
    for f in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        if f != "config.json" or model_type != "":
            shutil.copy(Path(src) / f, out / f)
    tc = json.loads((out / "tokenizer_config.json").read_text())
    tc.pop("tokenizer_class", None)
    if tokenizer_class is not None:
        tc["tokenizer_class"] = tokenizer_class
    (out / "tokenizer_config.json").write_text(json.dumps(tc))
    if model_type:
        config = json.loads((out / "config.json").read_text())
        (out / "config.json").write_text(json.dumps({**config, "model_type": model_type}))
    return str(out)


def behaviour(tok) -> dict:
    """What the project uses a tokenizer for, and what makes it that tokenizer."""
    every_id = list(range(len(tok)))
    ids = tok.encode(" ".join(TEXTS))
    seen = {
        "class": type(tok),
        "len": len(tok),
        "vocab": tok.get_vocab(),
        "backend": tok.backend_tokenizer.to_str(),  # normalizer, pre-tokenizer, model, decoder
        "tokens": tok.convert_ids_to_tokens(every_id),
    }
    for attr in (
        "vocab_size", "bos_token", "eos_token", "unk_token", "pad_token", "bos_token_id",
        "eos_token_id", "all_special_tokens", "all_special_ids", "chat_template",
        "model_max_length", "name_or_path",
    ):  # fmt: skip
        seen[attr] = getattr(tok, attr)
    for special in (True, False):
        seen[f"batch encode {special}"] = tok(TEXTS, add_special_tokens=special).input_ids
        seen[f"encode {special}"] = [tok.encode(t, add_special_tokens=special) for t in TEXTS]
        seen[f"decode each {special}"] = tok.batch_decode(
            [[i] for i in every_id], skip_special_tokens=special
        )
        seen[f"decode {special}"] = tok.decode(ids, skip_special_tokens=special)
    if tok.chat_template:
        for gen in (True, False):
            text = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=gen)
            seen[f"chat {gen}"] = text
            seen[f"chat ids {gen}"] = tok(text, add_special_tokens=False).input_ids
    return seen


def assert_same_tokenizer(ours, ref) -> None:
    got, want = behaviour(ours), behaviour(ref)
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert got[key] == value, key


def test_the_loader_gives_autotokenizers_tokenizer(stories_path, tiny_models):
    """Every model at hand: the real tiny model (SentencePiece-style `LlamaTokenizer`) and the
    random-weight folders of each architecture (byte-level, `Qwen2Tokenizer` for qwen2)."""
    for folder in model_folders(stories_path, tiny_models).values():
        assert_same_tokenizer(load_tokenizer(folder), AutoTokenizer.from_pretrained(folder))


@pytest.mark.parametrize(
    ("src", "tokenizer_class", "model_type"),
    [
        ("stories260K", "LlamaTokenizerFast", None),
        ("stories260K", "PreTrainedTokenizerFast", None),
        ("stories260K", "TokenizersBackend", None),
        ("stories260K", None, None),  # the model type's class
        ("stories260K", "LlamaTokenizer", "mistral"),
        ("llama", "LlamaTokenizer", None),  # byte-level tokenizer.json: not LlamaTokenizer
        ("llama", None, None),
        ("qwen2", "LlamaTokenizer", None),  # qwen2: its registered class, whatever is named
        ("qwen2", None, None),
        ("qwen3", "Qwen2TokenizerFast", None),
        ("qwen3", "LlamaTokenizerFast", None),
        ("qwen3", None, None),
        ("mistral", "LlamaTokenizer", None),
        ("mistral", None, None),
        ("stories260K", "LlamaTokenizer", ""),  # a tokenizer folder without config.json
        ("llama", None, ""),
    ],
)  # fmt: skip
def test_the_class_is_autotokenizers_choice(
    stories_path, tiny_models, tmp_path, src, tokenizer_class, model_type
):
    folder = with_config(
        tmp_path, model_folders(stories_path, tiny_models)[src], "m", tokenizer_class, model_type
    )
    assert_same_tokenizer(load_tokenizer(folder), AutoTokenizer.from_pretrained(folder))


def test_bad_folders_are_a_value_error(tmp_path, tiny_models):
    with pytest.raises(ValueError, match="not a folder"):
        load_tokenizer(tmp_path / "missing")
    folder = with_config(tmp_path, tiny_models["llama"], "remote", "PreTrainedTokenizerFast")
    tc = json.loads(Path(folder, "tokenizer_config.json").read_text())
    tc["auto_map"] = {"AutoTokenizer": [None, "tok.MyTokenizer"]}
    Path(folder, "tokenizer_config.json").write_text(json.dumps(tc))
    with pytest.raises(ValueError, match="auto_map"):
        load_tokenizer(folder)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="invalid tokenizer"):
        load_tokenizer(tmp_path / "empty")


FRONTEND_WITHOUT_TORCH = """
import asyncio, importlib, pkgutil, sys, types
import pdserve.cli, pdserve.commands.serve, pdserve.frontend
for m in pkgutil.iter_modules(pdserve.frontend.__path__):  # every module the frontend has
    importlib.import_module(f"pdserve.frontend.{m.name}")
from pdserve.frontend import openai_format, tools
from pdserve.frontend.inputs import InputProcessor
from pdserve.frontend.metrics import ServerMetrics
from pdserve.frontend.output_processor import OutputProcessor
from pdserve.frontend.protocol import ChatCompletionRequest, CompletionRequest
from pdserve.frontend.tokenizer import load_tokenizer
from pdserve.types import EngineCoreOutput, SamplingParams

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}

async def frontend(path):
    tok = load_tokenizer(path)
    inputs = InputProcessor(tok, path, None)
    inputs.set_model_limits(4096, len(tok))
    [(_, ids, dropped)] = await inputs.completion_prompts("Once upon a time, Lily", None)
    assert dropped == 0
    assert tok.decode(ids, skip_special_tokens=True) == "Once upon a time, Lily"
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}],
                                 tools=[WEATHER], tool_choice="required")
    chat_ids, _ = await inputs.chat_prompt(body)
    params = await inputs.constrain(body, SamplingParams(max_tokens=8))
    assert params.grammar and chat_ids
    body = CompletionRequest(prompt="x", guided_json={"type": "object"})
    assert (await inputs.constrain(body, SamplingParams(max_tokens=8))).grammar
    proc = OutputProcessor(tok)
    proc.add_request("r", None, ids, SamplingParams(max_tokens=4, n=2, stop=["zz"]), 0.0)
    out = proc.process([EngineCoreOutput(c, ids[1:3]) for c in proc.core_ids("r")])
    out = proc.process([EngineCoreOutput(c, ids[3:4], finish_reason="length")
                        for c in proc.core_ids("r")])
    assert out.request_outputs[0].finished and out.request_outputs[0].outputs[0].text
    ServerMetrics().on_finish(types.SimpleNamespace(role="both", worker_id=0), out.request_outputs[0])
    ServerMetrics().render()
    assert [openai_format.TokenText(tok)(i) for i in ids]
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tools=[WEATHER])
    stream = tools.ToolStream(body, tools.parser_for("Qwen3ForCausalLM", tok.chat_template))
    text = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    assert stream.feed(text[:9]) == "" and stream.feed(text[9:]) == ""
    assert [c.name for c in stream.finish()[1]] == ["get_weather"]
    inputs.close()

for path in sys.argv[1:]:
    asyncio.run(frontend(path))
loaded = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
print(loaded)
sys.exit(int(bool(loaded)))
"""


def test_the_frontend_never_imports_torch(stories_path, tiny_models):
    """`pdserve serve`'s modules, and the tokenizer at work in all of them, leave torch out."""
    folders = [stories_path, tiny_models["qwen2"]]
    r = subprocess.run(
        [sys.executable, "-c", FRONTEND_WITHOUT_TORCH, *folders],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stdout + r.stderr
