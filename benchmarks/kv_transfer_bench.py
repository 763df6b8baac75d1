"""KV transfer throughput per transport against a plain memcpy, and how much of a prompt's
transfer stays exposed behind its prefill.

    python benchmarks/kv_transfer_bench.py [--model DIR] [--tokens 2048] [--output FILE]

1. memcpy: `torch.Tensor.copy_` of the KV bytes of `--tokens` tokens (all layers), best of N.
2. shm: the prefill side's real path (`KVSender` with a mapped /dev/shm cache), layer by layer,
   twice: with the request's blocks in order on both sides (one stretch, copied in place) and
   with its destination blocks scattered over the decode cache (rows gathered and scattered).
3. tcp: the same rows as zero-copy ZMQ frames over loopback TCP to a `KVReceiver` in another
   process, which writes them into its cache; timed until its `KVDone` arrives.
4. ceilings: the same bytes in 4 MiB messages between two processes over loopback, through a
   plain socket (`sendall` -> `recv_into` a buffer) and through a plain ZMQ PUSH/PULL pair (no
   KV code at all): what any TCP transport, or one built on ZMQ, could reach on this machine.
5. exposed: a real prefill of the prompt on an `EngineCore` whose layers hand their KV to the
   sender as they finish (shm, and tcp to a receiver in the same process); exposed = the time
   the step loop waited for transfers after the forward, next to the prefill time; and once
   more with the engine split over two tensor-parallel ranks (the followers' rows gathered to
   rank 0 after the forward, then shipped).

The model defaults to a random ~125M Llama written with `pdserve make-model --preset llama-125m`.
"""

from __future__ import annotations

import argparse
import functools
import json
import multiprocessing as mp
import socket
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import zmq

from pdserve.config import EngineArgs, ModelConfig
from pdserve.disagg.connector import KVReceiver, KVSender, shm_cache_factory
from pdserve.disagg.protocol import KVDest, KVLayout, model_identity


def layout_of(cfg: ModelConfig, block_size: int) -> KVLayout:
    return KVLayout(
        model_identity(cfg), "float32", cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, block_size
    )


