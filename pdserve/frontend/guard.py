"""The HTTP edge: API key, body and header size limits, before a request reaches a route.

- `GuardMiddleware` (plain ASGI, so handlers still see the client's disconnect) checks the API key
  in constant time on every route but `/health`, `/version` and the `/dashboard` page (its data
  route needs the key; and `/metrics` with `public_metrics`), and answers 413 to a body over the limit, whether it announces its length or
  arrives chunked.
- `GuardedH11Protocol` answers 431 to a request head over the limit (uvicorn's h11 would answer
  400).

A client that is refused while still sending would see its connection reset, not the answer: the
server reads and discards what it sends (up to `DRAIN_BYTES_FACTOR` times the limit, for at most
`DRAIN_SECONDS`) before closing, so the client reads a readable error instead.
"""

from __future__ import annotations

import asyncio
import hmac
import json

from starlette.exceptions import HTTPException
from uvicorn.protocols.http.h11_impl import H11Protocol

from pdserve.frontend.errors import error_body, error_response

OPEN_PATHS = ("/health", "/version", "/dashboard")  # the dashboard page holds no data
DRAIN_BYTES_FACTOR = 4
DRAIN_SECONDS = 5.0


class GuardMiddleware:
    def __init__(
        self, app, api_key: str | None, max_body_bytes: int, public_metrics: bool = False
    ) -> None:
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.max_body_bytes = max_body_bytes
        self.open_paths = (*OPEN_PATHS, "/metrics") if public_metrics else OPEN_PATHS

    def authorized(self, headers: dict[bytes, bytes]) -> bool:
        if self.api_key is None:
            return True
        scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.api_key)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or ())
        if scope["path"] not in self.open_paths and not self.authorized(headers):
            resp = error_response(
                401, "missing or invalid API key (Authorization: Bearer)", code="invalid_api_key"
            )
            return await resp(scope, receive, send)
        length = headers.get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_body_bytes:
            await _drain(receive, DRAIN_BYTES_FACTOR * self.max_body_bytes)
            return await error_response(413, self.too_large, code="request_too_large")(
                scope, receive, send
            )
        received = 0

        async def counting_receive():  # a chunked body has no Content-Length to check
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    if message.get("more_body"):
                        await _drain(receive, DRAIN_BYTES_FACTOR * self.max_body_bytes)
                    # Raised inside the body read: FastAPI lets HTTPExceptions through.
                    raise HTTPException(413, self.too_large)
            return message

        await self.app(scope, counting_receive, send)

    @property
    def too_large(self) -> str:
        return f"request body over the {self.max_body_bytes}-byte limit (--max-body-bytes)"


async def _drain(receive, max_bytes: int) -> None:
    """Read and drop the rest of a refused body, so the client gets to read the answer."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + DRAIN_SECONDS
    drained = 0
    while drained <= max_bytes:
        try:
            message = await asyncio.wait_for(receive(), max(deadline - loop.time(), 0.0))
        except asyncio.TimeoutError:
            return
        if message["type"] != "http.request":
            return
        drained += len(message.get("body", b""))
        if not message.get("more_body"):
            return


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, answering 431 (not 400) to an over-long request head, and
    lingering before it closes so the client can read that answer."""

    def send_400_response(self, msg: str) -> None:
        limit = self.config.h11_max_incomplete_event_size
        head_too_long = limit is not None and len(self.conn.trailing_data[0]) > limit
        if head_too_long:
            status, reason = 431, "Request Header Fields Too Large"
            message = f"request line and headers over the {limit}-byte limit"
        else:
            status, reason = 400, "Bad Request"
            message = "invalid HTTP request"
        body = json.dumps(error_body(status, message)).encode()
        head = (
            f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
        ).encode()
        self.transport.write(head + body)
        self._linger(DRAIN_BYTES_FACTOR * (limit or 65536))

    def _linger(self, max_bytes: int) -> None:
        self._lingering_bytes_left = max_bytes
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.loop.call_later(DRAIN_SECONDS, self.transport.close)

    def data_received(self, data: bytes) -> None:
        left = getattr(self, "_lingering_bytes_left", None)
        if left is None:
            return super().data_received(data)
        self._lingering_bytes_left = left - len(data)
        if self._lingering_bytes_left < 0:
            self.transport.close()
