"""Specification of `pdserve.bench.traces`: the shared traces parse; bad files fail clearly."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.bench.errors import BenchError
from pdserve.bench.traces import TraceError, TraceRow, parse_azure_csv, read_trace

TRACES = Path(__file__).resolve().parents[3] / "shared" / "traces"


def shared_trace(name: str) -> Path:
    path = TRACES / name
    if not path.is_file():
        pytest.skip(f"{path} not present")
    return path


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("name", "rows", "first"),
    [
        ("azure_code_2023.csv", 8819, (4808, 10)),
        ("azure_conv_2023.csv", 19366, (374, 44)),
        ("mooncake_conversation.jsonl", 12031, (6758, 500)),
    ],
)
def test_shared_traces_parse_with_their_documented_row_counts(name, rows, first):
    trace = read_trace(shared_trace(name))
    assert len(trace) == rows
    assert (trace[0].input_len, trace[0].output_len) == first
    assert trace[0].timestamp_s == 0.0
    times = [r.timestamp_s for r in trace]
    assert times == sorted(times)
    assert 3000 < times[-1] < 4000  # each trace covers about an hour


def test_azure_timestamps_keep_sub_second_precision():
    trace = read_trace(shared_trace("azure_code_2023.csv"))
    # 18:17:03.9799600 then 18:17:04.0319600
    assert trace[1].timestamp_s == pytest.approx(0.052, abs=1e-6)


def test_mooncake_rows_carry_hash_ids_and_times_in_seconds():
    trace = read_trace(shared_trace("mooncake_conversation.jsonl"))
    assert trace[0].hash_ids[:3] == (0, 1, 2)
    assert len(trace[0].hash_ids) == -(-trace[0].input_len // 512)
    shared = sum(r.hash_ids[:1] == (0,) for r in trace[:10])
    assert shared > 1  # prefix reuse is in the data


def test_mooncake_timestamps_are_milliseconds(tmp_path):
    text = (
        '{"timestamp": 2500, "input_length": 10, "output_length": 2, "hash_ids": [7]}\n'
        '{"timestamp": 500, "input_length": 20, "output_length": 3, "hash_ids": [7, 8]}\n'
    )
    trace = read_trace(write(tmp_path, "t.jsonl", text))
    assert trace == [TraceRow(0.0, 20, 3, (7, 8)), TraceRow(2.0, 10, 2, (7,))]


def test_azure_timestamp_may_be_seconds_and_extra_columns_are_ignored():
    rows = parse_azure_csv("TIMESTAMP,ContextTokens,GeneratedTokens,Note\n1.5,10,3,x\n0.5,4,1,y\n")
    assert [(r.input_len, r.output_len) for r in rows] == [(10, 3), (4, 1)]


def test_format_is_sniffed_from_content_without_a_known_extension(tmp_path):
    path = write(tmp_path, "trace.txt", '{"timestamp": 0, "input_length": 5, "output_length": 1}\n')
    assert read_trace(path) == [TraceRow(0.0, 5, 1, ())]


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("a.csv", "time,prompt,output\n1,2,3\n", "unknown columns"),
        ("a.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n1.0,ten,3\n", "line 2: ContextTokens"),
        ("a.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n1.0,10,-3\n", "GeneratedTokens"),
        ("a.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,10,3\n", "TIMESTAMP"),
        ("a.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n1.0,10\n", "2 fields"),
        ("a.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n", "no requests"),
        ("a.jsonl", "", "no requests"),
        ("a.jsonl", '{"timestamp": 0, "input_length": 5}\n', "unknown keys"),
        ("a.jsonl", '{"timestamp": 0, "input_length": 5, "output_length": 1}\n{oops\n', "line 2"),
        ("a.jsonl", "[1, 2]\n", "expected a JSON object"),
        ("a.jsonl", '{"timestamp": "x", "input_length": 5, "output_length": 1}\n', "timestamp"),
        (
            "a.jsonl",
            '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": 3}\n',
            "hash_ids",
        ),
    ],
)
def test_bad_trace_files_raise_one_line_errors(tmp_path, name, text, message):
    with pytest.raises(TraceError, match=message) as info:
        read_trace(write(tmp_path, name, text))
    assert "\n" not in str(info.value)
    assert isinstance(info.value, BenchError) and isinstance(info.value, ValueError)


def test_missing_and_binary_files_raise_trace_errors(tmp_path):
    with pytest.raises(TraceError, match="not found"):
        read_trace(tmp_path / "missing.csv")
    binary = tmp_path / "blob.csv"
    binary.write_bytes(b"\xff\xfe\x00\x81garbage")
    with pytest.raises(TraceError, match="cannot read as text"):
        read_trace(binary)
