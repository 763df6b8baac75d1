"""The live dashboard in a real headless Chromium: the page loads without the API key, takes the
key from its URL fragment, fills every chart and the verdict under load, and logs no error.

Needs a Chromium on the machine and the `playwright` Python package (its browser download is
not used); the test skips, saying which is missing, without them. With
`PDSERVE_UPDATE_SCREENSHOT=1` it writes the screenshot the docs show (docs/dashboard.png).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from server_harness import start_server

pytestmark = pytest.mark.slow  # starts a server and a browser of its own

KEY = "dashboard-test-key"
SYSTEM_CHROMIUM = "/usr/bin/chromium"
DOCS_SCREENSHOT = Path(__file__).resolve().parents[2] / "docs" / "dashboard.png"
# This machine has no network: without the background-networking flags Chromium floods its log
# with refused connections (updates, sync, QUIC probes).
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]  # fmt: skip
FILLED_CHARTS = ("chart-ttft", "chart-tpot", "chart-queue", "chart-throughput")
MIN_POINTS = 3
LOAD_S = 12.0  # long enough for the charts to fill and the advisor to see a loaded window
LOAD_CONCURRENCY = 24
PROMPT = "Once upon a time, there was a little girl named Lily. She loved to play outside. " * 4


def find_chromium() -> str:
    """The Chromium binary, or a skip that says what is missing and how to get it."""
    path = shutil.which("chromium")
    if path is None and os.access(SYSTEM_CHROMIUM, os.X_OK):
        path = SYSTEM_CHROMIUM
    if path is None:
        pytest.skip(
            f"no Chromium: `chromium` is neither on PATH nor at {SYSTEM_CHROMIUM} "
            "(install it with `apt-get install chromium`)"
        )
    if importlib.util.find_spec("playwright") is None:
        pytest.skip(
            "the `playwright` Python package is missing (install it with "
            "`pip install playwright` or the `ui` extra; no browser download is needed)"
        )
    return path


def send_load(server, stop: threading.Event) -> list[int]:
    """Concurrent completions for `LOAD_S` seconds (or until `stop`); their status codes."""
    deadline = time.monotonic() + LOAD_S
    body = {"prompt": PROMPT, "max_tokens": 100, "temperature": 0.8}

    def loop() -> list[int]:
        codes = []
        with httpx.Client(base_url=server.url, headers=server.headers, timeout=60) as client:
            while time.monotonic() < deadline and not stop.is_set():
                codes.append(client.post("/v1/completions", json=body).status_code)
        return codes

    with ThreadPoolExecutor(LOAD_CONCURRENCY) as pool:
        futures = [pool.submit(loop) for _ in range(LOAD_CONCURRENCY)]
        return [code for f in futures for code in f.result()]


def charts_filled_js() -> str:
    """A page predicate: the charts in `FILLED_CHARTS` drew `MIN_POINTS` and a verdict is shown."""
    checks = " && ".join(
        f"+(document.getElementById('{c}').getAttribute('data-points') || 0) >= {MIN_POINTS}"
        for c in FILLED_CHARTS
    )
    return f"() => {checks} && document.getElementById('verdict').hasAttribute('data-bound')"


def wait_for_charts(page) -> None:
    try:
        page.wait_for_function(charts_filled_js(), timeout=60_000, polling=200)
    except Exception as e:  # playwright's TimeoutError: say what the page had drawn
        state = {c: page.get_attribute(f"#{c}", "data-points") for c in FILLED_CHARTS}
        state["verdict"] = page.get_attribute("#verdict", "data-bound")
        status = page.text_content("#status")
        raise AssertionError(f"the charts did not fill: {state}, status {status!r}") from e


def screenshot_path(tmp_path: Path) -> Path:
    """docs/dashboard.png when asked for (PDSERVE_UPDATE_SCREENSHOT=1), else a temp file."""
    update = os.environ.get("PDSERVE_UPDATE_SCREENSHOT") == "1"
    return DOCS_SCREENSHOT if update else tmp_path / "dashboard.png"


def test_dashboard_fills_under_load_without_console_errors(stories_path, tmp_path):
    chromium = find_chromium()
    from playwright.sync_api import sync_playwright

    server = start_server(stories_path, "--api-key", KEY)
    stop, codes = threading.Event(), []
    load = threading.Thread(target=lambda: codes.extend(send_load(server, stop)))
    try:
        assert httpx.get(server.url + "/dashboard", timeout=10).status_code == 200
        assert httpx.get(server.url + "/dashboard/data", timeout=10).status_code == 401
        errors: list[str] = []
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
            try:
                page = browser.new_page(viewport={"width": 1400, "height": 1000})
                page.on("console", lambda m: errors.extend([m.text] if m.type == "error" else []))
                page.on("pageerror", lambda e: errors.append(f"page error: {e}"))
                page.goto(f"{server.url}/dashboard#key={KEY}")
                load.start()
                wait_for_charts(page)
                load.join()  # the whole load profile on the screenshot
                page.wait_for_timeout(1500)  # a poll after the last request
                assert codes and set(codes) == {200}, sorted(set(codes))
                assert page.get_attribute("#verdict", "data-bound") not in (None, "")
                assert "#key=" not in page.url  # the key is taken off the address bar
                page.screenshot(path=str(screenshot_path(tmp_path)), full_page=True)
            finally:
                browser.close()
        assert errors == []
    finally:
        stop.set()
        if load.is_alive():
            load.join()
        server.stop()
