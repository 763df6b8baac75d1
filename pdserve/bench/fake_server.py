"""A scripted OpenAI-compatible streaming server with known delays: the benchmark's test target.

It answers /v1/completions and /v1/chat/completions with `max_tokens` one-word SSE chunks, the
first after `ttft_s` and each next one `itl_s` after the previous, then a `usage` chunk when the
request asks for it, then [DONE]. `faults` makes the n-th POST (0-based) fail: `http500`,
`http400`, `drop` (close before answering) or `drop_mid` (close after the first token). Plain
asyncio HTTP/1.1, so it starts in milliseconds, in a thread or as `python -m` with a port.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time
from dataclasses import dataclass, field

FAULTS = ("http500", "http400", "drop", "drop_mid")


@dataclass
class FakeServerConfig:
    ttft_s: float = 0.02
    itl_s: float = 0.005
    model: str = "fake-model"
    model_root: str | None = None  # reported as `root` in /v1/models (a tokenizer folder)
    faults: dict[int, str] = field(default_factory=dict)  # POST ordinal -> one of FAULTS
    send_usage: bool = True  # False: never send `usage`, even when asked

    def __post_init__(self) -> None:
        bad = {k: v for k, v in self.faults.items() if v not in FAULTS}
        if bad:
            raise ValueError(f"faults={bad!r}: each must be one of {FAULTS}")


class FakeServer:
    """Runs the fake server on its own event loop in a background thread."""

    def __init__(self, config: FakeServerConfig | None = None, host: str = "127.0.0.1") -> None:
        self.config = config or FakeServerConfig()
        self.host = host
        self.port = 0
        self.bodies: list[dict] = []  # every POST body received, in arrival order
        self.num_finished = 0  # streams sent to the end
        self._loop = asyncio.new_event_loop()
        self._thread: threading.Thread | None = None
        self._server: asyncio.AbstractServer | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, port: int = 0) -> FakeServer:
        started = threading.Event()
        failure: list[OSError] = []

        def main() -> None:
            asyncio.set_event_loop(self._loop)
            try:
                self._server = self._loop.run_until_complete(
                    asyncio.start_server(self._handle, self.host, port)
                )
            except OSError as e:  # port taken: reported by start(), in the caller's thread
                failure.append(e)
                started.set()
                return
            self.port = self._server.sockets[0].getsockname()[1]
            started.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=main, name="fake-openai-server", daemon=True)
        self._thread.start()
        started.wait(10)
        if failure:
            self._thread = None
            raise failure[0]
        return self

    def stop(self) -> None:
        if self._thread is None:
            return

        async def shutdown() -> None:
            self._server.close()
            for task in asyncio.all_tasks():
                if task is not asyncio.current_task():
                    task.cancel()

        asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._thread = None

    def __enter__(self) -> FakeServer:
        return self.start() if self._thread is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                request_line, *header_lines = head.decode("latin-1").split("\r\n")
                method, path, _ = request_line.split(" ", 2)
                headers = {}
                for line in header_lines:
                    key, _, value = line.partition(":")
                    headers[key.strip().lower()] = value.strip()
                body = await reader.readexactly(int(headers.get("content-length", 0)))
                if not await self._respond(method, path, body, writer):
                    break
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            pass
        except asyncio.CancelledError:  # shutting down: end quietly, this task is the top
            pass
        finally:
            writer.close()

    async def _respond(
        self, method: str, path: str, body: bytes, writer: asyncio.StreamWriter
    ) -> bool:
        """Answer one request; False when the connection must close."""
        if method == "GET" and path == "/health":
            return await _send_json(writer, 200, {"status": "ok"})
        if method == "GET" and path == "/v1/models":
            card = {"id": self.config.model, "object": "model", "root": self.config.model_root}
            return await _send_json(writer, 200, {"object": "list", "data": [card]})
        if method != "POST" or path not in ("/v1/completions", "/v1/chat/completions"):
            return await _send_json(writer, 404, {"error": {"message": f"no route {path}"}})
        ordinal = len(self.bodies)
        request = json.loads(body or b"{}")
        self.bodies.append(request)
        fault = self.config.faults.get(ordinal)
        if fault == "drop":
            writer.transport.abort()
            return False
        if fault in ("http500", "http400"):
            status = int(fault[4:])
            return await _send_json(writer, status, {"error": {"message": f"injected {fault}"}})
        return await self._stream(request, path.endswith("chat/completions"), fault, writer)

    async def _stream(
        self, request: dict, chat: bool, fault: str | None, writer: asyncio.StreamWriter
    ) -> bool:
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\nConnection: keep-alive\r\n\r\n"
        )
        num_tokens = int(request.get("max_tokens") or 16)
        loop = asyncio.get_running_loop()
        start = loop.time()
        for i in range(num_tokens):
            # Absolute deadlines: sleep overshoot does not add up, so the mean gap is itl_s.
            deadline = start + self.config.ttft_s + i * self.config.itl_s
            await asyncio.sleep(max(0.0, deadline - loop.time()))
            finish = "length" if i == num_tokens - 1 else None
            await _send_event(writer, _token_chunk(chat, f" w{i}", finish))
            if fault == "drop_mid":
                writer.transport.abort()
                return False
        options = request.get("stream_options") or {}
        if self.config.send_usage and options.get("include_usage"):
            prompt = request.get("prompt") or "".join(
                m.get("content", "") for m in request.get("messages", [])
            )
            usage = {
                "prompt_tokens": len(str(prompt).split()) + 1,
                "completion_tokens": num_tokens,
                "total_tokens": len(str(prompt).split()) + 1 + num_tokens,
            }
            await _send_event(writer, {"choices": [], "usage": usage})
        writer.write(_http_chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
        await writer.drain()
        self.num_finished += 1
        return True


def _token_chunk(chat: bool, text: str, finish: str | None) -> dict:
    if chat:
        choice = {"index": 0, "delta": {"content": text}, "finish_reason": finish}
        return {"object": "chat.completion.chunk", "created": int(time.time()), "choices": [choice]}
    choice = {"index": 0, "text": text, "finish_reason": finish}
    return {"object": "text_completion", "created": int(time.time()), "choices": [choice]}


def _http_chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


async def _send_event(writer: asyncio.StreamWriter, obj: dict) -> None:
    writer.write(_http_chunk(b"data: " + json.dumps(obj).encode() + b"\n\n"))
    await writer.drain()


async def _send_json(writer: asyncio.StreamWriter, status: int, obj: dict) -> bool:
    body = json.dumps(obj).encode()
    reason = {200: "OK", 400: "Bad Request", 404: "Not Found", 500: "Internal Server Error"}
    writer.write(
        f"HTTP/1.1 {status} {reason.get(status, 'Error')}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    await writer.drain()
    return True


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="a fake OpenAI-compatible streaming server")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--ttft-ms", type=float, default=20.0)
    parser.add_argument("--itl-ms", type=float, default=5.0)
    parser.add_argument("--model", default="fake-model")
    parser.add_argument("--model-root", help="folder reported as the model's root (tokenizer)")
    args = parser.parse_args(argv)
    config = FakeServerConfig(
        ttft_s=args.ttft_ms / 1000,
        itl_s=args.itl_ms / 1000,
        model=args.model,
        model_root=args.model_root,
    )
    server = FakeServer(config, args.host).start(args.port)
    print(f"fake server listening on {server.url}", flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        server.stop()


if __name__ == "__main__":
    main()
