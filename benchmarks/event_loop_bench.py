"""Does one huge request stall everyone else? /health latency while 10 MB prompts are tokenized.

    python benchmarks/event_loop_bench.py [--model DIR] [--prompt-mb 10] [--big-requests 2]

Starts `pdserve serve` (stories260K by default) and polls GET /health every 20 ms:
1. alone, for a baseline;
2. while `--big-requests` concurrent completions each send a `--prompt-mb` MB prompt with
   `truncate_prompt_tokens` (so the server must tokenize all of it), and one small completion
   per second measures what an ordinary request sees meanwhile.
Reports p50 / p99 / max of the /health latency in both phases, the small requests' latency, and
how long the big requests took. The frontend tokenizes off its event loop, so /health should
stay far below the 100 ms target while the tokenizer threads work.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "e2e"))
from server_harness import start_server  # noqa: E402

STORIES = Path(__file__).resolve().parent.parent.parent / "shared" / "models" / "stories260K"


def poll_health(url: str, stop: threading.Event) -> list[float]:
    latencies = []
    with httpx.Client(timeout=60) as client:
        while not stop.is_set():
            t0 = time.perf_counter()
            client.get(url + "/health").raise_for_status()
            latencies.append(time.perf_counter() - t0)
            time.sleep(0.02)
    return latencies


def stats_ms(xs: list[float]) -> dict:
    a = np.asarray(xs) * 1e3
    return {
        "count": len(a),
        "p50_ms": round(float(np.percentile(a, 50)), 2),
        "p99_ms": round(float(np.percentile(a, 99)), 2),
        "max_ms": round(float(a.max()), 2),
    }


def phase(url: str, seconds: float | None, work=None) -> tuple[list[float], object]:
    stop = threading.Event()
    box: dict = {}
    t = threading.Thread(target=lambda: box.update(lat=poll_health(url, stop)))
    t.start()
    result = None
    if work is None:
        time.sleep(seconds)
    else:
        result = work()
    stop.set()
    t.join()
    return box["lat"], result


def big_requests(url: str, prompt_mb: float, count: int) -> dict:
    prompt = "Once upon a time " * int(prompt_mb * 1e6 / 17)
    # Serialized once, up front: encoding 10 MB of JSON here would stall this process's own
    # /health poller and count against the server.
    body = json.dumps({"prompt": prompt, "max_tokens": 1, "truncate_prompt_tokens": 8}).encode()
    headers = {"content-type": "application/json"}
    done: list[float] = []
    small: list[float] = []

    def one():
        t0 = time.perf_counter()
        r = httpx.post(url + "/v1/completions", content=body, headers=headers, timeout=600)
        r.raise_for_status()
        done.append(time.perf_counter() - t0)

    threads = [threading.Thread(target=one) for _ in range(count)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        t0 = time.perf_counter()
        r = httpx.post(
            url + "/v1/completions",
            json={"prompt": "Tim had a", "max_tokens": 8, "temperature": 0},
            timeout=600,
        )
        r.raise_for_status()
        small.append(time.perf_counter() - t0)
        time.sleep(1.0)
    for t in threads:
        t.join()
    return {"big_request_s": [round(x, 2) for x in done], "small_request": stats_ms(small)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(STORIES))
    p.add_argument("--prompt-mb", type=float, default=10.0)
    p.add_argument("--big-requests", type=int, default=2)
    p.add_argument("--output", help="write the results as JSON here")
    a = p.parse_args()
    server = start_server(a.model, timeout_s=300)
    try:
        baseline, _ = phase(server.url, 5.0)
        loaded, big = phase(
            server.url, None, lambda: big_requests(server.url, a.prompt_mb, a.big_requests)
        )
    finally:
        server.stop()
    out = {
        "model": a.model,
        "prompt_mb": a.prompt_mb,
        "big_requests": a.big_requests,
        "health_idle": stats_ms(baseline),
        "health_during_big_prompts": stats_ms(loaded),
        **big,
    }
    print(json.dumps(out, indent=2))
    if a.output:
        Path(a.output).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
