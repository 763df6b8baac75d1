"""The live dashboard: `GET /dashboard` (one self-contained page) and `GET /dashboard/data`.

A `Timeline` scrapes the server's own metrics registry once a second (the samples `/metrics`
serves) and keeps one point per scrape for the last `HISTORY_S` seconds, each computed over the
`SMOOTH_S` seconds before it: latency percentiles, rates, queues, KV usage, MFU / MBU, workers
per role. `/dashboard/data?since=T` returns the points after T, the SLO, the deployment and the
advisor's verdict on the last `VERDICT_S` seconds.

The page holds no data, so it is served without the API key; the data route needs the key like
every other route (the page sends it from the URL fragment, `#key=...`, which never leaves the
browser, or from a field the user types it in).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from importlib import resources

from fastapi import FastAPI
from fastapi.responses import HTMLResponse

from pdserve.planner.advisor import advise
from pdserve.planner.observation import from_window
from pdserve.planner.scrape import Scrape, Window

logger = logging.getLogger("pdserve.frontend")

HISTORY_S = 600  # points kept (one per second)
SMOOTH_S = 5  # each point's window
VERDICT_S = 30  # the advisor's window
P = "pdserve_"


class Timeline:
    def __init__(self, registry, clock=time.monotonic, history_s: int = HISTORY_S) -> None:
        self.registry = registry
        self.clock = clock
        self.t0 = clock()
        self.scrapes: deque[Scrape] = deque(maxlen=VERDICT_S + 1)
        self.points: deque[dict] = deque(maxlen=history_s)
        self._verdict: tuple[float, dict | None] | None = None

    def tick(self) -> None:
        """Scrape the registry and add the point it ends."""
        self.scrapes.append(Scrape.of_families(self.registry.collect(), self.clock() - self.t0))
        if len(self.scrapes) >= 2:
            recent = list(self.scrapes)[-(SMOOTH_S + 1) :]
            self.points.append(point(Window(recent)))

    def since(self, t: float) -> list[dict]:
        return [p for p in self.points if p["t"] > t]

    def verdict(self, slo, settings: dict) -> dict | None:
        """The advisor on the last `VERDICT_S` seconds (None before 3 scrapes), at most one
        computation a second however many pages poll."""
        now = self.clock()
        if self._verdict is not None and now - self._verdict[0] < 1.0:
            return self._verdict[1]
        result = None
        if len(self.scrapes) >= 3:
            obs = from_window(Window(list(self.scrapes)), slo.ttft_s, slo.tpot_s)
            result = advise(obs, settings).to_dict()
        self._verdict = (now, result)
        return result

    async def run(self, interval_s: float = 1.0) -> None:
        while True:
            try:
                self.tick()
            except Exception:  # a dashboard must never take the server down
                logger.exception("dashboard sample failed")
            await asyncio.sleep(interval_s)


def point(w: Window) -> dict:
    """One point of the timeline: the window's figures, JSON-ready (None where undefined)."""
    secs = max(w.seconds, 1e-9)
    ttft = w.histogram(P + "time_to_first_token_seconds")
    tpot = w.histogram(P + "time_per_output_token_seconds")
    itl = w.histogram(P + "inter_token_latency_seconds")
    last = w.last
    kv = last.series(P + "kv_cache_usage_ratio").values()
    return {
        "t": round(last.t, 3),
        "ttft_p50_ms": _ms(ttft.quantile(0.5)),
        "ttft_p90_ms": _ms(ttft.quantile(0.9)),
        "tpot_p50_ms": _ms(tpot.quantile(0.5)),
        "tpot_p90_ms": _ms(tpot.quantile(0.9)),
        "itl_p90_ms": _ms(itl.quantile(0.9)),
        "requests_per_s": w.increase(P + "requests_total") / secs,
        "prefill_tokens_per_s": w.increase(P + "scheduled_tokens_total", kind="prefill") / secs,
        "decode_tokens_per_s": w.increase(P + "scheduled_tokens_total", kind="decode") / secs,
        "running": sum(last.series(P + "num_requests_running").values()),
        "waiting": sum(last.series(P + "num_requests_waiting").values()),
        "kv_usage": max(kv, default=None),
        "busy": _mean(
            [v / secs for v in w.increases_by(P + "step_time_seconds_sum", "worker").values()]
        ),  # fmt: skip
        "mfu": _by_label(last, P + "mfu_ratio", "phase"),
        "mbu": _by_label(last, P + "mbu_ratio", "phase"),
        "workers": {k: int(v) for k, v in _by_label(last, P + "workers", "role").items()},
        "role_switches": sum(last.series(P + "role_switches_total").values()),
    }


def _by_label(s: Scrape, name: str, label: str) -> dict[str, float]:
    """The highest value per label value (MFU of the busiest worker, say)."""
    out: dict[str, float] = {}
    for labels, v in s.series(name).items():
        key = dict(labels).get(label)
        if key is not None:
            out[key] = max(out.get(key, v), v)
    return out


def _mean(values: list[float]) -> float | None:
    return min(1.0, sum(values) / len(values)) if values else None


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 2)


def add_routes(app: FastAPI, state) -> None:
    """The dashboard's two routes, reading `state.timeline` (started with the server)."""
    page = resources.files("pdserve.frontend").joinpath("static/dashboard.html").read_text()

    @app.get("/dashboard", response_class=HTMLResponse)
    async def dashboard():
        return HTMLResponse(page, headers={"Cache-Control": "no-store"})

    @app.get("/dashboard/data")
    async def dashboard_data(since: float = -1.0):
        timeline: Timeline = state.timeline
        facts = state.deployment_facts()
        return {
            "now": round(timeline.clock() - timeline.t0, 3),
            "model": state.model_name,
            "slo": facts["slo"],
            "settings": facts["settings"],
            "deployment": state.client.deployment.report(),
            "points": timeline.since(since),
            "verdict": timeline.verdict(state.client.deployment.slo, facts["settings"]),
        }
