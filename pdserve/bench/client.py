"""Async streaming client for any OpenAI-compatible server: sends the workload, times every chunk.

`run_requests` sends each request at its `send_at_s` (capped by `max_concurrency`), streams the
SSE response with httpx and stamps the arrival of every read, so a chunk's time is when its bytes
reached the client. Failures (HTTP errors, dropped connections, error events, empty streams)
become failed records, never exceptions; a set `stop` event cancels what is still in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import msgspec

from pdserve.bench.errors import BenchError
from pdserve.bench.metrics import CANCELLED, COMPLETED, FAILED, RequestRecord
from pdserve.bench.sse import StreamState
from pdserve.bench.workload import BenchRequest

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
_DETAIL_CHARS = 300
_REQUESTS_PER_CLIENT = 16  # see _ClientPool


def endpoint_name(value: str) -> str:
    """`completions` or `chat`, from either name or path (`/v1/chat/completions`...)."""
    key = value.strip().strip("/").removeprefix("v1/")
    key = {"chat/completions": "chat", "completions": "completions", "chat": "chat"}.get(key)
    if key is None:
        raise ValueError(f"--endpoint {value!r}: use completions or chat (or their /v1/ paths)")
    return key


def normalize_base_url(url: str) -> str:
    """`http://host:port`, without a trailing slash or `/v1`."""
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"--base-url {url!r}: must start with http:// or https://")
    return url.removesuffix("/v1")


@dataclass(frozen=True)
class ClientConfig:
    """How to talk to the server under test."""

    base_url: str
    model: str
    endpoint: str = "completions"  # completions | chat
    api_key: str | None = None
    temperature: float = 0.0
    force_output_len: bool = True  # send ignore_eos and min_tokens = max_tokens
    extra_body: dict = field(default_factory=dict)  # merged into every request body
    timeout_s: float = 600.0  # per request

    @property
    def url(self) -> str:
        return self.base_url + ENDPOINTS[self.endpoint]

    def headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return headers


def request_body(cfg: ClientConfig, request: BenchRequest) -> dict:
    """The JSON body of one streaming request."""
    body: dict = {
        "model": cfg.model,
        "max_tokens": request.output_len,
        "temperature": cfg.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if cfg.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": request.prompt}]
    else:
        body["prompt"] = request.prompt
    if cfg.force_output_len:
        body["ignore_eos"] = True
        body["min_tokens"] = request.output_len
    body.update(cfg.extra_body)
    return body


def fetch_models(base_url: str, api_key: str | None = None, timeout_s: float = 10.0) -> list[dict]:
    """GET /v1/models: the served models ([] if the server has no such route)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        resp = httpx.get(
            base_url + "/v1/models", headers=headers, timeout=timeout_s, trust_env=False
        )
    except httpx.HTTPError as e:
        raise BenchError(f"cannot reach the server at {base_url}: {_describe(e)}") from None
    if resp.status_code in (401, 403):
        raise BenchError(f"{base_url} refused the API key (HTTP {resp.status_code}): see --api-key")
    if resp.status_code != 200:
        return []
    try:
        data = resp.json().get("data", [])
    except (ValueError, AttributeError):
        return []
    return [m for m in data if isinstance(m, dict) and "id" in m] if isinstance(data, list) else []


