"""One streamed response as it arrives: SSE bytes in, token times and usage on the record."""

from __future__ import annotations

import msgspec

from pdserve.bench.metrics import RequestRecord


class StreamState:
    """Parses SSE bytes as they come: token chunk times, usage, [DONE], error events."""

    def __init__(self, chat: bool) -> None:
        self.chat = chat
        self.buffer = b""
        self.done = False  # saw [DONE]
        self.finished = False  # saw a finish_reason
        self.error: str | None = None
        self.last_read_s: float | None = None

    def feed(self, data: bytes, now: float, record: RequestRecord) -> None:
        self.last_read_s = now
        self.buffer += data
        *lines, self.buffer = self.buffer.split(b"\n")
        for line in lines:
            line = line.strip()
            if not line.startswith(b"data:"):
                continue  # blank separators, comments, event names
            payload = line[5:].strip()
            if payload == b"[DONE]":
                self.done = True
            elif payload:
                self._chunk(msgspec.json.decode(payload), now, record)

    def _chunk(self, chunk: object, now: float, record: RequestRecord) -> None:
        if not isinstance(chunk, dict):
            raise msgspec.DecodeError(f"expected a JSON object, got {chunk!r:.80}")
        if chunk.get("error"):
            self.error = str(chunk["error"])
            return
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            record.prompt_tokens = usage.get("prompt_tokens", record.prompt_tokens)
            record.completion_tokens = usage.get("completion_tokens", record.completion_tokens)
            details = usage.get("prompt_tokens_details")
            if isinstance(details, dict):  # OpenAI's field for prefix-cache hits
                record.cached_tokens = details.get("cached_tokens", record.cached_tokens)
        if isinstance(chunk.get("timings"), dict):  # pdserve's server-side phase timings
            record.server_timings = chunk["timings"]
        has_text = False
        for choice in chunk.get("choices") or []:
            has_text = has_text or bool(self._text(choice))
            self.finished = self.finished or bool(choice.get("finish_reason"))
        if has_text:
            if record.t_first is None:
                record.t_first = now
            record.token_times.append(now)

    def _text(self, choice: dict) -> str | None:
        if not self.chat:
            return choice.get("text")
        delta = choice.get("delta") or {}
        return delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning")
