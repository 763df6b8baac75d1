"""Offload tiers without a model: the host arena, the disk tier, the stack, the reload rule, the
`--kv-offload` specs and the KV manager's side (tier hits, evictions, no leaked blocks)."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

from pdserve.config import EngineArgs
from pdserve.kv.manager import KVCacheManager
from pdserve.kv.offload.cost import ReloadCost
from pdserve.kv.offload.disk import DiskTier
from pdserve.kv.offload.entry import checksum, fingerprint, weights_digest
from pdserve.kv.offload.host import HostTier
from pdserve.kv.offload.spec import parse_tier, parse_tiers
from pdserve.kv.offload.stack import TierStack
from pdserve.request import Request
from pdserve.types import SamplingParams

PAYLOAD = 4096
FP = fingerprint("test-layout")


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def payload(i: int, n: int = PAYLOAD) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, n, dtype=np.uint8)


def put(tier, i: int):
    p = payload(i)
    return tier.put(key(i), p, checksum(p))


# ---- host tier -------------------------------------------------------------------------------
def test_host_tier_round_trip_and_lru_eviction_hands_down_the_oldest():
    tier = HostTier(3 * PAYLOAD, PAYLOAD, FP)
    assert tier.num_slots == 3
    for i in range(3):
        assert put(tier, i) == []
    assert np.array_equal(tier.get(key(0)), payload(0))  # 0 is now the most recent
    demoted = put(tier, 3)  # evicts the least recently used: 1
    assert [k for k, _, _ in demoted] == [key(1)]
    k, p, crc = demoted[0]
    assert np.array_equal(p, payload(1)) and crc == checksum(payload(1))
    assert tier.get(key(1)) is None and tier.stats.misses["absent"] == 1
    for i in (0, 2, 3):
        assert np.array_equal(tier.get(key(i)), payload(i))
    assert tier.used_bytes() == 3 * tier.slot_bytes
    assert tier.stats.evicted == 1 and tier.stats.hits == 4
    tier.close()


def test_host_tier_never_serves_a_corrupt_slot():
    tier = HostTier(2 * PAYLOAD, PAYLOAD, FP)
    put(tier, 7)
    i = tier._find(key(7))
    tier.slots[i, 100] ^= 0xFF  # a flipped byte
    assert tier.get(key(7)) is None
    assert tier.stats.misses["corrupt"] == 1
    tier.table["length"][i] = 10  # a torn header
    assert tier.get(key(7)) is None and tier.stats.misses["corrupt"] == 2
    tier.close()


def test_host_tier_is_shared_through_its_file_and_refuses_another_layout(tmp_path):
    path = str(tmp_path / "arena")
    a = HostTier(4 * PAYLOAD, PAYLOAD, FP, path)
    b = HostTier(4 * PAYLOAD, PAYLOAD, FP, path)
    put(a, 1)
    assert b.contains(key(1)) and np.array_equal(b.get(key(1)), payload(1))
    assert put(b, 1) == [] and a.stats.stored == 1 and b.stats.stored == 0  # already there
    with pytest.raises(ValueError, match="another layout or size"):
        HostTier(4 * PAYLOAD, PAYLOAD, fingerprint("other"), path)
    with pytest.raises(ValueError, match="another layout or size"):
        HostTier(8 * PAYLOAD, PAYLOAD, FP, path)
    assert os.stat(path).st_mode & 0o777 == 0o600
    a.close()
    b.close()


def test_host_tier_reads_racing_writes_never_return_a_wrong_block(tmp_path):
    """A writer churns 6 keys through 3 slots while another mapping reads them: whatever the
    interleaving, a read returns the right payload or a miss (the hit count depends on the
    thread schedule, so it is not asserted; the right-or-miss property is)."""
    big = 1 << 18  # long copies: reads and rewrites of one slot overlap
    path = str(tmp_path / "arena")
    writer, reader = HostTier(3 * big, big, FP, path), HostTier(3 * big, big, FP, path)
    payloads = [payload(i, big) for i in range(6)]
    stop = threading.Event()

    def churn():
        i = 0
        while not stop.is_set():
            p = payloads[i % 6]
            writer.put(key(i % 6), p, checksum(p))
            i += 1

    t = threading.Thread(target=churn)
    t.start()
    try:
        for n in range(2000):
            got = reader.get(key(n % 6))
            assert got is None or np.array_equal(got, payloads[n % 6])
    finally:
        stop.set()
        t.join()
    writer.put(key(0), payloads[0], checksum(payloads[0]))  # quiet again: a plain hit
    assert np.array_equal(reader.get(key(0)), payloads[0])
    writer.close()
    reader.close()


def test_host_tier_too_small_for_one_block_is_refused():
    with pytest.raises(ValueError, match="one block needs"):
        HostTier(PAYLOAD - 1, PAYLOAD, FP)


# ---- disk tier -------------------------------------------------------------------------------
def test_disk_tier_round_trip_survives_a_restart_and_keeps_its_size(tmp_path):
    tier = DiskTier(str(tmp_path), 3 * (PAYLOAD + 100), PAYLOAD, FP)
    for i in range(4):
        put(tier, i)
    assert tier.get(key(0)) is None  # the oldest went for room
    assert tier.stats.evicted == 1 and len(os.listdir(tier.dir)) == 3
    assert oct(os.stat(tier.dir).st_mode & 0o777) == "0o700"
    again = DiskTier(str(tmp_path), 3 * (PAYLOAD + 100), PAYLOAD, FP)  # a restart
    for i in (1, 2, 3):
        assert np.array_equal(again.get(key(i)), payload(i))
    other = DiskTier(str(tmp_path), 3 * (PAYLOAD + 100), PAYLOAD, fingerprint("other model"))
    assert not other.contains(key(1)) and other.get(key(1)) is None  # not this model's


def test_disk_tier_truncated_corrupt_and_missing_files_are_misses(tmp_path):
    tier = DiskTier(str(tmp_path), 10 * PAYLOAD, PAYLOAD, FP)
    for i in range(3):
        put(tier, i)
    path0, path1 = tier._path(key(0)), tier._path(key(1))
    with open(path0, "r+b") as f:
        f.truncate(1000)
    with open(path1, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 1]))
    assert tier.get(key(0)) is None and tier.get(key(1)) is None
    assert tier.stats.misses["corrupt"] == 2
    assert not os.path.exists(path0) and not os.path.exists(path1)  # removed
    os.unlink(tier._path(key(2)))
    assert tier.get(key(2)) is None and tier.stats.misses["absent"] == 1


def test_disk_tier_survives_its_directory_being_deleted_and_a_full_disk(tmp_path, monkeypatch):
    import shutil

    tier = DiskTier(str(tmp_path / "kv"), 10 * PAYLOAD, PAYLOAD, FP)
    put(tier, 1)
    shutil.rmtree(tmp_path / "kv")
    assert tier.get(key(1)) is None
    put(tier, 2)  # the directory is made again
    assert np.array_equal(tier.get(key(2)), payload(2))

    def full(fd, data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "write", full)
    assert put(tier, 3) == []
    assert tier.stats.store_errors == 1 and not tier.contains(key(3))
    assert [n for n in os.listdir(tier.dir) if ".tmp-" in n] == []  # no half-written file


def test_disk_tiers_sharing_a_directory_keep_it_to_its_size(tmp_path, monkeypatch):
    import pdserve.kv.offload.disk as disk_mod

    monkeypatch.setattr(disk_mod, "RESCAN_EVERY", 1)  # learn the other's files at every store
    cap = 4 * (PAYLOAD + 100)
    a = DiskTier(str(tmp_path), cap, PAYLOAD, FP)
    b = DiskTier(str(tmp_path), cap, PAYLOAD, FP)
    for i in range(3):
        put(a, i)
    fresh = os.path.join(a.dir, "00.kv.tmp-1-live")  # another worker's store in progress
    stale = os.path.join(a.dir, "01.kv.tmp-2-dead")
    for path in (fresh, stale):
        with open(path, "wb") as f:
            f.write(b"x")
    os.utime(stale, ns=(0, 0))
    for i in range(3, 6):
        put(b, i)
    kept = sorted(n for n in os.listdir(a.dir) if n.endswith(".kv"))
    assert len(kept) == 4 and key(0).hex() + ".kv" not in kept  # the oldest went
    assert os.path.exists(fresh) and not os.path.exists(stale)
    assert np.array_equal(a.get(key(5)), payload(5))  # b's entry, read by a


def test_weights_digest_follows_the_weights_and_is_memoized(tmp_path):
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"a" * 1000)
    memo = tmp_path / "memo"
    memo.mkdir()
    d1 = weights_digest(str(model), str(memo))
    assert d1 == weights_digest(str(model), str(memo))
    assert (memo / "weights-digests.json").exists()
    (model / "model.safetensors").write_bytes(b"b" * 1000)
    assert weights_digest(str(model), str(memo)) != d1
    (model / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="no safetensors"):
        weights_digest(str(model))


# ---- stack -----------------------------------------------------------------------------------
def test_stack_stores_in_the_background_hands_down_and_fetches_from_either_tier(tmp_path):
    host = HostTier(2 * PAYLOAD, PAYLOAD, FP)
    disk = DiskTier(str(tmp_path), 10 * PAYLOAD, PAYLOAD, FP)
    stack = TierStack([host, disk], PAYLOAD, 16)
    stack.save([key(i) for i in range(4)], np.stack([payload(i) for i in range(4)]))
    assert stack.flush()
    assert host.stats.stored == 4 and disk.stats.stored == 2  # 0 and 1 handed down
    assert stack.leading([key(0), key(1), key(2), key(3), key(9), key(2)]) == 4
    got = stack.fetch([key(i) for i in range(5)])
    assert len(got) == 4 and all(np.array_equal(g, payload(i)) for i, g in enumerate(got))
    assert disk.stats.hits == 2 and host.stats.hits == 2
    stack.fetch([key(0)])  # from the ready set: no second read
    assert disk.stats.hits == 2
    state = stack.state()
    assert [t.tier for t in state.tiers] == ["cpu", "disk"] and state.tiers[1].hits == 2
    stack.close()


def test_stack_prefetch_reads_ahead_so_admission_reads_nothing(tmp_path):
    disk = DiskTier(str(tmp_path), 10 * PAYLOAD, PAYLOAD, FP)
    for i in range(3):
        put(disk, i)
    stack = TierStack([disk], PAYLOAD, 16)
    stack.prefetch([key(0), key(1), key(2), key(7), key(1)])  # up to the first miss
    assert stack.flush()
    assert stack.prefetched_blocks == 3 and disk.stats.hits == 3
    got = stack.fetch([key(0), key(1), key(2)])
    assert all(np.array_equal(g, payload(i)) for i, g in enumerate(got))
    assert stack.read_on_step == 0 and disk.stats.hits == 3  # nothing read on the step
    stack.taken([key(0), key(1), key(2)])
    assert not stack.ready
    stack.close()


def test_stack_the_step_and_the_read_ahead_never_read_a_block_twice(tmp_path):
    import time as _time

    class SlowDisk(DiskTier):
        def get(self, k):
            _time.sleep(0.005)  # a cold disk: both readers are on the same blocks at once
            return super().get(k)

    disk = SlowDisk(str(tmp_path), 40 * PAYLOAD, PAYLOAD, FP)
    for i in range(20):
        put(disk, i)
    stack = TierStack([disk], PAYLOAD, 16)
    keys = [key(i) for i in range(20)]
    stack.prefetch(keys)
    got = stack.fetch(keys)  # races the read-ahead through the same keys
    assert stack.flush()
    assert all(np.array_equal(g, payload(i)) for i, g in enumerate(got))
    assert disk.stats.hits == 20  # each block read once, by one of the two
    assert stack.prefetched_blocks + stack.read_on_step == 20
    stack.close()


def test_stack_drops_saves_rather_than_wait_for_a_slow_store(tmp_path):
    gate = threading.Event()

    class Slow(HostTier):
        def put(self, k, p, crc):
            gate.wait()
            return super().put(k, p, crc)

    stack = TierStack([Slow(8 * PAYLOAD, PAYLOAD, FP)], PAYLOAD, 16, max_pending_bytes=2 * PAYLOAD)
    stack.save([key(i) for i in range(6)], np.stack([payload(i) for i in range(6)]))
    assert stack.dropped_blocks >= 3  # the queue holds 2, the thread at most 1 more
    gate.set()
    assert stack.flush()
    assert stack.saved_blocks + stack.dropped_blocks == 6
    stack.close()


# ---- cost rule and specs -----------------------------------------------------------------------
def test_reload_rule_compares_measured_load_and_recompute_times():
    rule = ReloadCost(block_bytes=1_000_000, block_size=16)
    assert rule.worth_loading(4)  # nothing measured yet: load (and measure)
    rule.observe_load(1_000_000_000, 1.0)  # 1 GB/s: 1 ms a block
    rule.observe_prefill(1600, 1.0)  # 100 blocks/s: 10 ms a block
    assert rule.worth_loading(4)
    slow = ReloadCost(block_bytes=1_000_000, block_size=16)
    slow.observe_load(10_000_000, 1.0)  # 100 ms a block
    slow.observe_prefill(1600, 1.0)
    assert not slow.worth_loading(4)
    assert ReloadCost(1, 16, always=True).worth_loading(1)


def test_offload_specs_parse_and_stack_in_order():
    assert parse_tier("cpu:4GiB").capacity_bytes == 4 << 30
    d = parse_tier("disk:/var/lib/kv:a:1GiB")
    assert (d.kind, d.path, d.capacity_bytes) == ("disk", "/var/lib/kv:a", 1 << 30)
    assert [s.kind for s in parse_tiers(["cpu:1GiB", "disk:/x:2GiB"])] == ["cpu", "disk"]
    for bad in ("gpu:1GiB", "cpu", "cpu:0", "disk:1GiB", "disk::1GiB", "cpu:lots"):
        with pytest.raises(ValueError, match="kv_offload"):
            parse_tier(bad)
    with pytest.raises(ValueError, match="at most one cpu tier"):
        parse_tiers(["disk:/x:1GiB", "cpu:1GiB"])
    with pytest.raises(ValueError, match="kv_offload"):
        EngineArgs(model="m", kv_offload=("cpu:1GiB", "cpu:2GiB"))
    assert EngineArgs(model="m", kv_offload=("cpu:1GiB",)).kv_offload == ("cpu:1GiB",)


# ---- the KV manager ----------------------------------------------------------------------------
BS = 4


def request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4), 4, eos_token_ids=())


def admit(kv: KVCacheManager, r: Request) -> int:
    match, n = kv.get_computed_blocks(r)
    assert kv.allocate_slots(r, r.num_tokens - n, match)
    r.num_computed_tokens = r.num_tokens
    return n


def test_manager_saves_evicted_blocks_and_loads_tier_hits_into_fresh_blocks():
    host = HostTier(64 * 8, 8, FP)
    stack = TierStack([host], 8, BS, always_reload=True)
    kv = KVCacheManager(4, BS, tier=stack)
    a = request("a", list(range(13)))  # 3 full blocks + 1 token: all 4 blocks
    admit(kv, a)
    kv.free(a)
    assert not kv.take_transfers()
    b = request("b", list(range(100, 113)))  # evicts a's 3 cached blocks
    admit(kv, b)
    t = kv.take_transfers()
    assert sorted(h for _, h in t.save) == sorted(a.block_hashes) and t.load == []
    saved = [h for _, h in t.save]
    stack.save(saved, np.stack([payload(a.block_hashes.index(h), 8) for h in saved]))
    assert stack.flush()
    kv.free(b)
    a2 = request("a2", list(range(13)))
    assert admit(kv, a2) == 12  # a's three blocks, from the tier
    t = kv.take_transfers()
    assert [i for i, _ in t.load] == kv.block_ids("a2")[:3]
    assert all(np.array_equal(p, payload(i, 8)) for i, (_, p) in enumerate(t.load))
    assert kv.stats.tier_hits == 12 and stack.loaded_blocks == 3
    # published once loaded: a third request hits them in the pool
    a3 = request("a3", list(range(13)))
    assert kv.get_computed_blocks(a3)[0].blocks and not kv.get_computed_blocks(a3)[0].loads
    kv.free(a2)
    kv.pool.check_whole()
    stack.close()


def test_manager_a_block_loaded_then_evicted_in_one_schedule_is_neither_saved_nor_loaded():
    stack = TierStack([HostTier(64 * 8, 8, FP)], 8, BS, always_reload=True)
    kv = KVCacheManager(4, BS, tier=stack)
    a = request("a", list(range(9)))
    admit(kv, a)
    kv.free(a)
    b = request("b", list(range(50, 59)))
    admit(kv, b)
    t = kv.take_transfers()
    stack.save([h for _, h in t.save], np.stack([payload(i, 8) for i in range(len(t.save))]))
    stack.flush()
    kv.free(b)
    a2 = request("a2", list(range(9)))
    match, n = kv.get_computed_blocks(a2)
    assert match.loads  # some of a's blocks come back from the tier
    assert kv.allocate_slots(a2, a2.num_tokens - n, match)
    ids = kv.block_ids("a2")
    loaded = ids[len(match.blocks) : match.num_blocks]
    kv.free(a2)  # ends in the same schedule (an abort, say)
    c = request("c", list(range(200, 216)))  # takes every block, a2's loaded ones included
    match, n = kv.get_computed_blocks(c)
    assert kv.allocate_slots(c, c.num_tokens - n, match)
    assert set(loaded) <= set(kv.block_ids("c"))
    t = kv.take_transfers()
    assert not {i for i, _ in t.load} & set(loaded)  # c writes them: no load
    assert not {i for i, _ in t.save} & set(loaded)  # their bytes never arrived: no save
    kv.free(c)
    kv.pool.check_whole()
    stack.close()


def test_manager_unpublished_loaded_blocks_of_a_request_that_ends_get_no_bytes():
    """Blocks reserved for remote KV (publish=False) that a tier would fill: if the request ends
    in the same schedule, the load is dropped with them."""
    stack = TierStack([HostTier(64 * 8, 8, FP)], 8, BS, always_reload=True)
    kv = KVCacheManager(8, BS, tier=stack)
    a = request("a", list(range(9)))
    match, n = kv.get_computed_blocks(a)
    kv.allocate_slots(a, a.num_tokens, match)
    stack.save(a.block_hashes[:2], np.stack([payload(i, 8) for i in range(2)]))
    stack.flush()
    kv.free(a)
    kv.pool.cached.clear()  # forget the pool's copies: only the tier has them
    for b in kv.pool.blocks:
        b.block_hash = None
    r = request("r", list(range(9)))
    match, n = kv.get_computed_blocks(r)
    assert n == 8 and len(match.loads) == 2
    assert kv.allocate_slots(r, r.num_tokens - n, match, publish=False)
    kv.free(r)
    assert kv.take_transfers().load == []
    kv.pool.check_whole()
    stack.close()


def test_manager_prefetches_what_the_pool_lacks_when_a_request_arrives():
    stack = TierStack([HostTier(64 * 8, 8, FP)], 8, BS, always_reload=True)
    kv = KVCacheManager(8, BS, tier=stack)
    r = request("r", list(range(13)))  # 3 full blocks
    kv._update_hashes(r, 12)
    stack.save(r.block_hashes[1:], np.stack([payload(i, 8) for i in (1, 2)]))
    stack.flush()
    kv.prefetch(r)  # block 0 is nowhere: nothing to read ahead
    stack.flush()
    assert stack.prefetched_blocks == 0
    stack.save(r.block_hashes[:1], payload(0, 8)[None])
    stack.flush()
    kv.prefetch(r)
    stack.flush()
    assert stack.prefetched_blocks == 3
    match, n = kv.get_computed_blocks(r)
    assert n == 12 and stack.read_on_step == 0
    stack.close()


def test_manager_refuses_a_tier_without_prefix_caching():
    stack = TierStack([HostTier(64 * 8, 8, FP)], 8, BS)
    with pytest.raises(ValueError, match="prefix caching"):
        KVCacheManager(4, BS, enable_caching=False, tier=stack)
    stack.close()
