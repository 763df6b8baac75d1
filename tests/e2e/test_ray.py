"""Workers on a real Ray cluster: two nodes started here with `ray start`, one per pool.

The head node (1 CPU, label pool=prefill) and a second node (1 CPU, label pool=decode, whose
workers step slowly on purpose) are separate raylets on this machine; the server places its prefill worker on the first and its
decode worker on the second by label, and the KV crosses between them over TCP. Marked `ray`
(`.ci/run` runs them as a step of their own, with the `ray` extra installed); each node is
stopped at the end, and with it every process it started.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import httpx
import pytest
from server_harness import FAULT_DECODE_DELAY, FAULTS_DIR, free_port, start_server, wait_until

from pdserve import LLM, SamplingParams

pytestmark = pytest.mark.ray
ray = pytest.importorskip("ray", reason="the ray tests need Ray: pip install -e '.[ray]'")

CMPL = "/v1/completions"
STORY = (
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the "
    "park. One day, she saw a big, red ball. She wanted to play with it, but it was too high."
)
PROMPTS = [STORY, "Tim and his dog", "The sun was"]
LABELS = ("--ray-prefill-labels", "pool=prefill", "--ray-decode-labels", "pool=decode")


def _ray_node(*args: str, env: dict | None = None) -> subprocess.Popen:
    """A `ray start --block` node in a session of its own (stopped with its process group);
    the processes it starts, the workers' actors included, inherit `env`."""
    cmd = [os.path.join(os.path.dirname(sys.executable), "ray"), "start", "--block", *args]
    return subprocess.Popen(
        cmd,
        start_new_session=True,
        env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0", **(env or {})},
        stdout=subprocess.DEVNULL,
    )


def _stop(node: subprocess.Popen) -> None:
    for sig, wait_s in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
        try:
            os.killpg(node.pid, sig)
        except ProcessLookupError:
            return
        try:
            node.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


@pytest.fixture(scope="module")
def cluster():
    """(address) of a two-node cluster; this test process is connected to it as a driver."""
    port = free_port()
    temp_dir = tempfile.mkdtemp(prefix="pdray-")  # short: Ray's socket paths live under it
    common = ("--num-cpus", "1", "--disable-usage-stats")
    nodes = [
        _ray_node(
            "--head",
            "--port",
            str(port),
            "--temp-dir",
            temp_dir,
            "--include-dashboard",
            "false",
            "--labels",
            "pool=prefill",
            *common,
        )
    ]
    address = f"127.0.0.1:{port}"
    try:
        wait_until(lambda: _can_connect(address), "the Ray head to listen", timeout_s=60)
        # Decode workers on the second node take >= 10 ms a step (tests/e2e/faults), so a long
        # answer is still decoding when a test kills its worker, whatever the machine.
        slow_decode = {
            FAULT_DECODE_DELAY: "0.01",
            "PYTHONPATH": os.pathsep.join(
                filter(None, [str(FAULTS_DIR), os.environ.get("PYTHONPATH")])
            ),
        }
        nodes.append(
            _ray_node("--address", address, "--labels", "pool=decode", *common, env=slow_decode)
        )
        ray.init(address=address, namespace="pdserve", log_to_driver=False)
        wait_until(lambda: sum(n["Alive"] for n in ray.nodes()) == 2, "two Ray nodes", timeout_s=60)
        yield address
    finally:
        if ray.is_initialized():
            ray.shutdown()
        for node in reversed(nodes):
            _stop(node)
        shutil.rmtree(temp_dir, ignore_errors=True)


def _can_connect(address: str) -> bool:
    import socket

    host, port = address.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=1).close()
        return True
    except OSError:
        return False


@pytest.fixture(scope="module")
def offline(stories_path):
    return LLM(stories_path)


def greedy(offline, prompt: str, max_tokens: int = 32) -> str:
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    return offline.generate([prompt], params)[0].outputs[0].text


