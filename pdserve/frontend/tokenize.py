"""Prompt tokenization off the event loop, so one huge prompt never stalls other requests.

Ordinary prompts are encoded in a small thread pool: the Rust tokenizer releases the GIL while it
encodes. A prompt over `LARGE_PROMPT_CHARS` goes to one child process instead: turning millions of
token ids into a Python list holds the GIL for hundreds of milliseconds, and there the child
pays for it. The child (a daemon that dies with the frontend; msgpack over a pipe, no pickle)
keeps only what the request can use (the last `keep_last` ids, or none if the prompt cannot fit
the context), so at most a context's worth of ids comes back; it also takes at most one core,
however many huge prompts arrive at once.

Both paths encode with the tokenizer's Rust backend when it has one (what `tokenizer.encode`
calls for fast tokenizers), else with `tokenizer.encode`.
"""

from __future__ import annotations

import asyncio
import ctypes
import multiprocessing
import os
import signal
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import msgspec

from pdserve.ipc import sched_slice

LARGE_PROMPT_CHARS = 1 << 20
NUM_THREADS = 4


@dataclass(frozen=True)
class Encoded:
    num_tokens: int  # of the whole text
    ids: list[int] | None  # the last `keep_last` ids (all when None); None if over `max_tokens`


def encode(
    tokenizer, text: str, add_special_tokens: bool, keep_last: int | None, max_tokens: int
) -> Encoded:
    """Token ids of `text`, cut to the last `keep_last`; ids None when there are more than
    `max_tokens` of them after the cut (the caller rejects the prompt without the list)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        enc = backend.encode(text, add_special_tokens=add_special_tokens)
        num_tokens = len(enc)
        kept = num_tokens if keep_last is None else min(num_tokens, keep_last)
        if kept > max_tokens:
            return Encoded(num_tokens, None)
        ids = enc.ids
    else:
        ids = tokenizer.encode(text, add_special_tokens=add_special_tokens)
        num_tokens = len(ids)
    if keep_last is not None:
        ids = ids[-keep_last:]
    return Encoded(num_tokens, ids if len(ids) <= max_tokens else None)


class _ChildTokenizer:
    """One child process that encodes huge prompts, one at a time. It is a daemon (stopped when
    the frontend exits) and dies with the frontend even when that is killed (PDEATHSIG)."""

    def __init__(self, path: str) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, child_end = ctx.Pipe()
        self.proc = ctx.Process(
            target=_child_main, args=(path, child_end), daemon=True, name="pdserve-tokenizer"
        )
        self.proc.start()
        child_end.close()
        self.lock = threading.Lock()

    def encode(self, text: str, add_special_tokens: bool, keep_last, max_tokens: int) -> Encoded:
        job = msgspec.msgpack.encode((text, add_special_tokens, keep_last, max_tokens))
        with self.lock:
            self.conn.send_bytes(job)
            reply = msgspec.msgpack.decode(self.conn.recv_bytes(), type=_Reply)
        if reply.error is not None:
            raise RuntimeError(f"the tokenizer process failed: {reply.error}")
        return reply.encoded

    def close(self) -> None:
        self.proc.kill()
        self.proc.join(timeout=5)
        self.conn.close()


def _child_main(path: str, conn) -> None:
    _die_with_parent()
    os.nice(10)  # background work: the frontend and the engine workers come first
    sched_slice.restore_process()  # nor does it preempt them as the frontend's threads do
    from pdserve.frontend.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(path)
    while True:
        try:
            job = msgspec.msgpack.decode(conn.recv_bytes())
        except EOFError:
            return
        try:
            reply = _Reply(encoded=encode(tokenizer, *job))
        except Exception as e:  # reported to the caller, the child goes on
            reply = _Reply(error=f"{type(e).__name__}: {e}")
        conn.send_bytes(msgspec.msgpack.encode(reply))


class _Reply(msgspec.Struct):
    encoded: Encoded | None = None
    error: str | None = None


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class PromptTokenizer:
    """`await encode(...)` from the event loop; `close()` at shutdown."""

    def __init__(self, tokenizer, path: str | None) -> None:
        self.tokenizer = tokenizer
        self.path = path  # to load the same tokenizer in the child (None: threads only)
        self.threads = ThreadPoolExecutor(NUM_THREADS, thread_name_prefix="pdserve-tokenize")
        # Huge prompts queue for the child process, one at a time, waited on by one thread.
        self.large = ThreadPoolExecutor(1, thread_name_prefix="pdserve-tokenize-large")
        self._child: _ChildTokenizer | None = None  # started on the first huge prompt

    async def run(self, fn, *args):
        """Any blocking call (a chat template) in the tokenizer threads."""
        return await asyncio.get_running_loop().run_in_executor(self.threads, fn, *args)

    async def encode(
        self, text: str, add_special_tokens: bool, keep_last: int | None, max_tokens: int
    ) -> Encoded:
        args = (text, add_special_tokens, keep_last, max_tokens)
        loop = asyncio.get_running_loop()
        if len(text) >= LARGE_PROMPT_CHARS and self.path is not None:
            if self._child is None:
                self._child = _ChildTokenizer(self.path)
            return await loop.run_in_executor(self.large, self._child.encode, *args)
        return await loop.run_in_executor(self.threads, encode, self.tokenizer, *args)

    def close(self) -> None:
        self.threads.shutdown(wait=False, cancel_futures=True)
        self.large.shutdown(wait=False, cancel_futures=True)
        if self._child is not None:
            self._child.close()
