"""What an offload tier buys multi-turn chat: the Mooncake conversation trace with a KV cache too
small for the live sessions, served without a tier, with the host-memory tier and with the disk
tier, side by side in one run.

    python benchmarks/kv_offload_bench.py --output kv_offload.json      # ~10 minutes
    python benchmarks/kv_offload_bench.py --reanalyze kv_offload.json

Workload: the first `--sessions` conversations of mooncake_conversation.jsonl that come back at
least once (a session is named by its first block after the shared system prompt, hash id 0),
every turn of them in trace order, lengths x `--length-scale` (a 512-token hash block becomes
512 x scale tokens), prompts <= `--max-input-len`, outputs <= `--max-output-len`, Poisson
arrivals at `--rate`. A turn whose prompt repeats at least two blocks of an earlier prompt is a
*returning turn*: its history is the part a cache can serve.

Each configuration is `pdserve serve --model M --cpus 0-1 --num-kv-blocks B` (random
llama-125m by default, float32, colocated, chunked prefill), plus `--kv-offload cpu:SIZE`, or
`--kv-offload disk:DIR:SIZE` (DIR on the machine's disk, not tmpfs), with
`--kv-offload-reload auto` (the measured rule); `dp2` and `dp2+cpu` are two colocated workers
of one core each (`--decode-workers 2`), each with a pool of B blocks, without and with one
host tier shared by both. Reported per configuration: prompt tokens
computed (prompt tokens - cached tokens, from each response's usage) and their share of the
no-tier run, TTFT p50/p90 of returning turns and of all turns, goodput under `--slo`, and the
tiers' own figures from /metrics: hits, bytes and seconds loaded (load bandwidth, checksums
included), the steps' copy time. Machine figures measured in the same run: memcpy bandwidth
(numpy, 256 MiB) and the disk's read speed (`dd iflag=direct` of a 1 GiB file, page cache
bypassed) next to the disk tier's, which on this machine reads through the page cache;
`disk-cold` is the disk tier with its files written back and dropped from the page cache every
0.2 s (a background thread of the benchmark), so that its reads go to the disk.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lib.machine import code_info, machine_info  # noqa: E402
from lib.paths import DEFAULT_125M, TRACE, ensure_125m  # noqa: E402
from lib.quiet import measured  # noqa: E402
from lib.server import Server, metric_sums, send  # noqa: E402

from pdserve.bench.metrics import Slo, latency_stats, summarize  # noqa: E402
from pdserve.bench.tokenizer import HFPromptTokenizer, load_tokenizer  # noqa: E402
from pdserve.bench.traces import read_trace  # noqa: E402
from pdserve.bench.workload import WorkloadConfig, build_prompts, make_specs  # noqa: E402

MOONCAKE = TRACE.parent / "mooncake_conversation.jsonl"


def pick_sessions(rows, num_sessions: int):
    """Rows of the first sessions that come back, in trace order."""
    turns = defaultdict(list)
    for i, r in enumerate(rows):
        if len(r.hash_ids) > 1:
            turns[r.hash_ids[1]].append(i)
    multi = sorted((v for v in turns.values() if len(v) > 1), key=lambda v: v[0])
    chosen = sorted(i for v in multi[:num_sessions] for i in v)
    return [rows[i] for i in chosen]


def returning(specs, block_tokens: int, max_input: int) -> set[int]:
    """Indices of turns that repeat >= 2 blocks (within the clipped prompt) of an earlier one."""
    seen, out = set(), set()
    for s in specs:
        blocks = s.hash_ids[: max_input // block_tokens]
        run = 0
        for j in range(len(blocks)):
            if tuple(blocks[: j + 1]) not in seen:
                break
            run = j + 1
        if run >= 2:
            out.add(s.index)
        seen.update(tuple(blocks[: j + 1]) for j in range(len(blocks)))
    return out


def memcpy_gbps() -> float:
    src = np.ones(256 << 20, dtype=np.uint8)
    dst = np.empty_like(src)
    best = 0.0
    for _ in range(5):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = max(best, src.nbytes / (time.perf_counter() - t0) / 1e9)
    return best


def disk_read_gbps(directory: str) -> float | None:
    """Sequential read of a fresh 1 GiB file with the page cache bypassed (O_DIRECT)."""
    path = os.path.join(directory, "readspeed.bin")
    try:
        subprocess.run(
            ["dd", "if=/dev/urandom", f"of={path}", "bs=4M", "count=256", "conv=fsync"],
            check=True, capture_output=True,
        )  # fmt: skip
        t0 = time.perf_counter()
        subprocess.run(
            ["dd", f"if={path}", "of=/dev/null", "bs=4M", "iflag=direct"],
            check=True, capture_output=True,
        )  # fmt: skip
        return (1 << 30) / (time.perf_counter() - t0) / 1e9
    except (subprocess.CalledProcessError, OSError):
        return None
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)


def tier_figures(metrics: str) -> dict:
    def total(name: str, tier: str | None = None) -> float:
        return sum(
            v
            for k, v in metric_sums(metrics, name).items()
            if tier is None or f'tier="{tier}"' in k
        )

    out = {"prefill_tokens_scheduled": sum(
               v for k, v in metric_sums(metrics, "pdserve_scheduled_tokens_total").items()
               if 'kind="prefill"' in k),
           "copy_s": total("pdserve_kv_offload_copy_seconds"),
           "loaded_blocks": total("pdserve_kv_offload_loaded_blocks"),
           "saved_blocks": total("pdserve_kv_offload_saved_blocks"),
           "dropped_blocks": total("pdserve_kv_offload_dropped_blocks"),
           "swap_ins": total("pdserve_kv_offload_swap_ins"),
           "prefetched_blocks": total("pdserve_kv_offload_prefetched_blocks"),
           "read_on_step_blocks": total("pdserve_kv_offload_read_on_step_blocks"),
           "tiers": {}}  # fmt: skip
    for tier in ("cpu", "disk"):
        loaded = total("pdserve_kv_tier_loaded_bytes", tier)
        seconds = total("pdserve_kv_tier_load_seconds", tier)
        if not total("pdserve_kv_tier_capacity_bytes", tier):
            continue
        out["tiers"][tier] = {
            "hits": total("pdserve_kv_tier_hits", tier),
            "misses": total("pdserve_kv_tier_misses", tier),
            "loaded_bytes": loaded,
            "load_gbps": loaded / seconds / 1e9 if seconds else None,
            "stored_bytes": total("pdserve_kv_tier_stored_bytes", tier),
            "store_gbps": (
                total("pdserve_kv_tier_stored_bytes", tier)
                / max(total("pdserve_kv_tier_store_seconds", tier), 1e-12)
                / 1e9
            ),
        }
    return out


class PageCacheDropper:
    """Keeps a directory's files out of the page cache (`disk-cold`): every 0.2 s each file
    written or read since the last pass (the disk tier refreshes a file's mtime on every hit)
    is written back (fdatasync) and dropped (POSIX_FADV_DONTNEED), so the disk tier reads from
    the disk as on a machine whose memory is busy elsewhere."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.seen: dict[str, int] = {}  # path -> mtime when last dropped
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()

    def _run(self) -> None:
        while not self.stop.wait(0.2):
            for root, _, _ in os.walk(self.directory):
                with contextlib.suppress(OSError), os.scandir(root) as it:
                    for e in it:
                        if not e.name.endswith(".kv"):
                            continue
                        with contextlib.suppress(OSError):
                            mtime = e.stat().st_mtime_ns
                            if self.seen.get(e.path) != mtime:
                                self._drop(e.path)
                                self.seen[e.path] = mtime

    @staticmethod
    def _drop(path: str) -> None:
        with contextlib.suppress(OSError):
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def run_config(name: str, serve_args: list[str], requests, a, back: set[int], workdir: str,
               cold_dir: str | None = None):  # fmt: skip
    log = Path(workdir) / f"{name}.log"

    def go():
        cold = PageCacheDropper(cold_dir) if cold_dir else contextlib.nullcontext()
        with Server(serve_args, log) as srv, cold:
            records = send(requests, srv.base_url, a.model)
            return records, srv.metrics()

    (records, metrics), meta = measured(go, name)
    done = [r for r in records if r.status == "completed"]
    computed = sum(r.num_input_tokens - (r.cached_tokens or 0) for r in done)
    slo = Slo.parse(a.slo)
    summary = summarize(records, slo)
    return {
        "name": name,
        "command": "pdserve serve " + " ".join(serve_args),
        "completed": len(done),
        "failed": summary["failed"],
        "prompt_tokens": sum(r.num_input_tokens for r in done),
        "computed_prompt_tokens": computed,
        "ttft_returning_ms": latency_stats(r.ttft for r in done if r.index in back),
        "ttft_all_ms": summary["ttft_ms"],
        "tpot_ms": summary["tpot_ms"],
        "goodput": summary["goodput"],
        "slo_attainment": summary["slo_attainment"],
        "duration_s": summary["duration_s"],
        "offload": tier_figures(metrics),
        "meta": meta,
    }


def print_report(result: dict) -> None:
    base = result["configs"][0]
    print(f"\n{result['workload']}")
    print(
        "| configuration | prompt tokens computed (server's count) | vs no tier | TTFT p50 / p90 "
        "returning, ms | vs no tier (p50) | TTFT p50 / p90 all, ms | goodput req/s | "
        "SLO attainment |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for c in result["configs"]:
        tr, ta = c["ttft_returning_ms"], c["ttft_all_ms"]
        share = c["computed_prompt_tokens"] / max(base["computed_prompt_tokens"], 1)
        speed = base["ttft_returning_ms"]["p50"] / tr["p50"] if tr["p50"] else float("nan")
        scheduled = c["offload"].get("prefill_tokens_scheduled")
        counted = f" ({scheduled:.0f})" if scheduled else ""
        print(
            f"| {c['name']} | {c['computed_prompt_tokens']}{counted} | {share:.2f}x | "
            f"{tr['p50']:.0f} / {tr['p90']:.0f} | {speed:.2f}x faster | "
            f"{ta['p50']:.0f} / {ta['p90']:.0f} | {c['goodput']:.3f} | {c['slo_attainment']:.0%} |"
        )
    print("\ntiers (from /metrics): load bandwidth includes the CRC-32 check")
    for c in result["configs"]:
        off = c["offload"]
        if not off["tiers"]:
            continue
        parts = [
            f"{t}: {f['hits']:.0f} hits, {f['loaded_bytes'] / 1e6:.0f} MB loaded at "
            f"{f['load_gbps'] or 0:.2f} GB/s, stored at {f['store_gbps']:.2f} GB/s"
            for t, f in off["tiers"].items()
        ]
        print(
            f"  {c['name']}: " + "; ".join(parts) + f"; loaded {off['loaded_blocks']:.0f} blocks, "
            f"saved {off['saved_blocks']:.0f} (dropped {off['dropped_blocks']:.0f}), "
            f"steps' copy time {off['copy_s']:.2f} s, swap-ins {off['swap_ins']:.0f}; "
            f"read ahead {off.get('prefetched_blocks', 0):.0f} blocks, read while scheduling "
            f"{off.get('read_on_step_blocks', 0):.0f}"
        )
    m = result["machine_io"]
    disk = m["disk_read_gbps"]
    print(
        f"\nmachine, same run: memcpy {m['memcpy_gbps']:.1f} GB/s; disk read (O_DIRECT) "
        + (f"{disk:.2f} GB/s" if disk else "unmeasured")
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=str(DEFAULT_125M))
    ap.add_argument("--sessions", type=int, default=24)
    ap.add_argument("--length-scale", type=float, default=1 / 16)
    ap.add_argument("--max-input-len", type=int, default=1024)
    ap.add_argument("--max-output-len", type=int, default=32)
    ap.add_argument("--rate", type=float, default=0.5, help="requests/s (Poisson)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-kv-blocks", type=int, default=256, help="the too-small pool")
    ap.add_argument("--unlimited-blocks", type=int, default=8192, help="the unlimited-pool config")
    ap.add_argument("--cpu-tier", default="2GiB")
    ap.add_argument("--disk-tier", default="4GiB")
    ap.add_argument("--disk-dir", default=None, help="default: a new directory under /var/tmp")
    ap.add_argument("--slo", default="ttft_ms=2000,tpot_ms=200")
    ap.add_argument("--configs", default="none,cpu,disk")
    ap.add_argument("--output", default=None)
    ap.add_argument("--reanalyze", default=None)
    a = ap.parse_args()
    if a.reanalyze:
        print_report(json.loads(Path(a.reanalyze).read_text()))
        return
    a.model = ensure_125m(Path(a.model)) if a.model == str(DEFAULT_125M) else a.model

    wl = WorkloadConfig(
        length_scale=a.length_scale, max_input_len=a.max_input_len,
        max_output_len=a.max_output_len, request_rate=a.rate, seed=a.seed,
    )  # fmt: skip
    rows = pick_sessions(read_trace(MOONCAKE), a.sessions)
    specs = make_specs(wl, rows)
    tok = HFPromptTokenizer(load_tokenizer(a.model), chat=False)
    requests = build_prompts(specs, tok, a.seed, block_tokens=wl.block_tokens)
    back = returning(specs, wl.block_tokens, a.max_input_len)
    workload = (
        f"Mooncake conversation trace: {a.sessions} sessions, {len(requests)} turns "
        f"({len(back)} returning), lengths x {a.length_scale:g} (prompts <= {a.max_input_len}, "
        f"outputs <= {a.max_output_len}), Poisson {a.rate:g} req/s; KV pool "
        f"{a.num_kv_blocks} blocks of 16 tokens; SLO {Slo.parse(a.slo).describe()}"
    )
    print(workload, flush=True)

    disk_root = a.disk_dir or tempfile.mkdtemp(prefix="pdserve-kvbench-", dir="/var/tmp")
    base = ["--model", a.model, "--num-kv-blocks", str(a.num_kv_blocks)]
    one = ["--cpus", "0-1"]  # one colocated worker on both cores
    two = ["--decode-workers", "2", "--decode-cpus", "0", "--decode-cpus", "1"]
    configs = {
        "none": one,
        # no tier, and a pool that holds every prompt of the run: what a cache can save at most
        "unlimited-pool": [*one, "--num-kv-blocks", str(a.unlimited_blocks)],
        "cpu": [*one, "--kv-offload", f"cpu:{a.cpu_tier}"],
        "disk": [*one, "--kv-offload", f"disk:{disk_root}/kv:{a.disk_tier}"],
        # the disk tier with its files kept out of the page cache (see PageCacheDropper)
        "disk-cold": [*one, "--kv-offload", f"disk:{disk_root}/kv:{a.disk_tier}"],
        "cpu+disk": [*one, "--kv-offload", "cpu:64MiB", "--kv-offload", f"disk:{disk_root}/kv:{a.disk_tier}"],
        # two colocated workers of one core each, each with a pool of the size above, behind
        # the router; with the tier, one host arena for both
        "dp2": two,
        "dp2+cpu": [*two, "--kv-offload", f"cpu:{a.cpu_tier}"],
    }  # fmt: skip
    machine_io = {"memcpy_gbps": memcpy_gbps(), "disk_read_gbps": disk_read_gbps(disk_root)}
    results = []
    with tempfile.TemporaryDirectory(prefix="kvbench-") as work:
        for name in a.configs.split(","):
            shutil.rmtree(f"{disk_root}/kv", ignore_errors=True)  # every run starts cold
            print(f"  {name} ...", flush=True)
            cold = f"{disk_root}/kv" if name == "disk-cold" else None
            results.append(run_config(name, base + configs[name], requests, a, back, work, cold))
    if a.disk_dir is None:
        shutil.rmtree(disk_root, ignore_errors=True)
    result = {
        "workload": workload,
        "configs": results,
        "machine_io": machine_io,
        "machine": machine_info(),
        "code": code_info(),
    }
    print_report(result)
    if a.output:
        Path(a.output).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