def best_of(fn, n: int = 5) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def memcpy_seconds(num_bytes: int) -> float:
    src = torch.randn(num_bytes // 4)
    dst = torch.empty_like(src)
    return best_of(lambda: dst.copy_(src))


class _Plan:  # the two fields of a scheduler plan the sender reads
    def __init__(self, request, n):
        self.scheduled = [type("S", (), {"request": request, "num_new_tokens": n})()]


class _Req:
    def __init__(self, rid, n):
        self.request_id, self.num_computed_tokens, self.num_tokens = rid, 0, n


def make_caches(cfg: ModelConfig, num_slots: int, factory=None) -> list[torch.Tensor]:
    shape = (cfg.num_layers, 2, num_slots, cfg.num_kv_heads, cfg.head_dim)
    cache = factory(shape, torch.float32, torch.device("cpu")) if factory else torch.randn(shape)
    return list(cache.unbind(0))


def ship(sender: KVSender, peer_id: int, rid: str, layers: int, tokens: int, blocks, dst_blocks):
    """One request's KV through `sender`: every layer queued, then its `KVDone`."""
    sender.add_request(rid, KVDest(peer_id, dst_blocks, 0))
    sender.begin_step(_Plan(_Req(rid, tokens), tokens), {rid: blocks})
    for layer in range(layers):
        sender.on_layer(layer)
    sender.finish(rid, first_token=1)


KEY = b"benchmark-key" * 2  # the deployment secret both ends share


def every_block(caches, block_size: int):
    """A receiver's reservation lookup that lets every request write anywhere (a benchmark)."""
    blocks = list(range(caches[0].shape[1] // block_size))
    return lambda request_id: blocks


def sender_seconds(cfg, layout, tokens, block_size, peer_endpoint, own, dst_blocks) -> float:
    """Time one request's KV through a KVSender: all layers queued, then flushed and signalled.
    Its blocks are 0, 1, 2... here and `dst_blocks` at the destination."""
    sender = KVSender(0, own, block_size, layout, KEY)
    sender.add_peer(peer_endpoint)
    blocks = list(range(tokens // block_size))
    times = []
    for i in range(4):
        t0 = time.perf_counter()
        ship(sender, peer_endpoint.worker_id, f"r{i}", cfg.num_layers, tokens, blocks, dst_blocks)
        sender.flush()
        times.append(time.perf_counter() - t0)
    return min(times)


def _tcp_receiver(cfg_path, block_size, tokens, conn):
    cfg = ModelConfig.from_pretrained(cfg_path)
    caches = make_caches(cfg, tokens)
    recv = KVReceiver(
        1,
        caches,
        "tcp",
        "tcp://127.0.0.1:0",
        [],
        layout_of(cfg, block_size),
        reservation=every_block(caches, block_size),
        key=KEY,
        max_tokens=tokens,
    )
    conn.send(recv.endpoint())
    poller = zmq.Poller()  # waits as a decode worker's loop does
    poller.register(recv.waker, zmq.POLLIN)
    done_count = 0
    while done_count < 4:
        poller.poll(100)
        done, _ = recv.poll()
        done_count += len(done)
        for _ in done:
            conn.send(time.perf_counter())
    recv.close()


def tcp_seconds(cfg, model, layout, tokens, block_size, own) -> float:
    parent, child = mp.Pipe()
    proc = mp.get_context("spawn").Process(
        target=_tcp_receiver, args=(model, block_size, tokens, child)
    )
    proc.start()
    endpoint = parent.recv()
    sender = KVSender(0, own, block_size, layout, KEY)
    sender.add_peer(endpoint)
    blocks = list(range(tokens // block_size))
    times = []
    for i in range(4):
        t0 = time.perf_counter()
        ship(sender, endpoint.worker_id, f"t{i}", cfg.num_layers, tokens, blocks, blocks)
        times.append(parent.recv() - t0)  # same host: perf_counter is one clock
    proc.join(timeout=30)
    return min(times)


CEILING_MSG = 4 << 20


def _ceiling_receiver(kind: str, total: int, conn) -> None:
    buf = bytearray(CEILING_MSG)
    view = memoryview(buf)
    if kind == "socket":
        srv = socket.create_server(("127.0.0.1", 0))
        conn.send(srv.getsockname()[1])
        peer, _ = srv.accept()
        got = 0
        while got < total:
            n = peer.recv_into(view, min(CEILING_MSG, total - got))
            got += n
            if n == 0:
                break
        peer.close()
        srv.close()
    else:
        sock = zmq.Context.instance().socket(zmq.PULL)
        sock.setsockopt(zmq.RCVHWM, 0)
        conn.send(sock.bind_to_random_port("tcp://127.0.0.1"))
        got = 0
        while got < total:
            frame = sock.recv(copy=False)
            view[: len(frame.buffer)] = frame.buffer  # into one buffer, as a receiver must
            got += len(frame.buffer)
        sock.close(linger=0)
    conn.send(time.perf_counter())


def ceiling_seconds(kind: str, num_bytes: int) -> float:
    """Seconds to move `num_bytes` to another process over loopback: "socket" or "zmq"."""
    count = max(1, num_bytes // CEILING_MSG)
    data = np.random.default_rng(0).bytes(CEILING_MSG)
    times = []
    for _ in range(3):
        parent, child = mp.Pipe()
        proc = mp.get_context("spawn").Process(
            target=_ceiling_receiver, args=(kind, count * CEILING_MSG, child)
        )
        proc.start()
        port = parent.recv()
        if kind == "socket":
            out = socket.create_connection(("127.0.0.1", port))
            t0 = time.perf_counter()
            for _ in range(count):
                out.sendall(data)
        else:
            out = zmq.Context.instance().socket(zmq.PUSH)
            out.setsockopt(zmq.SNDHWM, 0)
            out.connect(f"tcp://127.0.0.1:{port}")
            time.sleep(0.2)  # connected before the clock starts
            t0 = time.perf_counter()
            for _ in range(count):
                out.send(data, copy=False)
        times.append((parent.recv() - t0) * num_bytes / (count * CEILING_MSG))
        proc.join(timeout=30)
        out.close()
    return min(times)


def exposed_seconds(
    model: str, tokens: int, block_size: int, transport: str = "shm", tp: int = 1
) -> dict:
    """A real prefill with the sender hooked into every layer (tcp: to a receiver in this
    process, whose receive threads take the rows while the prefill computes). `tp` 2: the
    engine split over two ranks, whose rows are gathered to rank 0 after the forward and shipped
    from there (the gather counts as exposed: the step loop waits for it)."""
    from pdserve.engine.core import EngineCore
    from pdserve.types import KVRole, SamplingParams

    args = EngineArgs(
        model=model,
        max_num_batched_tokens=tokens,
        num_kv_blocks=4 * tokens // block_size,
        enable_prefix_caching=False,
        block_size=block_size,
        tensor_parallel_size=tp,
    )
    core = EngineCore(args)
    cfg, runner = core.model_config, core.runner
    layout = layout_of(cfg, block_size)
    paths: list[str] = []
    factory = shm_cache_factory(paths) if transport == "shm" else None
    peer_caches = make_caches(cfg, runner.num_blocks * block_size, factory)
    recv = KVReceiver(
        1,
        peer_caches,
        transport,
        f"ipc://{tempfile.mkdtemp()}/kv" if transport == "shm" else "tcp://127.0.0.1:0",
        paths,
        layout,
        reservation=every_block(peer_caches, block_size),
        key=KEY,
        max_tokens=tokens,
    )
    sender = KVSender(0, runner.kv_caches, block_size, layout, KEY)
    sender.add_peer(recv.endpoint())
    gather = None
    if tp > 1:
        gather = functools.partial(runner.tp.gather_rows, runner.kv_caches)
    else:
        runner.add_layer_hook(sender.on_layer)
    rng = np.random.default_rng(0)
    results = []
    for i in range(3):
        prompt = rng.integers(3, cfg.vocab_size, tokens - 1).tolist()
        rid = f"p{i}"
        req = core.make_request(rid, prompt, SamplingParams(max_tokens=1, temperature=0))
        req.kv_role = KVRole.SEND
        dest = KVDest(1, list(range(tokens // block_size)), 0)
        req.kv_dest = dest
        sender.add_request(rid, dest)
        core.add_request(req)
        plan = core.scheduler.schedule()
        exposed0 = sender.exposed_s
        t0 = time.perf_counter()
        sender.begin_step(plan, core.kv.req_block_ids)
        core.execute(plan)
        t1 = time.perf_counter()
        if gather is not None:
            sender.ship_step(gather)
        gathered = time.perf_counter()
        stats = sender.finish(rid, req.output_token_ids[0] if req.output_token_ids else 0)
        t2 = time.perf_counter()
        core.scheduler.remote.take_handed_off()
        results.append(
            {
                "prefill_s": t1 - t0,
                "exposed_s": sender.exposed_s - exposed0 + gathered - t1,
                "gather_s": gathered - t1,
                "flush_s": t2 - t1,
                "transfer_bytes": stats[0] if stats else 0,
            }
        )
    recv.close()
    core.close()
    best = min(results, key=lambda r: r["prefill_s"])
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="model folder (default: a fresh random llama-125m)")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--output", help="write the results as JSON here")
    a = p.parse_args()
    torch.set_num_threads(2)
    model = a.model
    if model is None:
        from pdserve.models.make import write_random_model

        model = str(write_random_model(Path(tempfile.mkdtemp()) / "llama-125m", "llama-125m"))
    cfg = ModelConfig.from_pretrained(model)
    layout = layout_of(cfg, a.block_size)
    kv_bytes = cfg.num_layers * 2 * a.tokens * cfg.num_kv_heads * cfg.head_dim * 4

    own = make_caches(cfg, a.tokens)
    t_memcpy = memcpy_seconds(kv_bytes)

    paths: list[str] = []
    peer = make_caches(cfg, a.tokens, shm_cache_factory(paths))
    recv = KVReceiver(
        1,
        peer,
        "shm",
        f"ipc://{tempfile.mkdtemp()}/kv",
        paths,
        layout,
        reservation=every_block(peer, a.block_size),
        key=KEY,
        max_tokens=a.tokens,
    )
    # the request's blocks in order on both sides (one stretch: copied in place), then scattered
    # over the decode cache (every block its own stretch: gathered and scattered)
    in_order = list(range(a.tokens // a.block_size))
    t_shm = sender_seconds(cfg, layout, a.tokens, a.block_size, recv.endpoint(), own, in_order)
    ok = all(torch.equal(o, q) for o, q in zip(own, peer))
    scattered = np.random.default_rng(0).permutation(len(in_order)).tolist()
    t_shm_scattered = sender_seconds(
        cfg, layout, a.tokens, a.block_size, recv.endpoint(), own, scattered
    )
    slot = lambda blocks: (  # noqa: E731
        torch.tensor(blocks).repeat_interleave(a.block_size) * a.block_size
        + torch.arange(a.block_size).repeat(len(blocks))
    )
    ok = ok and all(torch.equal(o, q[:, slot(scattered)]) for o, q in zip(own, peer))
    recv.close()
    t_tcp = tcp_seconds(cfg, model, layout, a.tokens, a.block_size, own)
    t_socket, t_zmq = (ceiling_seconds(kind, kv_bytes) for kind in ("socket", "zmq"))
    exposed = exposed_seconds(model, a.tokens, a.block_size)
    exposed_tcp = exposed_seconds(model, a.tokens, a.block_size, "tcp")
    exposed_tp = exposed_seconds(model, a.tokens, a.block_size, "shm", tp=2)

    gbs = lambda t: kv_bytes / t / 1e9  # noqa: E731
    res = {
        "tokens": a.tokens,
        "kv_bytes": kv_bytes,
        "memcpy_gbs": gbs(t_memcpy),
        "shm_gbs": gbs(t_shm),
        "shm_scattered_gbs": gbs(t_shm_scattered),
        "tcp_gbs": gbs(t_tcp),
        "shm_vs_memcpy": t_memcpy / t_shm,
        "shm_scattered_vs_memcpy": t_memcpy / t_shm_scattered,
        "tcp_vs_memcpy": t_memcpy / t_tcp,
        "socket_ceiling_gbs": gbs(t_socket),
        "zmq_ceiling_gbs": gbs(t_zmq),
        "shm_copy_exact": ok,
        **{f"prefill_{k}": v for k, v in exposed.items()},
        **{f"tcp_prefill_{k}": v for k, v in exposed_tcp.items()},
        **{f"tp2_prefill_{k}": v for k, v in exposed_tp.items()},
    }
    res["exposed_fraction_of_transfer"] = exposed["exposed_s"] / t_shm if t_shm else None
    print(f"KV of {a.tokens} tokens: {kv_bytes / 1e6:.1f} MB ({cfg.num_layers} layers)")
    print(f"  memcpy   {res['memcpy_gbs']:7.2f} GB/s")
    print(
        f"  shm      {res['shm_gbs']:7.2f} GB/s  ({res['shm_vs_memcpy']:.0%} of memcpy; blocks "
        f"in order on both sides)"
    )
    print(
        f"  shm      {res['shm_scattered_gbs']:7.2f} GB/s  ({res['shm_scattered_vs_memcpy']:.0%} "
        f"of memcpy; blocks scattered at the destination); both exact: {ok}"
    )
    print(f"  tcp      {res['tcp_gbs']:7.2f} GB/s  ({res['tcp_vs_memcpy']:.0%} of memcpy)")
    for kind in ("socket", "zmq"):
        v = res[f"{kind}_ceiling_gbs"]
        print(
            f"  {kind:8} {v:7.2f} GB/s  ({v / res['memcpy_gbs']:.0%} of memcpy; loopback ceiling)"
        )
    for name, e in (("shm", exposed), ("tcp", exposed_tcp), ("shm, TP=2 prefill", exposed_tp)):
        print(
            f"  {name}: prefill of {a.tokens} tokens {e['prefill_s'] * 1e3:.0f} ms; transfer "
            f"left exposed after it: {e['exposed_s'] * 1e3:.1f} ms "
            f"({e['exposed_s'] / e['prefill_s']:.1%} of the prefill)"
        )
    if a.output:
        Path(a.output).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
