"""The KV connector moves exactly a request's new rows into the decode worker's reserved slots,
over both transports, whatever the block tables look like on either side."""

from __future__ import annotations

import itertools
import os
import socket
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from pdserve.disagg.connector import (
    KVReceiver,
    KVSender,
    contiguous_runs,
    seal,
    shm,
    shm_cache_factory,
)
from pdserve.disagg.connector.stream import PREFIX, StreamChannel, parse_address
from pdserve.disagg.protocol import KVDest, KVDone, KVEnvelope, KVLayerHeader, KVLayout

LAYERS, HEADS, HEAD_DIM, BLOCK, NUM_BLOCKS = 3, 2, 8, 4, 64
LAYOUT = KVLayout("test-model", "float32", LAYERS, HEADS, HEAD_DIM, BLOCK)
KEY = b"k" * 32


def test_contiguous_runs():
    assert contiguous_runs(np.array([], dtype=np.int64), np.array([], dtype=np.int64)) == []
    src = np.array([4, 5, 6, 7, 12, 13])
    assert contiguous_runs(src, np.array([0, 1, 2, 3, 4, 5])) == [(4, 0, 4), (12, 4, 2)]
    assert contiguous_runs(src, np.array([8, 9, 0, 1, 2, 3])) == [(4, 8, 2), (6, 0, 2), (12, 2, 2)]
    assert contiguous_runs(np.arange(10), np.arange(20, 30)) == [(0, 20, 10)]


def plan(request_id: str, computed: int, new: int):
    req = SimpleNamespace(request_id=request_id, num_computed_tokens=computed)
    return SimpleNamespace(scheduled=[SimpleNamespace(request=req, num_new_tokens=new)])


