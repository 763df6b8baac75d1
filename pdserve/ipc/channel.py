"""Typed ZMQ channels: msgspec msgpack frames of one message union per direction."""

from __future__ import annotations

import os
import tempfile
import uuid
from typing import Any

import msgspec
import zmq
import zmq.asyncio


def ipc_address(name: str) -> str:
    """A fresh unix-socket address (local to this host, file mode of the user only)."""
    base = os.environ.get("PDSERVE_IPC_DIR") or tempfile.gettempdir()
    return f"ipc://{os.path.join(base, f'pdserve-{name}-{uuid.uuid4().hex[:12]}')}"


class Encoder:
    def __init__(self) -> None:
        self._enc = msgspec.msgpack.Encoder()

    def __call__(self, msg: Any) -> bytes:
        return self._enc.encode(msg)


class Decoder:
    def __init__(self, union: Any) -> None:
        self._dec = msgspec.msgpack.Decoder(union)

    def __call__(self, data: bytes) -> Any:
        return self._dec.decode(data)


def make_socket(ctx: zmq.Context | zmq.asyncio.Context, kind: int, address: str, bind: bool):
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if kind in (zmq.PUSH, zmq.PULL):
        sock.setsockopt(zmq.SNDHWM if kind == zmq.PUSH else zmq.RCVHWM, 0)
    if bind:
        sock.bind(address)
    else:
        sock.connect(address)
    return sock
