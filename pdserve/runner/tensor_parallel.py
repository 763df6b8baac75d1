"""Tensor parallelism inside one engine: the model's heads and MLP columns split over N ranks.

Rank 0 is the engine's own process: it schedules, builds each step's inputs, samples, and holds
the KV of its share of the KV heads. Ranks 1..N-1 are follower processes it starts on this host
(`python -m pdserve.runner.tensor_parallel`): each loads its shard of the weights and a KV cache
of the same blocks for its heads, then runs every forward rank 0 runs, on the inputs rank 0
broadcasts (`Step`, a msgspec message in a byte tensor, tagged with a secret drawn per group
and handed over in the environment). The sharding is Megatron's: q/k/v and gate/up split by
output rows (whole heads: `num_heads` and `num_kv_heads` must divide by N), o_proj and down_proj
by input columns, followed by one all-reduce each (two per layer); embeddings, norms and the
output head are whole on every rank, and only rank 0 computes logits.

Collectives are torch.distributed's gloo backend over loopback, rendezvous through a file in a
private directory (no TCP store port). A follower dies with rank 0 (PR_SET_PDEATHSIG) and rank
0's next collective fails when a follower dies, so the engine fails as a whole. KV offload
moves whole blocks: rank 0 asks the followers for their rows of the blocks it saves
(`SaveBlocks`) and hands them theirs of the blocks it loads (`LoadBlocks`), point to point, so a
tier holds each block's every rank.

Between prefill and decode workers KV travels with every head (`KVLayout` is the model's), so
the two pools' sizes are independent. A tensor-parallel prefill worker gathers the followers'
rows of each step's slots to rank 0 after the forward (`GatherRows`) and ships them from there;
a tensor-parallel decode worker over `shm` keeps every rank's cache in a file of its own, which
prefill workers write directly, and over `tcp` rank 0 receives the rows and hands each follower
its heads before the next step (`WriteRows`).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import datetime
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile

import msgspec
import numpy as np
import torch
import torch.distributed as dist

from pdserve.config import ModelConfig
from pdserve.ipc.channel import BadFrame, Decoder, Encoder
from pdserve.models.attention import AttentionMetadata, PrefillChunk
from pdserve.models.tp_shard import shard_config

logger = logging.getLogger(__name__)

TP_SECRET_ENV = "PDSERVE_TP_SECRET"  # hex; set by rank 0 for its followers
# Joining the group: a rank that fails to start makes the others fail after this, not hang.
JOIN_TIMEOUT = datetime.timedelta(seconds=120)
# An idle engine sends nothing for as long as it is idle: the followers' wait has no deadline
# that matters (they die with rank 0), so the collectives' timeout is long.
IDLE_TIMEOUT = datetime.timedelta(days=7)


# ---- messages rank 0 broadcasts -------------------------------------------------------------
class Array(msgspec.Struct, array_like=True):
    dtype: str
    shape: tuple[int, ...]
    data: bytes

    @classmethod
    def of(cls, t: torch.Tensor | None) -> Array | None:
        if t is None:
            return None
        a = t.detach().cpu().contiguous().numpy()
        return cls(str(a.dtype), a.shape, a.tobytes())

    def tensor(self, device: torch.device) -> torch.Tensor:
        a = np.frombuffer(self.data, dtype=np.dtype(self.dtype)).reshape(self.shape)
        return torch.from_numpy(a.copy()).to(device)


class Chunk(msgspec.Struct, array_like=True):
    q_start: int
    q_end: int
    ctx_slots: Array | None
    mask: Array | None


class Setup(msgspec.Struct, tag=True):
    num_blocks: int
    block_size: int
    kv_dtype: str
    row_width: int
    # a decode worker's cache in shared memory: each follower's file, in rank order (prefill
    # workers write them)
    cache_paths: list[str] | None = None


class Step(msgspec.Struct, tag=True):
    input_ids: Array
    positions: Array
    slot_mapping: Array
    num_decodes: int
    decode_slots: Array | None
    decode_mask: Array | None
    decode_lens: Array | None
    prefills: list[Chunk]
    num_layers: int  # the first layers to run: all, or a self-speculation draft's

    @classmethod
    def of(cls, input_ids, positions, meta: AttentionMetadata, num_layers: int) -> Step:
        chunks = [Chunk(c.q_start, c.q_end, Array.of(c.ctx_slots), Array.of(c.mask))
                  for c in meta.prefills]  # fmt: skip
        return cls(Array.of(input_ids), Array.of(positions), Array.of(meta.slot_mapping),
                   meta.num_decodes, Array.of(meta.decode_slots), Array.of(meta.decode_mask),
                   Array.of(meta.decode_lens), chunks, num_layers)  # fmt: skip

    def inputs(self, device) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        def t(a: Array | None):
            return None if a is None else a.tensor(device)

        meta = AttentionMetadata(t(self.slot_mapping), self.num_decodes, t(self.decode_slots),
                                 t(self.decode_mask), t(self.decode_lens),
                                 [PrefillChunk(c.q_start, c.q_end, t(c.ctx_slots), t(c.mask))
                                  for c in self.prefills])  # fmt: skip
        return t(self.input_ids), t(self.positions), meta


class SaveBlocks(msgspec.Struct, tag=True):
    """KV offload: each follower sends rank 0 its rows of these blocks (`BlockMover`)."""

    ids: Array


class LoadBlocks(msgspec.Struct, tag=True):
    """KV offload: rank 0 sends each follower its rows of these blocks, to write at them."""

    ids: Array


class GatherRows(msgspec.Struct, tag=True):
    """A prefill worker's KV transfer: each follower sends rank 0 its rows of these slots, every
    layer ([layers, 2, slots, its heads, row])."""

    slots: Array


class WriteRows(msgspec.Struct, tag=True):
    """A decode worker's KV received over tcp: rank 0 sends each follower its heads of these
    rows ([2, slots, its heads, row]), `counts[i]` slots in a row for layer `layers[i]`."""

    layers: list[int]
    counts: list[int]
    slots: Array


class Stop(msgspec.Struct, tag=True):
    pass


Message = Setup | Step | SaveBlocks | LoadBlocks | GatherRows | WriteRows | Stop
BLOCKS_TAG = 7  # the point-to-point messages that carry block rows


class Group:
    """One rank's end of the group: all-reduce for the layers, broadcast of rank 0's messages."""

    def __init__(self, store_path: str, rank: int, size: int, key: bytes) -> None:
        opts = dist.ProcessGroupGloo._Options()
        opts._devices = [dist.ProcessGroupGloo.create_device(interface="lo")]
        opts._timeout = JOIN_TIMEOUT
        self.pg = dist.ProcessGroupGloo(dist.FileStore(store_path, size), rank, size, opts)
        self.pg._set_default_timeout(IDLE_TIMEOUT)
        self.rank, self.size = rank, size
        self.encode, self.decode = Encoder(key), Decoder(Message, key)
        self._length = torch.zeros(1, dtype=torch.int64)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self.pg.allreduce([x]).wait()  # in place: every rank gets the sum
        return x

    def send(self, msg) -> None:  # rank 0
        frame = self.encode(msg)
        self._length[0] = len(frame)
        self.pg.broadcast(self._length, 0).wait()
        self.pg.broadcast(torch.frombuffer(bytearray(frame), dtype=torch.uint8), 0).wait()

    def receive(self):  # the other ranks
        self.pg.broadcast(self._length, 0).wait()
        buf = torch.empty(int(self._length[0]), dtype=torch.uint8)
        self.pg.broadcast(buf, 0).wait()
        return self.decode(buf.numpy().tobytes())

    def send_to(self, rank: int, t: torch.Tensor) -> None:
        self.pg.send([t], rank, BLOCKS_TAG).wait()

    def receive_from(self, rank: int, t: torch.Tensor) -> torch.Tensor:
        self.pg.recv([t], rank, BLOCKS_TAG).wait()
        return t

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.pg.shutdown()


def shard_model(model: torch.nn.Module, group: Group) -> None:
    """Each attention and MLP block sums its rows over the ranks after its last projection;
    rank 0 broadcasts every forward's inputs first, so the followers run it too."""
    for layer in model.layers:
        layer.self_attn.reduce = layer.mlp.reduce = group.all_reduce
    if group.rank == 0:
        model.tp_leader = lambda ids, pos, meta, n: group.send(Step.of(ids, pos, meta, n))


