"""Readers for real serving traces: arrival times and token counts of production requests.

Two formats: the Azure LLM inference CSV (TIMESTAMP, ContextTokens, GeneratedTokens) and the
Mooncake JSONL (timestamp in ms, input_length, output_length, hash_ids naming 512-token prefix
blocks). Both become a list of `TraceRow`s sorted by arrival, with times in seconds since the
first request. Every problem with a file raises `TraceError` with a one-line message.
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from pdserve.bench.errors import BenchError

MOONCAKE_BLOCK_TOKENS = 512  # tokens per hash id in the Mooncake trace
AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
MOONCAKE_KEYS = ("timestamp", "input_length", "output_length")


class TraceError(BenchError):
    """A trace file that cannot be read."""


@dataclass(frozen=True, slots=True)
class TraceRow:
    """One request of a trace: when it arrived and how long its prompt and output were."""

    timestamp_s: float  # seconds since the trace's first request
    input_len: int
    output_len: int
    hash_ids: tuple[int, ...] = ()  # Mooncake: ids of the prompt's 512-token blocks


def read_trace(path: str | Path) -> list[TraceRow]:
    """Read an Azure CSV or a Mooncake JSONL trace, chosen by extension (or by content)."""
    path = Path(path)
    if not path.is_file():
        raise TraceError(f"trace file not found: {path}")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise TraceError(f"{path}: cannot read as text ({e.__class__.__name__})") from None
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json") or (suffix != ".csv" and text.lstrip().startswith("{")):
        rows = parse_mooncake_jsonl(text, str(path))
    else:
        rows = parse_azure_csv(text, str(path))
    if not rows:
        raise TraceError(f"{path}: no requests in the trace")
    return _rebase(rows)


def parse_azure_csv(text: str, name: str = "<csv>") -> list[TraceRow]:
    """Rows of an Azure LLM inference trace; TIMESTAMP is a date-time or a number of seconds."""
    reader = csv.reader(text.splitlines())
    header = [h.strip() for h in next(reader, [])]
    missing = [c for c in AZURE_COLUMNS if c not in header]
    if missing:
        raise TraceError(
            f"{name}: unknown columns {header}: an Azure trace needs {', '.join(AZURE_COLUMNS)}"
        )
    i_ts, i_in, i_out = (header.index(c) for c in AZURE_COLUMNS)
    rows = []
    for line_no, fields in enumerate(reader, start=2):
        if not fields or all(not f.strip() for f in fields):
            continue
        if len(fields) != len(header):
            raise TraceError(
                f"{name}: line {line_no}: {len(fields)} fields, expected {len(header)}"
            )
        where = f"{name}: line {line_no}"
        rows.append(
            TraceRow(
                timestamp_s=_parse_time(fields[i_ts].strip(), where),
                input_len=_parse_count(fields[i_in], "ContextTokens", where),
                output_len=_parse_count(fields[i_out], "GeneratedTokens", where),
            )
        )
    return rows


def parse_mooncake_jsonl(text: str, name: str = "<jsonl>") -> list[TraceRow]:
    """Rows of a Mooncake trace: one JSON object per line, `timestamp` in milliseconds."""
    rows = []
    for line_no, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{name}: line {line_no}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise TraceError(f"{where}: not valid JSON ({e.msg})") from None
        if not isinstance(obj, dict):
            raise TraceError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        missing = [k for k in MOONCAKE_KEYS if k not in obj]
        if missing:
            raise TraceError(
                f"{where}: unknown keys {sorted(obj)}: a Mooncake trace needs "
                f"{', '.join(MOONCAKE_KEYS)} (and hash_ids)"
            )
        hash_ids = obj.get("hash_ids", [])
        if not isinstance(hash_ids, list) or not all(_is_int(h) for h in hash_ids):
            raise TraceError(f"{where}: hash_ids must be a list of integers")
        timestamp = obj["timestamp"]
        if not isinstance(timestamp, (int, float)) or isinstance(timestamp, bool):
            raise TraceError(f"{where}: timestamp={timestamp!r} is not a number (milliseconds)")
        rows.append(
            TraceRow(
                timestamp_s=float(timestamp) / 1000.0,
                input_len=_parse_count(obj["input_length"], "input_length", where),
                output_len=_parse_count(obj["output_length"], "output_length", where),
                hash_ids=tuple(hash_ids),
            )
        )
    return rows


def _rebase(rows: list[TraceRow]) -> list[TraceRow]:
    """Sort by arrival (stable) and measure time from the first request."""
    rows = sorted(rows, key=lambda r: r.timestamp_s)
    t0 = rows[0].timestamp_s
    return [TraceRow(r.timestamp_s - t0, r.input_len, r.output_len, r.hash_ids) for r in rows]


def _parse_time(value: str, where: str) -> float:
    """Seconds from a number, or from an ISO date-time with any number of fraction digits."""
    try:
        return float(value)
    except ValueError:
        pass
    whole, _, frac = value.partition(".")
    try:
        moment = datetime.fromisoformat(whole)
        if moment.tzinfo is None:  # naive times: UTC, so that no daylight-saving jump appears
            moment = moment.replace(tzinfo=timezone.utc)
        seconds = moment.timestamp()
        return seconds + (float("0." + frac) if frac else 0.0)
    except ValueError:
        raise TraceError(f"{where}: TIMESTAMP={value!r} is not a date-time or a number") from None


def _parse_count(value: object, column: str, where: str) -> int:
    if isinstance(value, str):
        try:
            value = int(value.strip())
        except ValueError:
            raise TraceError(f"{where}: {column}={value!r} is not an integer") from None
    if not _is_int(value) or value < 0:
        raise TraceError(f"{where}: {column}={value!r} must be an integer >= 0")
    return int(value)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