def completion(server, prompt: str, **kw) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": 32, "temperature": 0, **kw}
    return httpx.post(server.url + CMPL, json=body, timeout=120)


def deployment(server) -> list[dict]:
    return httpx.get(server.url + "/deployment", timeout=10).json()["workers"]


def node_labels() -> dict[str, str]:
    """node id -> its pool label."""
    return {n["NodeID"]: n["Labels"].get("pool") for n in ray.nodes() if n["Alive"]}


@pytest.mark.parametrize("transport", ["tcp", "auto"])
def test_pools_on_their_nodes_give_local_outputs(cluster, stories_path, offline, transport):
    """tcp (the cluster's default): rows on the stream. auto: the two nodes share this host, so
    the prefill worker maps the decode worker's shared-memory cache and writes the rows there,
    only the signals taking the stream."""
    s = start_server(
        stories_path, "--prefill-workers", "1", "--decode-workers", "1", "--ray-address", cluster,
        "--kv-transport", transport, *LABELS,
    )  # fmt: skip
    try:
        workers = deployment(s)
        labels = node_labels()
        assert [(w["role"], w["placement"]["backend"]) for w in workers] == [
            ("prefill", "ray"),
            ("decode", "ray"),
        ]
        assert [labels[w["placement"]["node_id"]] for w in workers] == ["prefill", "decode"]
        for prompt in PROMPTS:
            r = completion(s, prompt)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == greedy(offline, prompt)
        # The prompts were prefilled on the prefill node and their KV crossed to the other.
        assert s.metric("pdserve_router_decisions_total", 'decision="remote"') == len(PROMPTS)
        path = {"tcp": 'path="tcp"', "auto": 'path="shm"'}[transport]
        assert s.metric("pdserve_kv_transfer_bytes_total", path) > 0
        assert s.metric("pdserve_kv_transfer_bytes_total") == s.metric(
            "pdserve_kv_transfer_bytes_total", path
        )
        s.wait_idle()
    finally:
        assert s.stop() in (0, -signal.SIGTERM)  # uvicorn re-raises it once shut down
    # Stopping the server ended its actors: the cluster's CPUs are free again.
    wait_until(
        lambda: ray.available_resources().get("CPU", 0) == 2, "the actors' CPUs to come back"
    )


def test_worker_killed_through_ray_is_detected_and_replaced(cluster, stories_path, offline):
    s = start_server(
        stories_path, "--prefill-workers", "1", "--decode-workers", "1", "--ray-address", cluster,
        "--restart-workers", *LABELS,
    )  # fmt: skip
    try:
        before = deployment(s)[1]["placement"]
        box = {}

        def run():  # 400 steps of >= 10 ms: decoding when its worker dies
            box["r"] = completion(s, STORY, max_tokens=400, ignore_eos=True)

        t = threading.Thread(target=run)
        t.start()
        s.wait_for(
            lambda m: m("pdserve_num_requests_running", 'role="decode"') == 1,
            "the request to decode",
        )
        ray.kill(ray.get_actor(before["actor"], namespace="pdserve"))
        t.join(timeout=60)
        assert box["r"].status_code == 503
        assert "engine worker 1 (decode) died" in box["r"].json()["error"]["message"]

        # A new actor takes its place (on the decode node again) and rejoins the pool.
        s.wait_health(lambda h: h.get("status") == "ok", "the replaced decode worker", timeout_s=90)
        after = deployment(s)[1]["placement"]
        assert after["actor"] != before["actor"]
        assert node_labels()[after["node_id"]] == "decode"
        assert s.metric("pdserve_worker_up", 'role="decode"') == 1
        r = completion(s, STORY)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == greedy(offline, STORY)
        s.wait_idle()
    finally:
        assert s.stop() in (0, -signal.SIGTERM)  # uvicorn re-raises it once shut down
    deadline = time.monotonic() + 30
    while ray.available_resources().get("CPU", 0) != 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray.available_resources().get("CPU", 0) == 2