# ---- rank 0's side ---------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ShardArgs:
    """What a follower needs to build its shard (the engine's model settings)."""

    model: str
    dtype: str
    device: str
    max_model_len: int
    linear_backend: str
    attention_backend: str
    seed: int
    quantization: str = "none"  # each rank quantizes its own shard at load
    group_size: int = 32
    # threads per rank, unpinned (`--num-threads`); None: this process's CPUs shared out
    threads: int | None = None


class TensorParallel:
    """Rank 0: starts the followers and holds the group."""

    def __init__(self, size: int, shard_args: ShardArgs) -> None:
        self.size = size
        self.dir = tempfile.mkdtemp(prefix="pdserve-tp-")  # 0700: the rendezvous file
        key = secrets.token_bytes(32)
        # `--num-threads N` (a Ray worker gets its reserved CPUs as N): N threads per rank where
        # the OS puts them; else this process's CPUs shared out, a pinned share per rank
        cpus = None if shard_args.threads else _cpu_shares(size)
        threads = ["--threads", str(shard_args.threads)] if shard_args.threads else []
        env = {**os.environ, TP_SECRET_ENV: key.hex()}
        store = os.path.join(self.dir, "store")
        args = msgspec.json.encode(shard_args).decode()
        self.procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "pdserve.runner.tensor_parallel",
                    "--rank",
                    str(r),
                    "--size",
                    str(size),
                    "--store",
                    store,
                    "--shard-args",
                    args,
                    *(["--cpus", ",".join(map(str, cpus[r]))] if cpus else threads),
                ],
                env=env,
            )
            for r in range(1, size)
        ]
        try:
            self.group = Group(store, 0, size, key)
        except Exception:
            self.close()
            raise
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)  # every rank has opened the store
        if cpus:  # rank 0 keeps this process's CPUs and threads: fewer threads, no pinning
            torch.set_num_threads(len(cpus[0]))
        logger.info("tensor parallel: %d ranks over gloo (followers: %s)", size,
                    [p.pid for p in self.procs])  # fmt: skip

    def setup(self, num_blocks: int, block_size: int, kv_dtype: torch.dtype, width: int,
              cache_paths: list[str] | None = None) -> None:  # fmt: skip
        """Each follower allocates its cache: in memory, or mapped from its file of
        `cache_paths` (one per follower, in rank order)."""
        dtype = str(kv_dtype).removeprefix("torch.")
        self.group.send(Setup(num_blocks, block_size, dtype, width, cache_paths))

    def gather_rows(self, caches: list[torch.Tensor], slots: torch.Tensor) -> torch.Tensor:
        """The rows of `slots` in every layer with every rank's KV heads, [layers, 2, slots,
        heads, row] (rank 0's rows from `caches`, the followers' sent point to point)."""
        self.group.send(GatherRows(Array.of(slots)))
        own = torch.stack([c.index_select(1, slots) for c in caches])
        parts = [own]
        for r in range(1, self.size):
            parts.append(self.group.receive_from(r, torch.empty_like(own)))
        return torch.cat(parts, dim=3)

    def write_rows(self, pending: list[tuple[int, np.ndarray, torch.Tensor]]) -> None:
        """Hands the followers their heads of rows received for this worker's cache: each item
        (layer, destination slots, [2, slots, the followers' heads, row], rank 1's first)."""
        if not pending:
            return
        slots = np.concatenate([dst for _, dst, _ in pending])
        self.group.send(WriteRows([layer for layer, _, _ in pending],
                                  [len(dst) for _, dst, _ in pending],
                                  Array.of(torch.from_numpy(slots))))  # fmt: skip
        rows = torch.cat([r for _, _, r in pending], dim=1)
        for r, part in enumerate(rows.chunk(self.size - 1, dim=2), start=1):
            self.group.send_to(r, part.contiguous())

    def save_blocks(self, ids: torch.Tensor, own: np.ndarray) -> np.ndarray:
        """KV offload: the whole payloads of blocks `ids` [n, size x this rank's bytes], rank r's
        rows at the r-th part of each, from this rank's rows `own` and the followers'."""
        self.group.send(SaveBlocks(Array.of(ids)))
        parts = [own]
        for r in range(1, self.size):
            buf = torch.empty(own.shape, dtype=torch.uint8)
            parts.append(self.group.receive_from(r, buf).numpy())
        return np.concatenate(parts, axis=1)

    def load_blocks(self, ids: torch.Tensor, payloads: np.ndarray) -> np.ndarray:
        """KV offload: hands each follower its part of the payloads [n, size x per rank] of
        blocks `ids`; returns this rank's."""
        self.group.send(LoadBlocks(Array.of(ids)))
        parts = np.split(payloads, self.size, axis=1)
        for r in range(1, self.size):
            self.group.send_to(r, torch.from_numpy(np.ascontiguousarray(parts[r])))
        return parts[0]

    def close(self) -> None:
        group = getattr(self, "group", None)
        if group is not None and all(p.poll() is None for p in self.procs):
            with contextlib.suppress(Exception):
                group.send(Stop())
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if group is not None:
            group.close()


