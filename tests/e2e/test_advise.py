"""`pdserve advise` on real runs of stories260K made prefill-bound (long prompts arriving at
once, one-token answers, a tight TTFT target) and decode-bound (short prompts, long answers, a
TPOT target below what a batch of 64 decodes in): from a saved bench JSON with the server's
scrapes, and live from a server under load."""

from __future__ import annotations

import json
import threading

import pytest

from pdserve.cli import main


def bench(server, tmp_path, name, *flags) -> str:
    out = tmp_path / f"{name}.json"
    argv = ["bench", "--base-url", server.url, "--request-rate", "inf",
            "--output", str(out), *flags]  # fmt: skip
    assert main(argv) == 0
    assert json.loads(out.read_text())["server_metrics"]["after"]["text"]  # scrapes saved
    return str(out)


def advise_json(capsys, *argv) -> dict:
    capsys.readouterr()
    assert main(["advise", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.mark.slow  # 15 s with its server
def test_a_prefill_bound_run_is_called_prefill_bound(server, tmp_path, capsys, stories_path):
    run = bench(server, tmp_path, "prefill", "--num-requests", "64", "--input-len", "480",
                "--output-len", "2", "--slo", "ttft_ms=100,tpot_ms=2000")  # fmt: skip
    v = advise_json(capsys, "--bench", run)
    assert v["bound"] == "prefill", v
    assert "against 100 ms" in v["summary"]
    text = " ".join(v["evidence"])
    assert "64 requests finished" in text and "prefill" in text
    assert any("--decode-workers 2" in a for a in v["actions"])
    # with a profile, the planner ranks deployments of 2 devices for the same requests
    prof = tmp_path / "h100.json"
    model = str(stories_path)
    assert main(["profile", "--model", model, "--analytic", "H100", "--output", str(prof)]) == 0
    v = advise_json(capsys, "--bench", run, "--sim-profile", str(prof), "--model", model,
                    "--devices", "2")  # fmt: skip
    assert len(v["plan"]) == 3 and all(row["goodput"] > 0 for row in v["plan"])
    assert len({row["name"] for row in v["plan"]}) == 3
    server.wait_idle()


@pytest.mark.slow  # seconds of its own: the default run stays short
def test_a_decode_bound_run_is_called_decode_bound(server, tmp_path, capsys):
    run = bench(server, tmp_path, "decode", "--num-requests", "64", "--input-len", "8",
                "--output-len", "150", "--slo", "ttft_ms=60000,tpot_ms=2")  # fmt: skip
    v = advise_json(capsys, "--bench", run)
    assert v["bound"] == "decode", v
    assert "against 2 ms" in v["summary"] and "decode batches of" in v["summary"]
    assert any("--max-num-seqs" in a for a in v["actions"])
    # the same run judged against a generous TPOT target is within its SLO
    assert advise_json(capsys, "--bench", run, "--slo", "ttft_ms=60000,tpot_ms=5000")["bound"] in (
        "balanced",
        "under-loaded",
    )
    server.wait_idle()


def test_a_file_that_is_not_a_bench_run_is_a_clear_error(tmp_path, capsys):
    bad = tmp_path / "x.json"
    bad.write_text("{}")
    assert main(["advise", "--bench", str(bad)]) == 2
    assert "no run in it" in capsys.readouterr().err
    assert main(["advise"]) == 2
    assert "one of --url and --bench" in capsys.readouterr().err


@pytest.mark.slow
def test_live_advice_reads_the_server_while_it_runs(server, capsys):
    import httpx

    stop = threading.Event()

    def load():  # decode-heavy: short prompts, long answers, 48 at a time
        body = {"model": "stories", "prompt": "Once", "max_tokens": 200, "ignore_eos": True}
        with httpx.Client(timeout=120) as client:
            while not stop.is_set():
                threads = [
                    threading.Thread(
                        target=client.post,
                        args=(server.url + "/v1/completions",),
                        kwargs={"json": body},
                    )  # fmt: skip
                    for _ in range(48)
                ]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()

    loader = threading.Thread(target=load)
    loader.start()
    try:
        server.wait_for(lambda m: m("pdserve_num_requests_running") > 8, "load running")
        v = advise_json(capsys, "--url", server.url, "--window", "4", "--interval", "0.5",
                        "--slo", "ttft_ms=60000,tpot_ms=1")  # fmt: skip
    finally:
        stop.set()
        loader.join()
    assert v["bound"] == "decode", v
    assert "workers busy in steps: both/0" in " ".join(v["evidence"])
    server.wait_idle(timeout_s=60)
