"""The KV connector moves exactly a request's new rows into the decode worker's reserved slots,
over both transports, whatever the block tables look like on either side."""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from pdserve.disagg.connector import KVReceiver, KVSender, contiguous_runs, shm_cache_factory
from pdserve.disagg.protocol import KVDest, KVLayout

LAYERS, HEADS, HEAD_DIM, BLOCK, NUM_BLOCKS = 3, 2, 8, 4, 64
LAYOUT = KVLayout("test-model", "float32", LAYERS, HEADS, HEAD_DIM, BLOCK)


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


@pytest.mark.parametrize("transport", ["shm", "tcp"])
@pytest.mark.parametrize(
    "tables",
    [
        "contiguous",  # one stretch: copied in place
        "shuffled",  # scattered blocks: gather + scatter
        "mixed",  # long stretches with breaks, and a decode side that holds leading blocks
    ],
)
def test_sender_writes_exactly_the_new_rows(tmp_path, transport, tables):
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    slots_total = NUM_BLOCKS * BLOCK
    own = list(torch.randn(LAYERS, 2, slots_total, HEADS, HEAD_DIM).unbind(0))
    paths: list[str] = []
    factory = shm_cache_factory(paths) if transport == "shm" else None
    shape = (LAYERS, 2, slots_total, HEADS, HEAD_DIM)
    peer_cache = factory(shape, torch.float32) if factory else torch.zeros(shape)
    peer = list(peer_cache.unbind(0))
    address = f"ipc://{tmp_path}/kv" if transport == "shm" else "tcp://127.0.0.1:0"
    recv = KVReceiver(
        1, peer, transport, address, paths[0] if paths else None, LAYOUT, lambda rid: True
    )
    sender = KVSender(0, own, BLOCK, LAYOUT)
    try:
        sender.add_peer(recv.endpoint())
        num_tokens, cached = 150, 0  # 37.5 blocks: the last one partly filled
        nb = -(-num_tokens // BLOCK)
        if tables == "contiguous":
            src_table, dst_table = list(range(3, 3 + nb)), list(range(20, 20 + nb))
        elif tables == "shuffled":
            src_table = rng.permutation(NUM_BLOCKS)[:nb].tolist()
            dst_table = rng.permutation(NUM_BLOCKS)[:nb].tolist()
        else:
            src_table = list(range(0, 20)) + list(range(40, 40 + nb - 20))
            dst_table = list(range(10, 10 + nb))
            cached = 5 * BLOCK  # the decode worker holds the first 5 blocks already
        sender.add_request("r", KVDest(1, dst_table, cached))
        # a chunked prefill: two steps, the second one starting mid-block
        in_place = []
        for start, end in ((0, 70), (70, num_tokens)):
            sender.begin_step(plan("r", start, end - start), {"r": src_table})
            in_place += [job.runs is not None for job in sender.step_jobs]
            for layer in range(LAYERS):
                sender.on_layer(layer)
        # which shm path each step took (the tcp transport sends rows either way)
        assert in_place == {
            "contiguous": [True, True],
            "shuffled": [False, False],
            "mixed": [True, False],  # one 50-token stretch; then stretches of 10 and 70
        }[tables]
        sender.finish("r", first_token=7)
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
    finally:
        recv.close()
