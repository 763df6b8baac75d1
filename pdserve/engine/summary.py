"""Per-phase summary of a finished batch: TTFT, prefill and decode throughput, ITL percentiles,
and MFU / MBU from the engine's step statistics."""

from __future__ import annotations

from pdserve.engine.stats import StepStatsRecorder
from pdserve.types import RequestOutput


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in [0, 100]); None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(outputs: list[RequestOutput], stats: StepStatsRecorder) -> dict:
    metrics = [c.metrics for o in outputs for c in o.outputs if c.metrics is not None]
    ttfts = [m.ttft for m in metrics if m.ttft is not None]
    itls = [x for m in metrics for x in m.itl]
    prefill = [stats.totals[p] for p in ("prefill", "mixed") if p in stats.totals]
    prefill_tokens = sum(m.num_prompt_tokens - m.num_cached_tokens for m in metrics)
    prefill_time = sum(t.time_s for t in prefill)
    decode_tokens = sum(max(len(m.token_times) - 1, 0) for m in metrics)
    decode_time = sum(
        (m.finished_time - m.first_token_time)
        for m in metrics
        if m.finished_time is not None and m.first_token_time is not None
    )
    # Decode tokens/s of the whole batch: tokens after the first over the span of decoding.
    firsts = [m.first_token_time for m in metrics if m.first_token_time is not None]
    ends = [m.finished_time for m in metrics if m.finished_time is not None]
    span = (max(ends) - min(firsts)) if firsts and ends else 0.0
    prefill_mfu, _ = stats.phase_mfu_mbu("prefill")
    _, decode_mbu = stats.phase_mfu_mbu("decode")
    decode = stats.totals.get("decode")
    mb = stats.shape.matmul_bytes_per_param
    return {
        "num_requests": len(outputs),
        "ttft_mean_s": sum(ttfts) / len(ttfts) if ttfts else None,
        "ttft_p99_s": percentile(ttfts, 99),
        "prefill_tokens": prefill_tokens,
        "prefill_time_s": prefill_time,
        "prefill_tokens_per_s": prefill_tokens / prefill_time if prefill_time else 0.0,
        "decode_tokens": decode_tokens,
        "decode_time_s": decode_time,
        "decode_tokens_per_s": decode_tokens / span if span > 0 else 0.0,
        "itl_p50_s": percentile(itls, 50),
        "itl_p99_s": percentile(itls, 99),
        "prefix_hit_rate": (
            sum(m.num_cached_tokens for m in metrics) / sum(m.num_prompt_tokens for m in metrics)
            if metrics
            else 0.0
        ),
        "prefill_mfu": prefill_mfu,
        "decode_mbu": decode_mbu,
        # what one decode step reads (weights as stored, KV), the mean over the batch's steps
        "decode_bytes_per_step": decode.bytes / decode.steps if decode and decode.steps else None,
        "weights": f"{mb:.3f} bytes per matrix weight"
        if mb
        else f"{stats.shape.dtype_bytes} bytes per weight",
    }
