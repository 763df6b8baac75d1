"""`pdserve generate`: run prompts offline and print the text and a per-phase timing summary."""

from __future__ import annotations

import argparse
import json
import sys

from pdserve.commands.engine_args import add_engine_arguments, engine_args_from

HELP = "generate text offline and print a per-phase timing summary"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt", action="append", help="prompt text (repeat for a batch)")
    p.add_argument("--prompt-ids", help="a prompt as comma-separated token ids, e.g. 1,403")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--sampling-seed", type=int, help="per-request sampling seed")
    p.add_argument("--n", type=int, default=1, help="completions per prompt")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--json", action="store_true", help="print results and timings as JSON")
    add_engine_arguments(p)


def run(args: argparse.Namespace) -> int:
    engine_args = engine_args_from(args)  # a bad option fails before the slow imports

    from pdserve.engine.llm import LLM
    from pdserve.engine.summary import summarize
    from pdserve.types import SamplingParams

    prompts: list = list(args.prompt or [])
    if args.prompt_ids:
        try:
            prompts.append([int(t) for t in args.prompt_ids.split(",")])
        except ValueError:
            raise ValueError(
                f"invalid --prompt-ids={args.prompt_ids!r}: expected e.g. 1,403,407"
            ) from None
    if not prompts:
        raise ValueError("give at least one --prompt or --prompt-ids")
    params = SamplingParams(
        n=args.n,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.sampling_seed,
        max_tokens=args.max_tokens,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
    )
    llm = LLM.from_engine_args(engine_args)
    outputs = llm.generate(prompts, params)
    summary = summarize(outputs, llm.engine.core.stats)
    if args.json:
        texts = [[c.text for c in o.outputs] for o in outputs]
        json.dump({"outputs": texts, "summary": summary}, sys.stdout, indent=2)
        print()
        return 0
    for o in outputs:
        for c in o.outputs:
            label = f"[{o.request_id}" + (f" #{c.index}]" if len(o.outputs) > 1 else "]")
            print(f"{label} {o.prompt if o.prompt is not None else o.prompt_token_ids}")
            print(c.text)
            print(f"  ({len(c.token_ids)} tokens, finish_reason={c.finish_reason})\n")
    print_summary(summary)
    return 0


def print_summary(s: dict) -> None:
    def ms(x):
        return "-" if x is None else f"{x * 1e3:.1f} ms"

    def pct(x):
        return "-" if x is None else f"{x:.1%}"

    print("per-phase summary")
    print(f"  requests            {s['num_requests']}")
    print(f"  TTFT mean / p99     {ms(s['ttft_mean_s'])} / {ms(s['ttft_p99_s'])}")
    print(
        f"  prefill             {s['prefill_tokens']} tokens, {s['prefill_tokens_per_s']:.1f} tokens/s"
        f"  (MFU {pct(s['prefill_mfu'])})"
    )
    print(
        f"  decode              {s['decode_tokens']} tokens, {s['decode_tokens_per_s']:.1f} tokens/s"
        f"  (MBU {pct(s['decode_mbu'])})"
    )
    if s.get("decode_bytes_per_step"):
        print(f"  bytes per decode step {s['decode_bytes_per_step'] / 2**20:.1f} MiB "
              f"(weights {s['weights']})")  # fmt: skip
    print(f"  ITL p50 / p99       {ms(s['itl_p50_s'])} / {ms(s['itl_p99_s'])}")
    print(f"  prefix cache hits   {pct(s['prefix_hit_rate'])}")
    if s["prefill_mfu"] is None:
        print("  (MFU/MBU need a hardware profile: run `pdserve profile-hardware` once)")
