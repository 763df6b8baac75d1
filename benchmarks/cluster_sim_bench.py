"""At cluster scale, by simulation: does disaggregation raise goodput under tight SLOs (DistServe),
and does the best P:D ratio follow the workload (Splitwise)?

    python benchmarks/cluster_sim_bench.py --devices 8,16 --output cluster.json   # ~60 minutes

No model runs: an analytic profile of one H100 per worker (`pdserve profile --analytic H100`:
datasheet peaks at 50% MFU / 70% MBU, 3 ms per step, KV over NVLink) for Llama-3.1-8B shapes
(bfloat16, a config.json only), and the real traces' first `--num-requests` requests at their
own arrival times and lengths (prompts clipped to `--max-model-len`):

  conv      azure_conv_2023.csv       (input p50 1020, output p50 129)
  code      azure_code_2023.csv       (input p50 1469, output p50 13: prefill-heavy)
  mooncake  mooncake_conversation.jsonl (input p50 6909, output p50 350, shared prefixes)

Deployments of N devices (one GPU per worker, 60 GiB of KV each, 256 sequences): N colocated
workers behind the router with chunked prefill at a 512 and a 2048 token budget, and static
P:D splits (`--splits`: the prefill share of the devices). Each one's goodput is the planner's
(`planner/plan.py`): the highest arrival rate (the trace's rate times a scale found by
bisection) at which `--target` of the requests meet the SLO, with the arrivals spanning at
least `--min-span-s` (sped up further, 600 requests are one burst); reported per device, with
">=" where the cap was reached (a lower bound).

SLOs per workload, two levels stated before the run, as multiples of what one request alone
takes on one H100 in this profile (its TTFT at the workload's p90 prompt, so that 90% of the
requests can meet a multiple of it; its TPOT at batch 1 and the median prompt): tight = 1.5x
both, loose = 5x both. DistServe's claim is about tight SLOs; under loose ones colocation may
win.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lib.paths import TRACE  # noqa: E402

from pdserve.bench.metrics import Slo  # noqa: E402
from pdserve.bench.traces import read_trace  # noqa: E402
from pdserve.bench.workload import WorkloadConfig, make_specs  # noqa: E402
from pdserve.config import DisaggConfig, EngineArgs  # noqa: E402
from pdserve.planner.plan import Candidate, rank  # noqa: E402
from pdserve.planner.profile import analytic_profile  # noqa: E402
from pdserve.planner.step_model import StepShape  # noqa: E402

LLAMA_31_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "_name_or_path": "Llama-3.1-8B",
    "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256,
    "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "max_position_embeddings": 131072,
}  # fmt: skip
TRACES = {
    "conv": TRACE,
    "code": TRACE.parent / "azure_code_2023.csv",
    "mooncake": TRACE.parent / "mooncake_conversation.jsonl",
}
KV_PER_GPU = "60GiB"  # an 80 GB H100 less 16 GB of bf16 weights and room for activations
MAX_SEQS = 256


def model_folder(max_model_len: int) -> str:
    d = Path(tempfile.mkdtemp(prefix="cluster-sim-"))
    cfg = dict(LLAMA_31_8B, max_position_embeddings=max_model_len)
    (d / "config.json").write_text(json.dumps(cfg))
    return str(d)


def slos(profile, specs) -> dict[str, Slo]:
    """Tight and loose SLOs from one request alone: the TTFT of the workload's p90 prompt (so
    that 90% of the requests can meet a multiple of it), the TPOT at batch 1."""
    model = profile.step_model(1)
    lengths = sorted(s.input_len for s in specs)
    p90 = lengths[int(0.9 * (len(lengths) - 1))]
    ttft = model.predict(StepShape.of([p90], [p90], 1))
    tpot = model.predict(StepShape.of([1], [lengths[len(lengths) // 2] + 64], 1))
    return {
        "tight": Slo(ttft_ms=round(1.5 * ttft * 1e3, 1), tpot_ms=round(1.5 * tpot * 1e3, 1)),
        "loose": Slo(ttft_ms=round(5 * ttft * 1e3, 1), tpot_ms=round(5 * tpot * 1e3, 1)),
    }


def candidates(model: str, devices: int, splits: list[float]) -> list[Candidate]:
    base = EngineArgs(model=model, kv_cache_memory=KV_PER_GPU, max_num_seqs=MAX_SEQS)
    out = []
    for chunk in (512, 2048):
        engine = replace(base, max_num_batched_tokens=chunk)
        disagg = DisaggConfig(num_decode_workers=devices)
        out.append(Candidate(f"{devices} colocated (chunk {chunk})", engine, disagg, 1, devices))
    engine = replace(base, max_num_batched_tokens=8192)
    for p in sorted({max(1, min(devices - 1, round(f * devices))) for f in splits}):
        disagg = DisaggConfig(num_prefill_workers=p, num_decode_workers=devices - p)
        out.append(Candidate(f"{p}P+{devices - p}D", engine, disagg, 1, devices))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--devices", default="8,16")
    p.add_argument("--workloads", default="conv,code,mooncake")
    p.add_argument("--num-requests", type=int, default=600)
    p.add_argument("--max-model-len", type=int, default=32768)
    p.add_argument("--splits", default="0.25,0.5,0.75")
    p.add_argument("--target", type=float, default=0.9)
    p.add_argument("--min-span-s", type=float, default=20.0,
                   help="arrivals span at least this long at any tried rate (20)")  # fmt: skip
    p.add_argument("--output")
    a = p.parse_args()
    model = model_folder(a.max_model_len)
    profile = analytic_profile(LLAMA_31_8B, "H100")
    print("profile:", profile.description, "|", profile.notes[0])
    splits = [float(x) for x in a.splits.split(",")]
    results = []
    for wname in a.workloads.split(","):
        wl = WorkloadConfig(num_requests=a.num_requests, max_input_len=a.max_model_len - 1024)
        specs = make_specs(wl, read_trace(TRACES[wname]))
        for level, slo in slos(profile, specs).items():
            for n in [int(x) for x in a.devices.split(",")]:
                t0 = time.perf_counter()
                ranked = rank(profile, specs, slo, candidates(model, n, splits),
                              max_model_len=a.max_model_len, target=a.target, high=256.0,
                              min_span_s=a.min_span_s)  # fmt: skip
                wall = time.perf_counter() - t0
                rows = [{"name": r.candidate.name, "goodput": r.goodput,
                         "per_device": r.per_device,
                         "prefill_workers": r.candidate.disagg.num_prefill_workers,
                         "capped": r.capped}
                        for r in ranked]  # fmt: skip
                entry = {"workload": wname, "slo_level": level, "slo": slo.describe(),
                         "devices": n, "ranking": rows, "wall_s": wall}  # fmt: skip
                results.append(entry)
                report(entry)
    summary(results)
    if a.output:
        Path(a.output).write_text(json.dumps({"profile": profile.to_dict(), "results": results},
                                             indent=1))  # fmt: skip
        print(f"wrote {a.output}")


def best(rows, disaggregated: bool):
    chosen = [r for r in rows if bool(r["prefill_workers"]) == disaggregated]
    return max(chosen, key=lambda r: r["per_device"]) if chosen else None


def cell(row) -> str:
    """A candidate's goodput per device, '>=' when it met the target at the highest rate."""
    return f"{row['name']}: {'>=' if row.get('capped') else ''}{row['per_device']:.3f}"


def report(e: dict) -> None:
    colo, dis = best(e["ranking"], False), best(e["ranking"], True)
    ratio = dis["per_device"] / colo["per_device"] if colo["per_device"] else float("inf")
    print(
        f"{e['workload']:8} {e['slo_level']:5} ({e['slo']}) {e['devices']:2} devices: best "
        f"colocated {cell(colo)} req/s/device, best split {cell(dis)} ({ratio:.2f}x); "
        f"{e['wall_s']:.0f} s",
        flush=True,
    )


def summary(results: list[dict]) -> None:
    print(
        "\n| workload | SLO | devices | best colocated (req/s/device) | best P:D split | split / colocated |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for e in results:
        colo, dis = best(e["ranking"], False), best(e["ranking"], True)
        ratio = dis["per_device"] / colo["per_device"] if colo["per_device"] else float("inf")
        print(
            f"| {e['workload']} | {e['slo_level']} ({e['slo']}) | {e['devices']} | {cell(colo)} "
            f"| {cell(dis)} | {ratio:.2f}x |"
        )


if __name__ == "__main__":
    main()
