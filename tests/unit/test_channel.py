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
    for bad in (b"", b"short", frame[:-1], b"\x00" + frame[1:], Encoder(os.urandom(32))(Msg(7))):
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
