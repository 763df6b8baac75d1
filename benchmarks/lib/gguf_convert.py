"""A pdserve random-weight model folder as GGUF files for llama.cpp, to compare on the same weights.

llama.cpp's `convert_hf_to_gguf.py` converts the weights, but it only knows the tokenizers of
published models, and the random models' byte-level tokenizer is not one of them. The benchmarks
feed llama.cpp token ids, never text, so the converter runs with its vocabulary step replaced by
a plain SentencePiece-style list of the same size (unknown, BOS and EOS first, then the 256 byte
tokens llama.cpp looks up, then placeholders): the weights and the shapes are the model's own.
Run in a subprocess, so nothing of llama.cpp's Python lands in the benchmark's process.

    python benchmarks/lib/gguf_convert.py LLAMA_CPP_DIR MODEL_DIR OUT.gguf
"""

from __future__ import annotations

import sys
from pathlib import Path


def set_plain_vocab(self) -> None:
    import gguf

    n = self.hparams["vocab_size"]
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))]
    tokens += [f"<t{i}>" for i in range(n - len(tokens))]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    types += [gguf.TokenType.BYTE] * 256 + [gguf.TokenType.NORMAL] * (n - 259)
    w = self.gguf_writer
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * n)
    w.add_token_types(types)
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)


def main(llama_cpp: str, model_dir: str, out: str) -> None:
    root = Path(llama_cpp)
    sys.path[:0] = [str(root), str(root / "gguf-py")]
    sys.argv = ["convert_hf_to_gguf.py", model_dir, "--outtype", "f32", "--outfile", out]
    import convert_hf_to_gguf
    from conversion.llama import LlamaModel

    LlamaModel.set_vocab = set_plain_vocab
    convert_hf_to_gguf.main()


if __name__ == "__main__":
    main(*sys.argv[1:4])
