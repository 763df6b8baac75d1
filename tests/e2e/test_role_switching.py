"""Workers that switch role at run time (`--pd-ratio manual|auto`): under load, no request fails
or changes its output, and every KV block comes back on every worker."""

from __future__ import annotations

import contextlib
import os
import threading
import time

import httpx
import pytest
from server_harness import FAULT_BOTH_DELAY, start_server, wait_until
from test_disagg import PROMPTS, STORY, expected

from pdserve import LLM
from pdserve.engine.cpu_placement import unpinned

CMPL = "/v1/completions"
pytestmark = pytest.mark.slow  # each test starts servers of its own


@pytest.fixture(scope="module")
def offline(stories_path):
    return LLM(stories_path)


def run_batch(server, prompts, results, max_tokens=48):
    """Send `prompts` concurrently; (prompt, status, text) land in `results`."""

    def one(prompt):
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        r = httpx.post(server.url + CMPL, json=body, timeout=120)
        text = r.json()["choices"][0]["text"] if r.status_code == 200 else r.text
        results.append((prompt, r.status_code, text))

    threads = [threading.Thread(target=one, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    return threads


def deployment(server) -> dict:
    return httpx.get(server.url + "/deployment", timeout=10).json()


def switch(server, prefill_workers):
    return httpx.post(
        server.url + "/deployment", json={"prefill_workers": prefill_workers}, timeout=10
    )


@pytest.mark.parametrize("split", [(), ("--tensor-parallel-size", "2")], ids=["tp1", "tp2"])
def test_manual_switches_under_load_lose_nothing(stories_path, offline, split):
    """tp2: each worker two ranks, the KV of split heads crossing both ways as roles change.
    Every step of a worker takes 10 ms or more: without it, a fast machine finished a batch of the
    tiny model between two scrapes of /metrics, and the switch never came mid-flight."""
    s = start_server(
        stories_path,
        "--decode-workers",
        "2",
        "--pd-ratio",
        "manual",
        *split,
        env={FAULT_BOTH_DELAY: "0.01"},
    )
    try:
        d = deployment(s)
        assert (d["control"], d["split"]) == ("manual", "2 colocated")
        results: list = []
        prompts = [STORY, *PROMPTS[1:], STORY[:150]] * 2
        threads = run_batch(s, prompts, results)
        wait_until(lambda: s.metric("pdserve_num_requests_running") > 0, "requests running")
        r = switch(s, 1)  # mid-flight: running decodes finish where they are
        assert r.status_code == 200 and r.json()["split"] == "1P+1D", r.text
        threads += run_batch(s, prompts, results)  # these go through the handoff
        # Back as soon as the handoff is in use: waiting for the first batch to finish first lost
        # the race on a fast machine (the tiny model had finished the second batch too).
        wait_until(
            lambda: s.metric("pdserve_router_decisions_total", 'decision="remote"') > 0,
            "a prompt routed to the prefill worker",
        )
        assert switch(s, 0).json()["split"] == "2 colocated"  # and back, mid-flight again
        threads += run_batch(s, prompts, results)
        for t in threads:
            t.join()
        assert len(results) == 3 * len(prompts)
        for prompt, status, text in results:
            assert status == 200, text
            assert text == expected(offline, prompt, max_tokens=48)[0]
        assert s.metric("pdserve_router_decisions_total", 'decision="remote"') > 0
        assert s.metric("pdserve_kv_transfer_bytes_total") > 0
        assert s.metric("pdserve_role_switches_total") == 4  # 2 workers each way
        assert s.metric("pdserve_workers", 'role="both"') == 2
        assert [x["reason"] for x in deployment(s)["decisions"]] == ["operator request"] * 2
        s.wait_idle()  # no request left and every block back on both workers
        assert s.metric("pdserve_kv_transfer_fallbacks_total") == 0
    finally:
        s.stop()


def test_bad_switches_are_refused(stories_path):
    s = start_server(stories_path, "--decode-workers", "2", "--pd-ratio", "manual")
    try:
        for body in ({"prefill_workers": 2}, {"prefill_workers": -1}, {"prefill_workers": "1"},
                     {"prefill_workers": True}, {}, [1]):  # fmt: skip
            r = httpx.post(s.url + "/deployment", json=body, timeout=10)
            assert r.status_code == 400, (body, r.text)
            assert r.json()["error"]["param"] == "prefill_workers"
        assert deployment(s)["split"] == "2 colocated"
    finally:
        s.stop()
    static = start_server(stories_path)
    try:
        r = switch(static, 0)
        assert r.status_code == 400 and "static" in r.json()["error"]["message"]
        assert deployment(static)["control"] == "static"
    finally:
        static.stop()


@pytest.mark.parametrize("merge", [False, True], ids=["spread", "merged"])
def test_auto_control_switches_from_the_load_and_serves_on(stories_path, offline, merge):
    """A TPOT target no step can meet makes the controller split the colocated workers as soon
    as prompts queue behind decodes, and then (decode still short of its target while prefill
    has headroom) go back: the switches follow the load, dwell time apart, and nothing fails.
    Merged: it starts with one worker on both CPUs, splits, and merges again."""
    cpus = sorted(unpinned())[:2]
    if merge and len(cpus) < 2:
        pytest.skip("merging needs two CPUs")
    extra = ("--pd-merge", "--decode-cpus", str(cpus[0]), "--decode-cpus", str(cpus[1]))
    s = start_server(
        stories_path, "--decode-workers", "2", "--pd-ratio", "auto",
        "--slo", "ttft_ms=2000,tpot_ms=0.001", "--pd-min-dwell-s", "1",
        "--max-num-batched-tokens", "16", *(extra if merge else ()),
    )  # fmt: skip
    colocated = "1 colocated + 1 parked" if merge else "2 colocated"
    try:
        results: list = []
        # rounds of load until the controller has acted both ways: it samples every second and
        # wants 3 samples in a row and 1 s of dwell, so the bound is time (a fast machine runs
        # many more rounds per second), not a count of rounds
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            for t in run_batch(s, [STORY] * 6, results, max_tokens=96):
                t.join()
            if len(deployment(s)["decisions"]) >= 2 + merge:
                break
        decisions = deployment(s)["decisions"][merge:]  # merged: after the start's decision
        assert len(decisions) >= 2, decisions
        assert "prefills stall colocated decodes" in decisions[0]["reason"]
        assert (decisions[0]["new"], decisions[1]["new"]) == ("1P+1D", colocated)
        assert s.metric("pdserve_role_switches_total") >= 4 + merge  # 2 workers each way
        want = expected(offline, STORY, max_tokens=96)[0]
        assert all(status == 200 and text == want for _, status, text in results)
        s.wait_idle()
    finally:
        s.stop()


def thread_cpus(pid: int) -> frozenset[int]:
    """The CPUs the threads of a process may run on together, as the kernel reports them.

    A union: the engine binds each compute thread to one CPU of its placement for its steps
    (engine/thread_binding.py), so a placement shows as threads that cover its set and never
    leave it."""
    from pdserve.engine.cpu_placement import parse_cpu_set

    out: set[int] = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError):
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                line = next(x for x in f if x.startswith("Cpus_allowed_list:"))
            out |= parse_cpu_set(line.split(":", 1)[1].strip())
    return frozenset(out)


def merge(server):
    return httpx.post(
        server.url + "/deployment", json={"prefill_workers": 0, "merge": True}, timeout=10
    )


@pytest.mark.skipif(len(unpinned()) < 2, reason="merging needs two CPUs")
def test_merged_workers_lend_their_cpus_and_switch_under_load_losing_nothing(stories_path, offline):
    """--pd-merge: one worker runs on both workers' CPUs while the other is parked; a split
    under load gives the CPUs back (the kernel says where every thread may run), merging again
    waits for the parked worker to finish what it holds, and no request fails or changes."""
    c0, c1 = sorted(unpinned())[:2]  # the offline engine may have pinned this process
    s = start_server(
        stories_path, "--decode-workers", "2", "--decode-cpus", str(c0), "--decode-cpus",
        str(c1), "--pd-ratio", "manual", "--pd-merge",
    )  # fmt: skip
    try:
        d = deployment(s)
        assert (d["split"], d["merge"]) == ("1 colocated + 1 parked", True)
        roles = {w["role"]: w for w in d["workers"]}
        host, parked = roles["both"], roles["parked"]
        own = {0: {c0}, 1: {c1}}  # by worker id, as --decode-cpus gave them

        def threads(wid):
            return next(w.get("threads") for w in deployment(s)["workers"] if w["id"] == wid)

        wait_until(lambda: threads(host["id"]) == 2, "the host on both CPUs")
        assert thread_cpus(host["placement"]["pid"]) == {c0, c1}
        assert thread_cpus(parked["placement"]["pid"]) == own[parked["id"]]
        assert threads(parked["id"]) in (None, 1)  # it has reported no step yet, or one thread
        assert s.metric("pdserve_workers", 'role="parked"') == 1

        results: list = []
        prompts = [STORY, *PROMPTS[1:], STORY[:150]] * 2
        pending = run_batch(s, prompts, results)  # all on the host
        # the tiny model can serve the batch between two polls: its first answers count too
        wait_until(
            lambda: s.metric("pdserve_num_requests_running") > 0 or results,
            "requests running on the host",
        )
        assert switch(s, 1).json()["split"] == "1P+1D"  # the parked worker prefills again
        wait_until(lambda: threads(host["id"]) == 1, "the host back on its own CPU")
        assert thread_cpus(host["placement"]["pid"]) == own[host["id"]]
        pending += run_batch(s, prompts, results)
        wait_until(
            lambda: s.metric("pdserve_router_decisions_total", 'decision="remote"') > 0,
            "a prompt routed to the prefill worker",
        )
        r = merge(s)  # mid-flight: the new parked worker finishes its prefills first
        assert r.status_code == 200 and r.json()["split"] == "1 colocated + 1 parked", r.text
        pending += run_batch(s, prompts, results)
        for t in pending:
            t.join()
        assert len(results) == 3 * len(prompts)
        for prompt, status, text in results:
            assert status == 200, text
            assert text == expected(offline, prompt, max_tokens=48)[0]
        s.wait_idle()  # every block back on both workers
        d = deployment(s)
        host = next(w for w in d["workers"] if w["role"] == "both")
        wait_until(lambda: threads(host["id"]) == 2, "the new host on both CPUs")
        assert thread_cpus(host["placement"]["pid"]) == {c0, c1}
        assert s.metric("pdserve_kv_transfer_fallbacks_total") == 0
        assert [x["new"] for x in d["decisions"]] == [
            "1 colocated + 1 parked", "1P+1D", "1 colocated + 1 parked"
        ]  # fmt: skip
        bad = httpx.post(s.url + "/deployment", json={"prefill_workers": 1, "merge": True})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "merge"
    finally:
        s.stop()