def fetch_metrics(
    base_url: str, api_key: str | None = None, timeout_s: float = 10.0
) -> dict | None:
    """GET /metrics, best effort: `{"t": monotonic seconds, "text": Prometheus text}`, or None
    when the server has no such route or does not answer (a benchmark never fails for it)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        resp = httpx.get(base_url + "/metrics", headers=headers, timeout=timeout_s, trust_env=False)
    except httpx.HTTPError:
        return None
    if resp.status_code != 200 or "text/plain" not in resp.headers.get("content-type", ""):
        return None
    return {"t": time.monotonic(), "text": resp.text}


def resolve_target(
    base_url: str, model: str | None, tokenizer: str | None, api_key: str | None
) -> tuple[str, str]:
    """The model name to send and the tokenizer folder to build prompts with.

    Checks that the server answers. Without `model`, the first id of /v1/models; without
    `tokenizer`, the model's folder when the id (or its vLLM-style `root`) is a local folder.
    """
    models = fetch_models(base_url, api_key)
    if model is None:
        if not models:
            raise BenchError(f"{base_url}/v1/models lists no model: pass --model NAME")
        model = str(models[0]["id"])
    if tokenizer is None:
        entry = next((m for m in models if m.get("id") == model), {})
        for candidate in (model, entry.get("root")):
            if isinstance(candidate, str) and Path(candidate).is_dir():
                tokenizer = candidate
                break
        else:
            raise BenchError(
                f"model {model!r} is not a local folder: pass --tokenizer DIR (its tokenizer)"
            )
    return model, tokenizer


async def run_requests(
    requests: Sequence[BenchRequest],
    cfg: ClientConfig,
    max_concurrency: int | None = None,
    stop: asyncio.Event | None = None,
    on_done: Callable[[RequestRecord], None] | None = None,
) -> list[RequestRecord]:
    """Send every request at its time; one record per request, in the order given.

    Times in the records are seconds since this call started. When `stop` is set, nothing more
    is sent and requests in flight are cancelled (their records say `cancelled`).
    """
    stop = stop or asyncio.Event()
    _raise_open_file_limit()
    records = [
        RequestRecord(r.index, r.input_len, r.output_len, r.prompt_len, r.send_at_s)
        for r in requests
    ]
    semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    async with _ClientPool(cfg.timeout_s) as pool:
        await _warm_up(pool.client(0), cfg)
        t0 = time.perf_counter()

        def clock() -> float:
            return time.perf_counter() - t0

        tasks = []
        order = sorted(range(len(requests)), key=lambda i: requests[i].send_at_s)
        for i in order:
            delay = requests[i].send_at_s - clock()
            if delay > 0 and await _wait_or_stop(asyncio.sleep(delay), stop):
                break
            if semaphore and await _wait_or_stop(semaphore.acquire(), stop):
                break
            if stop.is_set():
                _release(semaphore)
                break
            one = _run_one(pool, cfg, requests[i], records[i], clock, semaphore, on_done)
            tasks.append(asyncio.create_task(one))
        if tasks and await _wait_or_stop(asyncio.wait(tasks), stop):
            for task in tasks:
                task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return records


class _ClientPool:
    """httpx clients that each carry at most `_REQUESTS_PER_CLIENT` requests in flight.

    httpx's connection pool scans all its connections for every request it sends, so one client
    with n streams in flight costs O(n^2) CPU: at a few hundred concurrent streams the load
    generator itself would become the bottleneck and inflate every TTFT. Small shards keep the
    per-request cost flat; they share one TLS context (building one takes ~100 ms).
    """

    def __init__(self, timeout_s: float) -> None:
        self._timeout = httpx.Timeout(timeout_s, connect=min(timeout_s, 30.0))
        self._limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        self._tls = ssl.create_default_context()
        self._clients: list[httpx.AsyncClient] = []
        self._in_flight: list[int] = []

    async def __aenter__(self) -> _ClientPool:
        self._add()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.gather(*(c.aclose() for c in self._clients), return_exceptions=True)

    def client(self, shard: int) -> httpx.AsyncClient:
        return self._clients[shard]

    def acquire(self) -> int:
        """The least busy shard with room (a new one when all are full)."""
        shard = min(range(len(self._clients)), key=self._in_flight.__getitem__)
        if self._in_flight[shard] >= _REQUESTS_PER_CLIENT:
            shard = self._add()
        self._in_flight[shard] += 1
        return shard

    def release(self, shard: int) -> None:
        self._in_flight[shard] -= 1

    def _add(self) -> int:
        self._clients.append(
            httpx.AsyncClient(
                limits=self._limits, timeout=self._timeout, verify=self._tls, trust_env=False
            )
        )
        self._in_flight.append(0)
        return len(self._clients) - 1


def _raise_open_file_limit() -> None:
    """Each request in flight holds a socket: lift the soft open-file limit to the hard one, so
    that a burst of thousands fails on the server's account, not on the client's."""
    try:
        import resource
    except ImportError:  # not on POSIX
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


async def _warm_up(http: httpx.AsyncClient, cfg: ClientConfig) -> None:
    """One cheap request before the clock starts: httpx imports and sets up its transport on
    first use, which would otherwise add tens of ms to the first measured TTFTs."""
    with contextlib.suppress(httpx.HTTPError):  # the run itself will record any failure
        await http.get(cfg.base_url + "/v1/models", headers=cfg.headers(), timeout=10.0)


async def _wait_or_stop(awaitable, stop: asyncio.Event) -> bool:
    """Await `awaitable` unless `stop` is set first; True when stopped."""
    if stop.is_set():
        if asyncio.iscoroutine(awaitable):
            awaitable.close()
        return True
    work = asyncio.ensure_future(awaitable)
    stopped = asyncio.ensure_future(stop.wait())
    await asyncio.wait({work, stopped}, return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()
    if work.done():
        return False
    work.cancel()
    return True


def _release(semaphore: asyncio.Semaphore | None) -> None:
    if semaphore:
        semaphore.release()


async def _run_one(
    pool: _ClientPool,
    cfg: ClientConfig,
    request: BenchRequest,
    record: RequestRecord,
    clock: Callable[[], float],
    semaphore: asyncio.Semaphore | None,
    on_done: Callable[[RequestRecord], None] | None,
) -> None:
    shard = pool.acquire()
    try:
        await stream_one(pool.client(shard), cfg, request, record, clock)
    except asyncio.CancelledError:
        record.status = CANCELLED
        raise
    finally:
        pool.release(shard)
        _release(semaphore)
    if on_done:
        on_done(record)


async def stream_one(
    http: httpx.AsyncClient,
    cfg: ClientConfig,
    request: BenchRequest,
    record: RequestRecord,
    clock: Callable[[], float],
) -> None:
    """Send one request and fill `record` in (status completed or failed)."""
    content = msgspec.json.encode(request_body(cfg, request))
    record.t_arrive = clock()
    try:
        async with http.stream("POST", cfg.url, content=content, headers=cfg.headers()) as resp:
            if resp.status_code != 200:
                detail = (await resp.aread()).decode("utf-8", "replace")
                return _fail(record, clock(), f"HTTP {resp.status_code}", detail)
            stream = StreamState(chat=cfg.endpoint == "chat")
            async for data in resp.aiter_raw():
                now = clock()
                stream.feed(data, now, record)
                if stream.error:
                    return _fail(record, now, "stream error", stream.error)
    except httpx.HTTPError as e:
        return _fail(record, clock(), _error_kind(e), _describe(e))
    except msgspec.DecodeError as e:
        return _fail(record, clock(), "bad chunk", str(e))
    except Exception as e:  # a malformed reply must fail its request, never the whole run
        return _fail(record, clock(), "client error", _describe(e))
    record.t_end = stream.last_read_s
    if not (stream.done or stream.finished):
        return _fail(record, clock(), "incomplete stream", "the stream ended without [DONE]")
    if not record.token_times:
        return _fail(record, record.t_end, "no output tokens", "the stream carried no text")
    record.status = COMPLETED


def _fail(record: RequestRecord, now: float, kind: str, detail: str) -> None:
    record.status = FAILED
    record.t_end = now
    record.error = kind
    record.error_detail = " ".join(detail.split())[:_DETAIL_CHARS]  # one line


def _error_kind(e: httpx.HTTPError) -> str:
    if isinstance(e, httpx.TimeoutException):
        return "timeout"
    if isinstance(e, httpx.ConnectError):
        return "connect error"
    if isinstance(e, (httpx.RemoteProtocolError, httpx.ReadError)):
        return "connection dropped"
    return e.__class__.__name__


def _describe(e: Exception) -> str:
    text = str(e).strip()
    return f"{e.__class__.__name__}: {text}" if text else e.__class__.__name__
