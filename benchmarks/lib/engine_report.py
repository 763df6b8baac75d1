"""engine_bench.py's report: the (metric, value, comparison) table, the targets and the summary."""

from __future__ import annotations

from typing import Any

from lib.quiet import Quiet
from lib.tables import print_rows

TARGET_DECODE_ROOFLINE = 0.60
TARGET_PREFILL_512_MFU = 0.50
TARGET_OFFLINE_VS_HF = 2.0
REF_LLAMA_CPP_ROOFLINE = 0.90
REF_HF_ROOFLINE = 0.35


def _noisy(d: dict[str, Any]) -> str:
    cores = d.get("foreign_cores", 0.0)
    return f" [disturbed: {cores:.2f} cores]" if cores >= Quiet.threshold else ""


def build_table(r: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(metric, value, comparison) rows."""
    roof, rows = r["roofline"], []
    peak, bw = roof["gemm_flops_s"], roof["read_bytes_s"]
    rows.append(("fp32 GEMM peak (torch.mm)", f"{peak / 1e9:.1f} GFLOP/s", "best square matmul"))
    rows.append(("read bandwidth", f"{bw / 1e9:.1f} GB/s", "x.sum() over 512 MiB"))
    rows.append(("copy bandwidth (r+w)", f"{roof['copy_bytes_s'] / 1e9:.1f} GB/s", ""))
    for label, key in (("torch F.linear", ""), ("oneDNN prepacked", "onednn_")):
        if roof.get(f"{key}linear_512_flops_s") is None:
            continue
        flops_s, bytes_s = roof[f"{key}linear_512_flops_s"], roof[f"{key}gemv_bytes_s"]
        rows.append(
            (
                f"{label}, layer weights, 512 rows",
                f"{flops_s / 1e9:.1f} GFLOP/s",
                f"{flops_s / peak:.0%} of GEMM peak",
            )
        )
        rows.append(
            (
                f"{label}, all weights, 1 row",
                f"{bytes_s / 1e9:.1f} GB/s",
                f"{bytes_s / bw:.0%} of read bandwidth",
            )
        )
    for n, p in r["prefill"].items():
        target = f" (target {TARGET_PREFILL_512_MFU:.0%})" if n == 512 else ""
        rows.append(
            (
                f"prefill {n} tokens",
                f"{p['tokens_s']:.0f} tok/s",
                f"{p['flops_s'] / 1e9:.1f} GFLOP/s = {p['mfu']:.0%} of GEMM peak{target}{_noisy(p)}",
            )
        )
    dec = r["decode"]
    for batch, d in dec.items():
        note = ""
        if batch == 1:
            low, high = min(d["read_bytes_s_samples"]), max(d["read_bytes_s_samples"])
            note = (
                f"{d['roofline_fraction']:.0%} of roofline {d['roofline_tokens_s']:.1f} tok/s "
                f"at {d['read_bytes_s'] / 1e9:.1f} GB/s (samples {low / 1e9:.0f}-"
                f"{high / 1e9:.0f} GB/s; target {TARGET_DECODE_ROOFLINE:.0%}, "
                f"llama.cpp ~{REF_LLAMA_CPP_ROOFLINE:.0%}, HF ~{REF_HF_ROOFLINE:.0%})"
            )
        rows.append((f"decode batch {batch}", f"{d['tokens_s']:.1f} tok/s", note + _noisy(d)))
    h = r["hf_decode"]
    rows.append(
        (
            "HF generate decode batch 1",
            f"{h['tokens_s']:.1f} tok/s",
            f"{h['tokens_s'] / dec[1]['roofline_tokens_s']:.0%} of roofline; "
            f"pdserve/HF = {dec[1]['tokens_s'] / h['tokens_s']:.2f}x{_noisy(h)}",
        )
    )
    off = r["offline"]
    p = off["pdserve"]
    rows.append(
        (
            f"offline pdserve ({off['num_requests']} req)",
            f"{p['output_tokens_s']:.1f} out tok/s",
            f"{p['requests_s']:.2f} req/s{_noisy(p)}",
        )
    )
    split = p["breakdown_s"]
    host = sum(v for k, v in split.items() if k not in ("forward", "logits", "sample"))
    rows.append(
        (
            "offline pdserve time split",
            f"{split['forward'] / p['wall_s']:.0%} forward",
            f"logits {split['logits'] / p['wall_s']:.0%}, sampling "
            f"{split['sample'] / p['wall_s']:.1%}, host (schedule, prepare, update, detokenize, "
            f"stats) {host / p['wall_s']:.1%}; {p['steps']} steps",
        )
    )
    for batch, h in off["hf"].items():
        rows.append(
            (
                f"offline HF generate batch {batch}",
                f"{h['output_tokens_s']:.1f} out tok/s",
                f"{h['requests_s']:.2f} req/s{_noisy(h)}",
            )
        )
    rows.append(
        (
            "offline pdserve / HF best",
            f"{off['ratio_vs_hf_best']:.2f}x",
            f"HF best at batch {off['hf_best_batch']} (target {TARGET_OFFLINE_VS_HF:.1f}x)",
        )
    )
    o = r["overhead"]
    us = o["median_us"]
    rows.append(
        (
            f"host time/step, {o['num_seqs']} decoding seqs",
            f"{o['schedule_prepare_update_us']:.0f} us",
            f"schedule {us['schedule']:.0f} + prepare {us['prepare']:.0f} + update "
            f"{us['update']:.0f} us of a {us['core_step'] / 1e3:.1f} ms step "
            f"({o['host_fraction_of_step']:.1%}){_noisy(o)}",
        )
    )
    return rows


def targets(r: dict[str, Any]) -> dict[str, dict[str, Any]]:
    got = {
        "decode_b1_roofline_fraction": (
            r["decode"][1]["roofline_fraction"],
            TARGET_DECODE_ROOFLINE,
        ),
        "prefill_512_gemm_fraction": (
            r["prefill"][512]["mfu"] if 512 in r["prefill"] else float("nan"),
            TARGET_PREFILL_512_MFU,
        ),
        "offline_vs_hf_best": (r["offline"]["ratio_vs_hf_best"], TARGET_OFFLINE_VS_HF),
    }
    return {k: {"measured": v, "target": t, "met": v >= t} for k, (v, t) in got.items()}


def report(r: dict[str, Any]) -> None:
    print()
    print_rows(r["table"])
    print()
    for name, t in r["targets"].items():
        status = "met" if t["met"] else f"missed ({t['measured'] / t['target']:.0%} of target)"
        print(f"target {name}: {t['measured']:.2f} vs {t['target']:.2f}: {status}")
    disturbed = [m for m in r["measurements"] if m["foreign_cores"] >= Quiet.threshold]
    print(
        f"{len(r['measurements'])} measurements, {len(disturbed)} disturbed by other processes "
        f"(retried where patience allowed); {r['wall_s']:.0f} s in all"
    )