def _cpu_shares(size: int) -> list[list[int]] | None:
    """Each rank's CPUs: this process's, split in `size` equal shares (None when fewer)."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    cpus = sorted(os.sched_getaffinity(0))
    share = len(cpus) // size
    if share < 1:
        return None
    return [cpus[r * share : (r + 1) * share] for r in range(size)]


# ---- a follower -----------------------------------------------------------------------------
def _die_with_parent() -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def follow(rank: int, size: int, store: str, shard_args: ShardArgs) -> None:
    from pdserve.engine.c_heap import keep_freed_memory, release_free_memory
    from pdserve.heap import freeze_startup_heap
    from pdserve.kernels import huge_pages
    from pdserve.models.attention import make_backend
    from pdserve.models.loader import load_model
    from pdserve.runner.kv_offload import BlockMover
    from pdserve.runner.model_runner import resolve_dtype

    key = bytes.fromhex(os.environ.pop(TP_SECRET_ENV))
    group = Group(store, rank, size, key)
    torch.manual_seed(shard_args.seed)
    device = torch.device(shard_args.device)
    dtype = resolve_dtype(shard_args.dtype, device)
    cfg = ModelConfig.from_pretrained(shard_args.model)
    model = load_model(cfg, device, dtype, shard_args.max_model_len, shard_args.linear_backend,
                       make_backend(shard_args.attention_backend, device, dtype),
                       shard_args.quantization, shard_args.group_size, tp=(rank, size))  # fmt: skip
    shard_model(model, group)
    freeze_startup_heap()  # a full collection here would stall every rank at the next all-reduce
    release_free_memory()  # as the leader's engine does
    keep_freed_memory()
    caches: list[torch.Tensor] = []
    mover: BlockMover | None = None  # this rank's side of KV offload
    shard = shard_config(cfg, size)
    try:
        while True:
            try:
                msg = group.receive()
            except BadFrame as e:  # not rank 0's: the group cannot go on in step
                raise RuntimeError(f"tensor parallel rank {rank}: {e}") from None
            if isinstance(msg, Stop):
                return
            if isinstance(msg, Setup):
                shape = (cfg.num_layers, 2, msg.num_blocks * msg.block_size,
                         shard.num_kv_heads, msg.row_width)  # fmt: skip
                kv_dtype = getattr(torch, msg.kv_dtype)
                if msg.cache_paths:  # shared: prefill workers write this rank's heads here
                    path, numel = msg.cache_paths[rank - 1], int(np.prod(shape))
                    cache = torch.from_file(path, shared=True, size=numel, dtype=kv_dtype)
                    cache = cache.view(shape)
                else:  # as the leader's runner makes its own
                    cache = huge_pages.zeros(shape, kv_dtype, device)
                caches = list(cache.unbind(0))
                mover = BlockMover(caches, msg.num_blocks, None)
                continue
            if isinstance(msg, SaveBlocks):
                rows = mover.gather(msg.ids.tensor(device))
                group.send_to(0, torch.from_numpy(rows))
                continue
            if isinstance(msg, LoadBlocks):
                ids = msg.ids.tensor(device)
                rows = torch.empty((ids.numel(), mover.payload_bytes), dtype=torch.uint8)
                mover.scatter(ids, group.receive_from(0, rows).numpy())
                continue
            if isinstance(msg, GatherRows):
                slots = msg.slots.tensor(device)
                group.send_to(0, torch.stack([c.index_select(1, slots) for c in caches]))
                continue
            if isinstance(msg, WriteRows):
                slots = msg.slots.tensor(device)
                shape = (2, slots.numel(), shard.num_kv_heads, caches[0].shape[-1])
                rows = group.receive_from(0, torch.empty(shape, dtype=caches[0].dtype))
                at = 0
                for layer, n in zip(msg.layers, msg.counts):
                    caches[layer].index_copy_(1, slots[at : at + n], rows[:, at : at + n])
                    at += n
                continue
            input_ids, positions, meta = msg.inputs(device)
            model(input_ids, positions, caches[: msg.num_layers], meta)
    finally:
        group.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="a tensor-parallel rank (started by rank 0)")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--size", type=int, required=True)
    p.add_argument("--store", required=True)
    p.add_argument("--shard-args", required=True)
    p.add_argument("--cpus")
    p.add_argument("--threads", type=int)
    a = p.parse_args(argv)
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 decides when the group ends
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s tp{a.rank} %(message)s")
    if a.cpus:
        cpus = {int(c) for c in a.cpus.split(",")}
        os.sched_setaffinity(0, cpus)
        torch.set_num_threads(len(cpus))
    elif a.threads:
        torch.set_num_threads(a.threads)
    follow(a.rank, a.size, a.store, msgspec.json.decode(a.shard_args, type=ShardArgs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
