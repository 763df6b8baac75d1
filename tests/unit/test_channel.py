"""Authenticated channels and private runtime directories."""

from __future__ import annotations

import os
import stat

import msgspec
import pytest

from pdserve.ipc.channel import BadFrame, Decoder, Encoder, RuntimeDirs, private_file


class Msg(msgspec.Struct, tag=True):
    x: int


def test_frames_carry_a_tag_that_only_the_key_makes():
    key = os.urandom(32)
    frame = Encoder(key)(Msg(7))
    assert Decoder(Msg, key)(frame) == Msg(7)
    flipped = bytes([frame[0] ^ 1]) + frame[1:]  # one bit of the tag (was: a zero byte, which
    # one frame in 256 already starts with)
    for bad in (b"", b"short", frame[:-1], flipped, Encoder(os.urandom(32))(Msg(7))):
        with pytest.raises(BadFrame):
            Decoder(Msg, key)(bad)
    wrong_type = Encoder(key)({"type": "Other", "x": 1})  # authentic, but not a Msg
    with pytest.raises(BadFrame, match="undecodable"):
        Decoder(Msg, key)(wrong_type)


def test_runtime_directories_are_private_and_removed():
    old = os.umask(0)
    try:
        dirs = RuntimeDirs()
        path = private_file(dirs.shm, "kv", 1024)
    finally:
        os.umask(old)
    for d in (dirs.ipc, dirs.shm):
        assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600 and os.path.getsize(path) == 1024
    assert dirs.address("out").startswith(f"ipc://{dirs.ipc}/out-")
    dirs.remove()
    assert not os.path.exists(dirs.ipc) and not os.path.exists(dirs.shm)


def _zmtp_peer(address: str):
    """A raw TCP peer that completes the ZMTP 3.0 handshake (NULL mechanism) as a PUSH socket."""
    import socket

    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    raw = socket.create_connection((host, int(port)))
    greeting = b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\x00")
    raw.sendall(greeting + b"\x00" + b"\x00" * 31)  # as-server 0, filler: 64 bytes
    got = b""
    while len(got) < 64:  # the other side's greeting
        got += raw.recv(64 - len(got))
    body = b"\x05READY" + b"\x0bSocket-Type" + (4).to_bytes(4, "big") + b"PUSH"
    raw.sendall(b"\x04" + bytes([len(body)]) + body)
    raw.settimeout(0.5)
    return raw


def _cut_off(raw, within_s: float) -> bool:
    """Whether the other end closes the connection within `within_s`."""
    import time

    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            if raw.recv(4096) == b"":
                return True
        except TimeoutError:
            continue
        except ConnectionResetError:
            return True
    return False


def test_tcp_channel_binds_a_free_port_and_refuses_oversized_frames():
    """A worker's TCP control channel (a cluster deployment): bound on port 0, its address
    resolved for the frontend; a peer that announces a frame above the cap is cut off before
    the frame is buffered (one that sends a small frame is not), and the channel keeps serving
    the deployment's own frames."""
    import struct

    import zmq

    from pdserve.ipc.channel import MAX_TCP_FRAME_BYTES, bound_address, make_socket

    key = os.urandom(32)
    ctx = zmq.Context()
    try:
        pull = make_socket(ctx, zmq.PULL, "tcp://127.0.0.1:0", bind=True)
        address = bound_address(pull)
        assert address.startswith("tcp://127.0.0.1:") and not address.endswith(":0")
        small = _zmtp_peer(address)
        small.sendall(b"\x00\x05" + b"hello")  # a short frame: received (and then dropped)
        assert pull.poll(5000) and pull.recv() == b"hello"
        assert not _cut_off(small, 1.0)
        huge = _zmtp_peer(address)
        huge.sendall(b"\x02" + struct.pack(">Q", MAX_TCP_FRAME_BYTES + 1))  # long-frame header
        assert _cut_off(huge, 5.0)
        small.close()
        huge.close()
        push = make_socket(ctx, zmq.PUSH, address, bind=False)
        push.send(Encoder(key)(Msg(3)))
        assert pull.poll(5000) and Decoder(Msg, key)(pull.recv()) == Msg(3)
        push.close()
        pull.close()
    finally:
        ctx.destroy(linger=0)
