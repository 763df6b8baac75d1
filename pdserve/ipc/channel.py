"""Typed, authenticated ZMQ channels: msgspec msgpack frames of one message union per direction.

Every frame starts with a 16-byte keyed BLAKE2b tag of its payload. The key is a secret the
frontend draws at startup and hands to its workers in their environment (`SECRET_ENV`), so only
processes of this deployment can talk on its channels; a frame with a wrong tag, or one that does
not decode as the expected message, raises `BadFrame` for the caller to count and drop.

Unix sockets (and the shared-memory KV files) live in private directories that the frontend
creates (mode 0700) and removes on exit; each socket file is made 0600 as it is bound, whatever
the umask.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import hmac
import os
import secrets
import shutil
import tempfile
import uuid
from typing import Any

import msgspec
import zmq
import zmq.asyncio

SECRET_ENV = "PDSERVE_SECRET"  # hex; set by the frontend for its workers
IPC_BASE_ENV = "PDSERVE_IPC_DIR"  # where to create the socket directory (default: $TMPDIR)
IPC_DIR_ENV = "PDSERVE_RUNTIME_IPC_DIR"  # set for workers: the deployment's socket directory
SHM_DIR_ENV = "PDSERVE_RUNTIME_SHM_DIR"  # set for workers: its shared-memory directory
MAC_BYTES = 16


class BadFrame(ValueError):
    """A frame that is not an authentic message of the expected type."""


def new_secret() -> bytes:
    return secrets.token_bytes(32)


def secret_from_env() -> bytes:
    """The deployment secret handed over by the frontend (removed from this environment)."""
    value = os.environ.pop(SECRET_ENV, None)
    if not value:
        raise RuntimeError(f"${SECRET_ENV} is not set: engine workers are started by the frontend")
    return bytes.fromhex(value)


def mac(key: bytes, *parts: bytes | memoryview) -> bytes:
    h = hashlib.blake2b(key=key, digest_size=MAC_BYTES)
    for part in parts:
        h.update(part)
    return h.digest()


class Encoder:
    def __init__(self, key: bytes) -> None:
        self._enc = msgspec.msgpack.Encoder()
        self._key = key

    def __call__(self, msg: Any) -> bytes:
        payload = self._enc.encode(msg)
        return mac(self._key, payload) + payload


class Decoder:
    def __init__(self, union: Any, key: bytes) -> None:
        self._dec = msgspec.msgpack.Decoder(union)
        self._key = key

    def __call__(self, data: bytes | memoryview) -> Any:
        view = memoryview(data)
        if len(view) < MAC_BYTES:
            raise BadFrame(f"a {len(view)}-byte frame is too short")
        tag, payload = view[:MAC_BYTES], view[MAC_BYTES:]
        if not hmac.compare_digest(mac(self._key, payload), tag):
            raise BadFrame("the frame's tag does not match (not from this deployment)")
        try:
            return self._dec.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise BadFrame(f"undecodable frame: {e}") from None


class RuntimeDirs:
    """The deployment's private directories: unix sockets (in the temp directory) and
    shared-memory files (in /dev/shm where there is one). Created 0700; `remove` deletes them
    with everything in them."""

    def __init__(self) -> None:
        self.ipc = tempfile.mkdtemp(prefix="pdserve-", dir=os.environ.get(IPC_BASE_ENV))
        self.shm = tempfile.mkdtemp(prefix="pdserve-", dir=_shm_base())
        atexit.register(self.remove)  # in case the owner never gets to remove them

    @classmethod
    def remove_from_env(cls) -> None:
        """A worker whose frontend died removes the deployment's directories itself."""
        for name in (IPC_DIR_ENV, SHM_DIR_ENV):
            path = os.environ.get(name)
            if path and os.path.basename(path).startswith("pdserve-"):
                shutil.rmtree(path, ignore_errors=True)

    def env(self) -> dict[str, str]:
        return {IPC_DIR_ENV: self.ipc, SHM_DIR_ENV: self.shm}

    def address(self, name: str) -> str:
        return ipc_address(name, self.ipc)

    def remove(self) -> None:
        for path in (self.ipc, self.shm):
            shutil.rmtree(path, ignore_errors=True)


def _shm_base() -> str | None:
    return "/dev/shm" if os.path.isdir("/dev/shm") else None


def ipc_address(name: str, directory: str) -> str:
    """A fresh unix-socket address in `directory` (local to this host)."""
    return f"ipc://{os.path.join(directory, f'{name}-{uuid.uuid4().hex[:12]}')}"


def private_file(directory: str | None, prefix: str, size: int, reserve: bool = False) -> str:
    """Create a file of `size` bytes readable and writable by this user only (0600); with
    `reserve`, its space is allocated now (for a file that is filled at once, such as a KV
    cache), else as it is written."""
    directory = directory or os.environ.get(SHM_DIR_ENV) or _shm_base() or tempfile.gettempdir()
    path = os.path.join(directory, f"{prefix}-{uuid.uuid4().hex[:16]}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.fchmod(fd, 0o600)  # whatever the umask
        os.ftruncate(fd, size)
        if reserve and size:
            # a sparse file on a full tmpfs would kill the process with SIGBUS at its first
            # write to a page the file system cannot give, instead of failing here with the reason
            os.posix_fallocate(fd, 0, size)
    except OSError as e:
        os.close(fd)
        os.unlink(path)
        free = shutil.disk_usage(directory).free
        raise OSError(
            e.errno,
            f"cannot reserve {size} bytes in {directory} ({free} free): {e.strerror}; make "
            "the KV cache smaller (--kv-cache-memory) or the file system larger",
        ) from None
    os.close(fd)
    return path


# The largest control frame a TCP channel accepts: a peer that is not of this deployment can
# reach a TCP port, and ZMQ would otherwise buffer whatever size it announces before the tag
# is checked. Far above any real frame (a prompt is at most max_model_len token ids).
MAX_TCP_FRAME_BYTES = 256 << 20


def make_socket(ctx: zmq.Context | zmq.asyncio.Context, kind: int, address: str, bind: bool):
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if kind in (zmq.PUSH, zmq.PULL):
        sock.setsockopt(zmq.SNDHWM if kind == zmq.PUSH else zmq.RCVHWM, 0)
    if address.startswith("tcp://") and kind == zmq.PULL:
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_TCP_FRAME_BYTES)
    if bind:
        sock.bind(address)
        if address.startswith("ipc://"):
            with contextlib.suppress(OSError):
                os.chmod(address.removeprefix("ipc://"), 0o600)
    else:
        sock.connect(address)
    return sock


def bound_address(sock) -> str:
    """The address a bound socket listens on (a TCP port 0 bind resolved to its port)."""
    return sock.getsockopt(zmq.LAST_ENDPOINT).decode()