def slots(table: list[int], start: int, end: int) -> torch.Tensor:
    pos = np.arange(start, end)
    return torch.from_numpy(np.asarray(table)[pos // BLOCK] * BLOCK + pos % BLOCK)


def wait_for(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


HAS_CUDA = torch.cuda.is_available()
GPU = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")]
# On a GPU in one process only the stream: CUDA IPC opens no handle in the process that exported
# it (`test_cuda_ipc_between_processes` covers shm there).
DEVICE_TRANSPORTS = [("cpu", t) for t in ("shm", "tcp", "auto", "auto-elsewhere")] + [
    pytest.param("cuda", t, marks=GPU, id=f"cuda-{t}") for t in ("tcp", "auto-elsewhere")
]


@pytest.mark.parametrize(("device", "transport"), DEVICE_TRANSPORTS)
@pytest.mark.parametrize(
    "tables",
    [
        "contiguous",  # one stretch: copied in place
        "shuffled",  # scattered blocks: gather + scatter
        "mixed",  # long stretches with breaks, and a decode side that holds leading blocks
    ],
)
def test_sender_writes_exactly_the_new_rows(tmp_path, device, transport, tables, monkeypatch):
    """auto: the cache in shared memory and the channel on TCP; the rows are written in place
    from this host, and sent on the stream from elsewhere (another host id). On a GPU both
    caches are in device memory: the rows leave through pinned memory on the stream (in place
    from this host is CUDA IPC, which needs two processes: `test_cuda_ipc_between_processes`)."""
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    slots_total = NUM_BLOCKS * BLOCK
    dev = torch.device(device)
    own = list(torch.randn(LAYERS, 2, slots_total, HEADS, HEAD_DIM).to(dev).unbind(0))
    paths: list[str] = []
    elsewhere = transport == "auto-elsewhere"
    transport = transport.removesuffix("-elsewhere")
    factory = shm_cache_factory(paths, str(tmp_path)) if transport != "tcp" else None
    shape = (LAYERS, 2, slots_total, HEADS, HEAD_DIM)
    peer_cache = factory(shape, torch.float32, dev) if factory else torch.zeros(shape, device=dev)
    peer = list(peer_cache.unbind(0))
    address = f"ipc://{tmp_path}/kv" if transport == "shm" else "tcp://127.0.0.1:0"
    num_tokens, cached = 150, 0  # 37.5 blocks: the last one partly filled
    nb = -(-num_tokens // BLOCK)
    tables_of = {}
    recv = KVReceiver(
        1,
        peer,
        transport,
        address,
        paths,
        LAYOUT,
        tables_of.get,
        KEY,
        max_tokens=num_tokens,
    )
    sender = KVSender(0, own, BLOCK, LAYOUT, KEY)
    if elsewhere:  # the decode worker's files are on another host: not to be mapped
        monkeypatch.setattr(shm, "host_identity", lambda: "another-host/boot")
    try:
        sender.add_peer(recv.endpoint())
        path = sender.peers[1].writer.path
        assert path == ("shm" if transport == "shm" or (transport == "auto" and not elsewhere)
                        else "tcp")  # fmt: skip
        if tables == "contiguous":
            src_table, dst_table = list(range(3, 3 + nb)), list(range(20, 20 + nb))
        elif tables == "shuffled":
            src_table = rng.permutation(NUM_BLOCKS)[:nb].tolist()
            dst_table = rng.permutation(NUM_BLOCKS)[:nb].tolist()
        else:
            src_table = list(range(0, 20)) + list(range(40, 40 + nb - 20))
            dst_table = list(range(10, 10 + nb))
            cached = 5 * BLOCK  # the decode worker holds the first 5 blocks already
        tables_of["r"] = dst_table
        sender.add_request("r", KVDest(1, dst_table, cached))
        # a chunked prefill: two steps, the second one starting mid-block
        in_place = []
        for start, end in ((0, 70), (70, num_tokens)):
            sender.begin_step(plan("r", start, end - start), {"r": src_table})
            in_place += [job.runs is not None for job in sender.step_jobs]
            for layer in range(LAYERS):
                sender.on_layer(layer)
        # which shm path each step took (the tcp transport sends rows either way)
        assert (
            in_place
            == {
                "contiguous": [True, True],
                "shuffled": [False, False],
                "mixed": [True, False],  # one 50-token stretch; then stretches of 10 and 70
            }[tables]
        )
        assert sender.finish("r", first_token=7)[3] == path
        sender.flush()
        done = []
        wait_for(lambda: done.extend(recv.poll()[0]) or done)
        assert [d.request_id for d in done] == ["r"] and done[0].first_token == 7

        sent_dst = slots(dst_table, cached, num_tokens)
        sent_src = slots(src_table, cached, num_tokens)
        untouched = torch.ones(slots_total, dtype=torch.bool)
        untouched[sent_dst] = False
        for layer in range(LAYERS):
            assert torch.equal(peer[layer][:, sent_dst], own[layer][:, sent_src])
            assert not peer[layer][:, untouched].any()  # nothing else was written
        assert done[0].num_bytes == (num_tokens - cached) * LAYERS * 2 * HEADS * HEAD_DIM * 4
        assert not recv.dropped
        if transport != "tcp" and device == "cpu":
            assert os.stat(paths[0]).st_mode & 0o777 == 0o600
        assert bool(recv.endpoint().cuda_ipc) == (device == "cuda" and transport == "auto")
    finally:
        recv.close()


class _Followers:
    """Stands in for a tensor-parallel decode worker's group: records what rank 0 hands on."""

    def __init__(self) -> None:
        self.written: list[tuple[int, np.ndarray, torch.Tensor]] = []

    def write_rows(self, pending) -> None:
        self.written += pending


@pytest.mark.parametrize("transport", ["shm", "tcp"])
@pytest.mark.parametrize("sender_split", [False, True], ids=["whole-sender", "split-sender"])
def test_every_kv_head_reaches_the_rank_that_holds_it(tmp_path, transport, sender_split):
    """Rows travel with every KV head whatever the two workers' tensor-parallel sizes: a split
    prefill worker ships its followers' heads gathered after the forward (`ship_step`), a split
    decode worker takes each rank's heads into that rank's cache (shm: one file per rank, tcp:
    rank 0 keeps its own and hands the rest on)."""
    torch.manual_seed(1)
    slots_total = NUM_BLOCKS * BLOCK
    whole = torch.randn(LAYERS, 2, slots_total, HEADS, HEAD_DIM)  # the prefill side, every head
    own = list((whole[:, :, :, :1] if sender_split else whole).contiguous().unbind(0))
    share = (LAYERS, 2, slots_total, HEADS // 2, HEAD_DIM)  # a decode rank's cache
    paths: list[str] = []
    if transport == "shm":
        factory = shm_cache_factory(paths, str(tmp_path))
        ranks = [factory(share, torch.float32, torch.device("cpu")) for _ in range(2)]
    else:
        ranks = [torch.zeros(share)]
    followers = _Followers()
    address = f"ipc://{tmp_path}/kv" if transport == "shm" else "tcp://127.0.0.1:0"
    table = [5, 9, 2, 30]  # scattered on purpose
    recv = KVReceiver(1, list(ranks[0].unbind(0)), transport, address, paths, LAYOUT,
                      {"r": table}.get, KEY, max_tokens=64,
                      tp=followers if transport == "tcp" else None)  # fmt: skip
    sender = KVSender(0, own, BLOCK, LAYOUT, KEY)
    try:
        sender.add_peer(recv.endpoint())
        sender.add_request("r", KVDest(1, table, 0))
        src_table = [1, 2, 3, 4]
        sender.begin_step(plan("r", 0, 14), {"r": src_table})
        if sender_split:  # rank 0's share and the followers' gathered, every layer at once
            sender.ship_step(lambda s: whole[:, :, s])
        else:
            for layer in range(LAYERS):
                sender.on_layer(layer)
        sender.finish("r", first_token=3)
        sender.flush()
        done = []
        wait_for(lambda: done.extend(recv.poll()[0]) or done)
        assert done[0].num_bytes == 14 * LAYERS * 2 * HEADS * HEAD_DIM * 4  # every head
        dst, src = slots(table, 0, 14), slots(src_table, 0, 14)
        if transport == "shm":
            for r, cache in enumerate(ranks):
                assert torch.equal(cache[:, :, dst], whole[:, :, src, r : r + 1])
        else:
            assert torch.equal(ranks[0][:, :, dst], whole[:, :, src, :1])
            by_layer = {layer: (d, rows) for layer, d, rows in followers.written}
            assert sorted(by_layer) == list(range(LAYERS))
            for layer, (d, rows) in by_layer.items():
                assert np.array_equal(d, dst.numpy())
                assert torch.equal(rows, whole[layer][:, src, 1:])
        assert not recv.dropped
    finally:
        recv.close()


# ---- a hostile peer on the KV channel ------------------------------------------------------


@pytest.fixture
def tcp_receiver():
    """A decode-side receiver on TCP whose only reservation is request "r" in blocks 2 and 3."""
    cache = list(torch.zeros(LAYERS, 2, NUM_BLOCKS * BLOCK, HEADS, HEAD_DIM).unbind(0))
    recv = KVReceiver(
        1,
        cache,
        "tcp",
        "tcp://127.0.0.1:0",
        [],
        LAYOUT,
        {"r": [2, 3]}.get,
        KEY,
        max_tokens=64,
    )
    push = StreamChannel(recv.address)
    yield recv, cache, push
    push.close()
    recv.close()


def layer_frames(key, seq, rid="r", layer=0, dst=(8, 9), epoch=1, rows=None, slots=None):
    dst = np.asarray(dst, dtype=np.int64)
    rows = np.ones((2, len(dst), HEADS, HEAD_DIM), np.float32) if rows is None else rows
    slots = dst.tobytes() if slots is None else slots
    env = KVEnvelope(epoch, seq, KVLayerHeader(rid, layer, len(dst)))
    return [seal(key, env, slots, rows.nbytes), slots, rows.tobytes()]


MARKER_SEQ = itertools.count(1)


def deliver(recv, push, *messages):
    """Send the messages, then one authentic KVDone as a marker; poll until it arrives."""
    for frames in messages:
        push.send_multipart(frames)
    push.send(seal(KEY, KVEnvelope(99, next(MARKER_SEQ), KVDone("marker", 0, 0, 0, 0.0))))
    done, aborted = [], []
    deadline = time.monotonic() + 10
    while not any(d.request_id == "marker" for d in done):
        assert time.monotonic() < deadline, "the marker never arrived"
        d, a = recv.poll()
        done += d
        aborted += a
        time.sleep(0.002)
    return [d for d in done if d.request_id != "marker"], aborted


def test_garbage_and_forged_frames_are_dropped_and_counted(tcp_receiver):
    recv, cache, push = tcp_receiver
    with socket.create_connection(parse_address(recv.address)) as raw:  # not even framed
        raw.sendall(os.urandom(1000))
    forged_done = KVEnvelope(5, 1, KVDone("r", 3, 0, 0, 0.0))
    done, _ = deliver(
        recv,
        push,
        [b"\x00" * 20],  # the 20-byte garbage frame that used to kill the worker
        [b"short"],
        [os.urandom(64), b"x", b"y"],
        [seal(b"w" * 32, forged_done)],  # a valid message under another key
        layer_frames(b"w" * 32, seq=1),  # rows signed with another key
        [b"\xff" * 16 + b"\xc1"],  # a tag, then bytes that are no msgpack
    )
    assert done == []  # nothing forged got through
    assert not any(c.any() for c in cache)  # and nothing was written
    # 6 messages refused; the random bytes declared a message too large (or ended inside one)
    assert recv.dropped["bad_tag"] >= 4
    assert recv.dropped["oversized"] + recv.dropped["truncated"] == 1
    assert sum(recv.dropped.values()) == 7


def test_writes_outside_the_reservation_or_replayed_are_refused(tcp_receiver):
    recv, cache, push = tcp_receiver
    deliver(
        recv,
        push,
        layer_frames(KEY, seq=1, dst=(8, 40)),  # slot 40 is in block 10, not the request's
        layer_frames(KEY, seq=2, dst=(-1, 9)),
        layer_frames(KEY, seq=3, dst=(8, 10**12)),
        layer_frames(KEY, seq=4, rid="other"),  # no reservation at all
        layer_frames(KEY, seq=5, layer=LAYERS),  # no such layer
        layer_frames(KEY, seq=6, slots=np.zeros(3, np.int64).tobytes()),  # 3 slots for 2 rows
    )
    assert not any(c.any() for c in cache)
    assert recv.dropped == {"out_of_bounds": 4, "unknown_request": 1, "malformed": 1}
    deliver(recv, push, layer_frames(KEY, seq=7, dst=(8, 15)))  # the last slot of block 3
    assert cache[0][:, [8, 15]].eq(1).all() and cache[0].sum() == 2 * 2 * HEADS * HEAD_DIM
    replay = layer_frames(KEY, seq=7, dst=(9, 10))
    deliver(recv, push, replay)
    assert recv.dropped["replayed"] == 1 and not cache[0][:, [9, 10]].any()


def test_an_oversized_message_is_refused_before_it_is_buffered(tcp_receiver):
    recv, cache, push = tcp_receiver
    with socket.create_connection(parse_address(recv.address)) as raw:
        # declares twice the rows 64 tokens need, then never sends them: refused at once
        raw.sendall(PREFIX.pack(32, 8, 64 * 2 * 2 * HEADS * HEAD_DIM * 4 * 2) + b"h" * 40)
        try:
            end = raw.recv(1)
        except ConnectionResetError:  # ended with our bytes unread
            end = b""
        assert end == b""  # the receiver ended the connection
    assert recv.dropped["oversized"] == 1
    deliver(recv, push, layer_frames(KEY, seq=1))  # another connection still works
    assert cache[0][:, [8, 9]].eq(1).all()


def test_a_message_cut_short_ends_its_connection_and_nothing_is_applied(tcp_receiver):
    recv, cache, push = tcp_receiver
    frames = layer_frames(KEY, seq=1)
    whole = PREFIX.pack(len(frames[0]), len(frames[1]), len(frames[2])) + b"".join(frames)
    with socket.create_connection(parse_address(recv.address)) as raw:
        raw.sendall(whole[:-100])  # all but the last 100 bytes of the rows
    deadline = time.monotonic() + 10
    while recv.dropped["truncated"] == 0:
        assert time.monotonic() < deadline, "the cut message was not counted"
        time.sleep(0.01)
    recv.poll()
    assert not any(c.any() for c in cache)
    deliver(recv, push, layer_frames(KEY, seq=2))  # the same rows, whole, from a channel
    assert cache[0][:, [8, 9]].eq(1).all()


def test_a_channel_to_a_dead_receiver_drops_messages_and_reconnects(tcp_receiver):
    """The prefill side never fails on a lost decode worker: the message is counted lost (the
    decode side recomputes after its timeout), and a receiver back at the address is reached
    again."""
    recv, cache, push = tcp_receiver
    deliver(recv, push, layer_frames(KEY, seq=1, dst=(8,)))
    address = recv.address
    recv.close()
    for seq in range(2, 50):  # the first sends may still fill the kernel's buffers
        push.send_multipart(layer_frames(KEY, seq=seq))
    assert push.num_lost > 0
    again = KVReceiver(1, cache, "tcp", address, [], LAYOUT, {"r": [2, 3]}.get, KEY, 64)
    try:
        push.next_try = 0.0  # no waiting out the reconnect pause in a test
        deliver(again, push, layer_frames(KEY, seq=60, dst=(9,)))
        assert cache[0][:, 9].eq(1).all()
    finally:
        again.close()


def _wait_count(recv, reason: str, n: int, what: str) -> None:
    deadline = time.monotonic() + 10
    while recv.dropped[reason] < n:
        assert time.monotonic() < deadline, what
        recv.poll()
        time.sleep(0.01)


def _is_closed(conn: socket.socket, within_s: float = 5.0) -> bool:
    conn.settimeout(within_s)
    try:
        return conn.recv(1) == b""
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False


def test_strangers_cannot_keep_the_deployment_out(tcp_receiver, monkeypatch):
    """Each connection has a receive thread, so their number is bounded; a connection keeps its
    place by sending a message. At the limit a newcomer takes the place of the oldest silent
    connection; with every open one having spoken, it is refused. Silent connections are
    closed after SILENT_S, and one whose message fails its tag at once."""
    from pdserve.disagg.connector import stream

    recv, cache, push = tcp_receiver
    monkeypatch.setattr(stream, "MAX_CONNECTIONS", 2)
    deliver(recv, push, layer_frames(KEY, seq=1))  # the channel's connection has spoken
    address = parse_address(recv.address)
    idle = [socket.create_connection(address) for _ in range(3)]
    try:
        _wait_count(recv, "evicted", 2, "silent connections were not evicted for newcomers")
        assert recv.dropped["too_many_connections"] == 0
        assert _is_closed(idle[0]) and _is_closed(idle[1]) and not _is_closed(idle[2], 0.2)
        deliver(recv, push, layer_frames(KEY, seq=2, dst=(10,)))  # the channel still works
        assert cache[0][:, 10].eq(1).all()

        # A second sender of the deployment takes the silent one's place and speaks: now every
        # open connection has, and a further connection is refused.
        second = StreamChannel(recv.address)
        deliver(recv, second, layer_frames(KEY, seq=3, dst=(11,), epoch=2))
        assert _is_closed(idle[2])
        late = socket.create_connection(address)
        _wait_count(recv, "too_many_connections", 1, "a connection beyond the limit was let in")
        assert _is_closed(late)
        late.close()
        second.close()
        # its place frees once the receiver has seen it close (a reader thread's EOF: on a slow
        # machine the forger below could otherwise come first and be refused as one too many)
        deadline = time.monotonic() + 10
        while len(recv.stream.conns) > 1:
            assert time.monotonic() < deadline, "a closed connection kept its place"
            time.sleep(0.01)

        # A message that fails its tag ends its connection at once.
        forger = socket.create_connection(address)
        frames = layer_frames(b"x" * 32, seq=4)
        lengths = [len(f) for f in frames]
        forger.sendall(stream.PREFIX.pack(*lengths) + b"".join(frames))
        _wait_count(recv, "bad_tag", 1, "the forged message was not dropped")
        assert _is_closed(forger)
        forger.close()

        # One that says nothing is closed after SILENT_S.
        monkeypatch.setattr(stream, "SILENT_S", 0.3)
        silent = socket.create_connection(address)
        assert _is_closed(silent)
        assert recv.dropped["silent"] >= 1
        silent.close()
        deliver(recv, push, layer_frames(KEY, seq=5, dst=(12,)))  # it has spoken: still open
        assert cache[0][:, 12].eq(1).all()
    finally:
        for c in idle:
            c.close()


def test_a_decode_worker_whose_cache_is_gone_is_skipped_not_fatal(tmp_path, caplog):
    """A decode worker that died between its announcement and the connect (its shared-memory
    file already removed): the prefill worker skips it and keeps serving the others."""
    from pdserve.disagg.protocol import PeerEndpoint

    own = list(torch.zeros(LAYERS, 2, NUM_BLOCKS * BLOCK, HEADS, HEAD_DIM).unbind(0))
    sender = KVSender(0, own, BLOCK, LAYOUT, KEY)
    gone = PeerEndpoint(2, f"ipc://{tmp_path}/kv-gone", "shm", [str(tmp_path / "missing")], LAYOUT)
    sender.add_peer(gone)  # no error: the step loop goes on
    assert 2 not in sender.peers and sender.error is None
    assert "decode worker 2 cannot be reached" in caplog.text
    sender.add_request("r", KVDest(2, [0], 0))  # its transfer is skipped, not an error
    sender.begin_step(plan("r", 0, 4), {"r": [1]})
    for layer in range(LAYERS):
        sender.on_layer(layer)
    assert sender.finish("r", first_token=1)[3] == "none"
    sender.flush()
    assert sender.error is None


# ---- a decode worker whose cache is on a GPU -------------------------------------------------


def _gpu_endpoint(tmp_path, transport: str):
    from pdserve.disagg.protocol import CudaIpcHandle, PeerEndpoint

    handle = CudaIpcHandle(0, b"\1" * 64, 4096, 0, b"/torch_1_2", 0, b"\2" * 64, True)
    return PeerEndpoint(3, f"ipc://{tmp_path}/kv3", transport, [], LAYOUT, shm.host_identity(),
                        [handle])  # fmt: skip


def test_a_gpu_cache_offer_survives_the_handshake_and_old_peers_still_decode(tmp_path):
    """The CUDA IPC handle travels in the endpoint as plain msgpack (no pickle); an endpoint
    from a worker that predates it reads as offering none."""
    import msgspec

    from pdserve.disagg.protocol import PeerEndpoint

    ep = _gpu_endpoint(tmp_path, "shm")
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(ep), type=PeerEndpoint) == ep
    old = {k: v for k, v in msgspec.to_builtins(ep).items() if k != "cuda_ipc"}
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(old), type=PeerEndpoint).cuda_ipc == []


@pytest.mark.skipif(HAS_CUDA, reason="checks a process without CUDA")
def test_a_gpu_decode_worker_is_reached_over_tcp_or_skipped_from_a_process_without_cuda(
    tmp_path, caplog
):
    """`auto`: the rows go on the stream (nothing here can open a GPU's memory); `shm`: the
    decode worker cannot be reached, which is a warning and a recompute there, not a crash."""
    from pdserve.disagg.connector.tcp import AutoTransport, TcpPeer
    from pdserve.disagg.connector.transports import transport_for

    own = list(torch.zeros(LAYERS, 2, NUM_BLOCKS * BLOCK, HEADS, HEAD_DIM).unbind(0))
    assert isinstance(AutoTransport().open_peer(_gpu_endpoint(tmp_path, "auto"), own), TcpPeer)
    with pytest.raises(ValueError, match="no CUDA"):
        transport_for("shm").open_peer(_gpu_endpoint(tmp_path, "shm"), own)
    sender = KVSender(0, own, BLOCK, LAYOUT, KEY)
    sender.add_peer(_gpu_endpoint(tmp_path, "shm"))
    assert 3 not in sender.peers and sender.error is None
    assert "decode worker 3 cannot be reached" in caplog.text


_DECODE_SIDE = """
import sys, time, msgspec, torch
from pdserve.disagg.connector import KVReceiver
from pdserve.disagg.protocol import KVLayout
layout = msgspec.json.decode(sys.argv[1], type=KVLayout)
shape, table = msgspec.json.decode(sys.argv[2]), msgspec.json.decode(sys.argv[3])
cache = torch.zeros(shape, device="cuda")
recv = KVReceiver(1, list(cache.unbind(0)), "shm", sys.argv[4], [], layout, {"r": table}.get,
                  bytes.fromhex(sys.argv[5]), max_tokens=4096)
sys.stdout.buffer.write(msgspec.msgpack.encode(recv.endpoint()).hex().encode() + b"\\n")
sys.stdout.flush()
deadline, done = time.monotonic() + 60, []
while not done and time.monotonic() < deadline:
    done = recv.poll()[0]
    time.sleep(0.01)
torch.cuda.synchronize()
torch.save(cache.cpu(), sys.argv[6])  # what the prefill side wrote, for it to check
recv.close()
"""


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_cuda_ipc_between_processes(tmp_path):
    """`shm` on a GPU: a decode worker in another process offers its cache's CUDA memory; the
    prefill side opens it and writes exactly the new rows device to device."""
    import subprocess
    import sys

    import msgspec

    from pdserve.disagg.protocol import PeerEndpoint

    torch.manual_seed(0)
    slots_total = NUM_BLOCKS * BLOCK
    shape = [LAYERS, 2, slots_total, HEADS, HEAD_DIM]
    whole = torch.randn(shape)
    own = list(whole.cuda().unbind(0))
    src_table, dst_table, n = [7, 3, 11, 12, 13], [40, 41, 2, 9, 20], 18
    out = tmp_path / "decode-cache.pt"
    child = subprocess.Popen(
        [sys.executable, "-c", _DECODE_SIDE, msgspec.json.encode(LAYOUT).decode(),
         msgspec.json.encode(shape).decode(), msgspec.json.encode(dst_table).decode(),
         f"ipc://{tmp_path}/kv", KEY.hex(), str(out)],
        stdout=subprocess.PIPE,
    )  # fmt: skip
    try:
        endpoint = msgspec.msgpack.decode(bytes.fromhex(child.stdout.readline().decode()),
                                          type=PeerEndpoint)  # fmt: skip
        assert endpoint.cuda_ipc and not endpoint.shm_paths
        sender = KVSender(0, own, BLOCK, LAYOUT, KEY)
        sender.add_peer(endpoint)
        assert sender.peers[1].writer.path == "shm"
        sender.add_request("r", KVDest(1, dst_table, 0))
        sender.begin_step(plan("r", 0, n), {"r": src_table})
        for layer in range(LAYERS):
            sender.on_layer(layer)
        sender.finish("r", first_token=5)
        sender.flush()
        assert child.wait(timeout=90) == 0
    finally:
        if child.poll() is None:
            child.kill()
    got = torch.load(out)
    dst, src = slots(dst_table, 0, n), slots(src_table, 0, n)
    assert torch.equal(got[:, :, dst], whole[:, :, src])
    untouched = torch.ones(slots_total, dtype=torch.bool)
    untouched[dst] = False
    assert not got[:, :, untouched].any()
