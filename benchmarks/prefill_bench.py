"""Prefill-heavy steps and their page faults, for one or two checkouts in fresh processes.

    python benchmarks/prefill_bench.py [--other CHECKOUT] [--rounds 4]     # ~1 min per round

The load of `peers_bench.py` run in one process: 32 requests of the Azure conversation trace
with lengths / 8 (3,325 prompt and 377 output tokens), all queued at once, outputs forced to
their length, greedy, on the random llama-125m in float32 with 2 threads and the prefix cache
off: two prefill steps of 2,048 and ~1,300 tokens (decodes riding along), then ~20 decode steps.
Each process starts an engine and runs the load three times in a row; the first load is the
one a freshly started server gets. Per load: the wall time, the two prefill steps' times, and
the minor page faults (`getrusage`) the process took during them. With `--other`, the two
checkouts alternate, in fresh processes, `--rounds` times each (which goes first alternates
too), so a shared machine's swings fall on both.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(1, str(HERE))

from lib import checkouts  # noqa: E402
from lib.paths import DEFAULT_125M, TRACE, ensure_125m  # noqa: E402

LOADS = 3
WORKLOAD = dict(num_requests=32, length_scale=0.125, max_input_len=1536, max_output_len=384,
                request_rate=float("inf"), seed=0)  # fmt: skip


def child(checkout: str, model: str) -> None:
    """Runs in a fresh process with `checkout` first on the path; prints one JSON line."""
    sys.path.insert(0, checkout)
    import numpy as np

    from pdserve import LLM, SamplingParams
    from pdserve.bench.traces import read_trace
    from pdserve.bench.workload import WorkloadConfig, make_specs

    specs = make_specs(WorkloadConfig(**WORKLOAD), read_trace(TRACE))
    llm = LLM(model, num_threads=2, enable_prefix_caching=False)
    core = llm.engine.core
    rng = np.random.default_rng(0)
    loads = []
    for load in range(LOADS):
        for s in specs:
            prompt = rng.integers(4, 32000, s.input_len).tolist()
            params = SamplingParams(temperature=0, max_tokens=s.output_len, ignore_eos=True)
            core.add_request(core.make_request(f"{load}-{s.index}", prompt, params))
        steps, t0 = [], time.perf_counter()
        while core.has_unfinished:
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            t = time.perf_counter()
            core.step()
            steps.append((time.perf_counter() - t,
                          resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults))  # fmt: skip
        loads.append({"seconds": time.perf_counter() - t0,
                      "prefill_steps_s": [round(t, 4) for t, _ in steps[:2]],
                      "prefill_faults": sum(f for _, f in steps[:2]),
                      "other_faults": sum(f for _, f in steps[2:])})  # fmt: skip
    print(json.dumps({"checkout": checkout, "loads": loads}))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    checkouts.add_arguments(p, rounds=4, model_dir=DEFAULT_125M)
    args = p.parse_args()
    if args.child:
        child(args.child, str(args.model_dir))
        return 0
    model = ensure_125m(args.model_dir)
    runs: dict[str, list[dict]] = {c: [] for c in checkouts.checkouts(args.other)}
    for r, c in checkouts.alternated(list(runs), args.rounds):
        res = checkouts.run_child(__file__, c, model)
        runs[c].append(res)
        print(f"round {r} {c}: " + " | ".join(
            f"{x['seconds']:.2f} s (prefill {'+'.join(f'{t:.2f}' for t in x['prefill_steps_s'])}"
            f" s, {x['prefill_faults']} faults)" for x in res["loads"]), flush=True)  # fmt: skip
    print("\nmedians over rounds: load 1 (first after start) | loads 2-3")
    for c, rs in runs.items():
        first = [x["loads"][0] for x in rs]
        later = [y for x in rs for y in x["loads"][1:]]

        def med(xs, key):
            return statistics.median(key(x) for x in xs)

        print(f"{c}: {med(first, lambda x: x['seconds']):.2f} s, prefill "
              f"{med(first, lambda x: sum(x['prefill_steps_s'])):.2f} s, "
              f"{med(first, lambda x: x['prefill_faults']):.0f} faults | "
              f"{med(later, lambda x: x['seconds']):.2f} s, prefill "
              f"{med(later, lambda x: sum(x['prefill_steps_s'])):.2f} s, "
              f"{med(later, lambda x: x['prefill_faults']):.0f} faults")  # fmt: skip
    if args.output:
        args.output.write_text(json.dumps(runs, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
