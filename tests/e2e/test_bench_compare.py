"""`pdserve bench compare`: start each deployment, wait for health, run the same workload, stop.

The deployments are fake servers started as processes (`python -m pdserve.bench.fake_server`),
with different injected delays so the comparison has a known answer.
"""

from __future__ import annotations

import json
import socket
import sys
import time
from pathlib import Path

import httpx
import pytest

from pdserve.bench.compare import Deployment, ServerProcess
from pdserve.bench.errors import BenchError
from pdserve.bench.fake_server import FakeServer
from pdserve.cli import main


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fake_serve(port: int, ttft_ms: float, root: str | None = None) -> list[str]:
    cmd = [sys.executable, "-m", "pdserve.bench.fake_server", "--port", str(port),
           "--ttft-ms", str(ttft_ms), "--itl-ms", "2"]  # fmt: skip
    return cmd + (["--model-root", root] if root else [])


def deployment(name: str, serve: list[str], port: int, **kw) -> Deployment:
    cwd = str(Path(__file__).resolve().parents[2])
    return Deployment(name, f"http://127.0.0.1:{port}", tuple(serve), cwd=cwd, **kw)


def answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1.0).status_code == 200
    except httpx.HTTPError:
        return False


def test_a_server_is_healthy_inside_the_block_and_gone_after(tmp_path):
    port = free_port()
    dep = deployment("a", fake_serve(port, 5), port, startup_timeout_s=30)
    with ServerProcess(dep, tmp_path / "a.log") as server:
        assert answers(dep.health_url)
        proc = server.proc
    assert proc.poll() is not None and not answers(dep.health_url)


def test_a_serve_command_that_exits_early_is_a_clear_error(tmp_path):
    dep = deployment("broken", [sys.executable, "-c", "import sys; sys.exit(3)"], free_port())
    server = ServerProcess(dep, tmp_path / "broken.log")
    with pytest.raises(BenchError, match="exited with code 3 before /health answered"):
        server.__enter__()


def test_a_server_that_never_gets_healthy_times_out_and_is_stopped(tmp_path):
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    dep = deployment("slow", sleeper, free_port(), startup_timeout_s=0.5, stop_timeout_s=5)
    server = ServerProcess(dep, tmp_path / "slow.log")
    start = time.monotonic()
    with pytest.raises(BenchError, match="did not answer within 0.5s"):
        server.__enter__()
    assert server.proc is None and time.monotonic() - start < 10


def test_a_port_already_in_use_is_refused_before_starting(tmp_path):
    with FakeServer() as other:
        dep = deployment("b", fake_serve(other.port, 5), other.port)
        with pytest.raises(BenchError, match="already answers"):
            ServerProcess(dep, tmp_path / "b.log").__enter__()


def test_compare_runs_the_same_workload_on_each_deployment(stories_path, tmp_path, capsys):
    fast_port, slow_port = free_port(), free_port()
    configs = {
        "fast": {"serve": fake_serve(fast_port, 10, stories_path),
                 "base_url": f"http://127.0.0.1:{fast_port}"},
        "slow": {"serve": fake_serve(slow_port, 400, stories_path),
                 "base_url": f"http://127.0.0.1:{slow_port}", "startup_timeout_s": 30},
        "missing": {"serve": [sys.executable, "-c", "raise SystemExit(1)"],
                    "base_url": f"http://127.0.0.1:{free_port()}"},
    }  # fmt: skip
    argv = ["bench", "compare"]
    for name, config in configs.items():
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({"name": name, "cwd": str(Path.cwd()), **config}))
        argv += ["--config", str(path)]
    out, plots = tmp_path / "cmp.json", tmp_path / "plots"
    argv += ["--num-requests", "6", "--input-len", "30", "--output-len", "4",
             "--slo", "ttft_ms=200", "--output", str(out), "--plot", str(plots),
             "--log-dir", str(tmp_path / "logs")]  # fmt: skip
    assert main(argv) == 1  # one deployment could not start
    data = json.loads(out.read_text())
    fast, slow, missing = data["deployments"]
    assert fast["summary"]["completed"] == slow["summary"]["completed"] == 6
    assert fast["summary"]["slo_attainment"] == 1.0 and slow["summary"]["slo_attainment"] == 0.0
    assert missing["error"] and "summary" not in missing
    prompts = [[r["prompt_len"] for r in d["requests"]] for d in (fast, slow)]
    assert prompts[0] == prompts[1]
    text = capsys.readouterr().out
    header = next(line for line in text.splitlines() if line.split() == ["fast", "slow", "missing"])
    assert header
    assert "missing: the serve command exited with code 1" in text
    assert sorted(p.name for p in plots.iterdir()) == ["tpot_cdf.png", "ttft_cdf.png"]
    assert (tmp_path / "logs" / "fast.log").exists()
    assert not answers(configs["fast"]["base_url"] + "/health")
