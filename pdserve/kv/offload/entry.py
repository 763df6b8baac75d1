"""What names a tier entry and proves it intact: the layout fingerprint, the key, the checksum.

The fingerprint covers everything that decides a block's bytes apart from its tokens: the KV
layout (model shapes, cache dtype, layers, KV heads, row width, block size), the weights' numeric
form (dtype, quantization) and, for a tier that outlives the server (disk), the weights
themselves (`weights_digest`). The key is the block's prefix-cache chain hash (16 bytes), which
names its tokens and every token before them.
"""

from __future__ import annotations

import hashlib
import json
import os
import zlib

import numpy as np

KEY_BYTES = 16
FINGERPRINT_BYTES = 16


def checksum(payload: np.ndarray | bytes | memoryview) -> int:
    """CRC-32 of a payload (zlib releases the GIL on large buffers: the store thread runs it)."""
    return zlib.crc32(payload)


def fingerprint(*parts: str | bytes) -> bytes:
    h = hashlib.blake2b(digest_size=FINGERPRINT_BYTES)
    for part in parts:
        data = part.encode() if isinstance(part, str) else part
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.digest()


def weights_digest(model_dir: str, memo_dir: str | None = None) -> str:
    """SHA-256 over the model's config.json and every weight file's bytes.

    Hashing reads every byte once (about 1.5 GB/s); with `memo_dir` each file's digest is kept
    under its path, size, inode and modification time, so a restart with unchanged files reads
    nothing. A file rewritten in place with its size and mtime restored would fool the memo;
    nothing else short of recomputing the KV would catch that, and the tier would then be wrong."""
    h = hashlib.sha256()
    names = sorted(
        n for n in os.listdir(model_dir) if n == "config.json" or n.endswith(".safetensors")
    )
    if not any(n.endswith(".safetensors") for n in names):
        raise ValueError(f"{model_dir}: no safetensors weights to fingerprint")
    memo = _load_memo(memo_dir)
    changed = False
    for name in names:
        path = os.path.realpath(os.path.join(model_dir, name))
        st = os.stat(path)
        stamp = f"{st.st_size}:{st.st_ino}:{st.st_mtime_ns}"
        entry = memo.get(path)
        if entry is None or entry.get("stamp") != stamp:
            with open(path, "rb") as f:
                entry = {"stamp": stamp, "sha256": hashlib.file_digest(f, "sha256").hexdigest()}
            memo[path] = entry
            changed = True
        h.update(name.encode() + b"\0" + entry["sha256"].encode())
    if changed:
        _save_memo(memo_dir, memo)
    return h.hexdigest()


def _memo_path(memo_dir: str) -> str:
    return os.path.join(memo_dir, "weights-digests.json")


def _load_memo(memo_dir: str | None) -> dict:
    if memo_dir is None:
        return {}
    try:
        with open(_memo_path(memo_dir)) as f:
            memo = json.load(f)
        return memo if isinstance(memo, dict) else {}
    except (OSError, ValueError):
        return {}


def _save_memo(memo_dir: str | None, memo: dict) -> None:
    if memo_dir is None:
        return
    tmp = f"{_memo_path(memo_dir)}.{os.getpid()}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(memo, f)
        os.replace(tmp, _memo_path(memo_dir))
    except OSError:
        pass  # a memo that cannot be written only costs a re-hash next time
