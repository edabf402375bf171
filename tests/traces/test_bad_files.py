"""Layer 1 (CPU): `dbo inspect` (traces.analyze.main) on malformed trace files. Each one
ends in one error line naming the file (exit 2), or is analyzed with what was skipped
said in the report's notes; a gzip-compressed file unpacks only up to a limit, so memory
stays bounded; --json and --png never overwrite the trace and never end in a traceback.
"""
from __future__ import annotations

import gzip
import json
import math
import sqlite3
import tracemalloc
from pathlib import Path
from typing import Any

import pytest

from traces.analyze import main
from traces.readers import ReadConfig, read_trace


def event(name: str = "gemm", ts: Any = 0.0, dur: Any = 10.0, *, cat: str = "kernel",
          tid: Any = 7, args: Any = None) -> dict[str, Any]:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": tid,
            "args": {} if args is None else args}


def write(path: Path, events: list[Any]) -> Path:
    path.write_text(json.dumps({"traceEvents": events}))  # NaN/Infinity as JSON's extension
    return path


def inspect(capsys: pytest.CaptureFixture[str], *argv: Any) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def one_error_line(err: str, *parts: str) -> None:
    assert err.startswith("error: ") and err.count("\n") == 1, err
    for part in parts:
        assert part in err, err


def report(out: str) -> dict[str, Any]:
    return json.loads(out.strip().splitlines()[-1])


# ------------------------------------------------------------- Chrome events, skipped
@pytest.mark.parametrize("bad", [
    event(args=[1, 2]),                                   # args a list
    event(args="correlation"),                            # args a string
    event("cudaLaunchKernel", cat="cuda_runtime", args="correlation"),
    event(ts="abc"), event(dur=[1]), event(ts=True),      # not numbers
    event(args={"correlation": "abc"}),                   # a correlation that is no id
], ids=["args-list", "args-str", "runtime-args-str", "ts-str", "dur-list", "ts-bool",
        "correlation-str"])
def test_a_malformed_event_is_skipped_and_counted(tmp_path, capsys, bad):
    path = write(tmp_path / "t.json", [event("gemm", 0.0, 10.0), bad, event("gemm", 20.0, 5.0)])
    code, out, err = inspect(capsys, path)
    assert code == 0, err
    rep = report(out)
    assert rep["devices"]["0"]["compute_busy_us"] == 15.0
    assert any(n.startswith("skipped 1 of 3 complete events") for n in rep["notes"]), rep
    assert "note: skipped 1 of 3 complete events" in out


@pytest.mark.parametrize("ts, dur, reason", [
    (math.nan, 10.0, "not a finite number"), (math.inf, 10.0, "not a finite number"),
    (5.0, -math.inf, "not a finite number"), (5.0, -4.0, "a negative duration"),
], ids=["ts-nan", "ts-inf", "dur-minus-inf", "dur-negative"])
def test_non_finite_times_and_negative_durations_are_skipped_and_said(tmp_path, capsys, ts, dur,
                                                                      reason):
    path = write(tmp_path / "t.json", [event("gemm", 0.0, 10.0), event("gemm", ts, dur),
                                       event("gemm", 20.0, 5.0)])
    code, out, err = inspect(capsys, path)
    assert code == 0, err
    rep = report(out)
    device = rep["devices"]["0"]
    assert device["wall_us"] == 25.0 and device["compute_busy_us"] == 15.0
    assert device["num_kernels"] == 2
    assert any(n.startswith("skipped 1 of 3 complete events") and reason in n
               for n in rep["notes"]), rep["notes"]


def test_a_trace_of_only_bad_events_has_nothing_to_analyze(tmp_path, capsys):
    path = write(tmp_path / "t.json", [event(ts=math.nan), event(dur=-1.0)])
    code, out, err = inspect(capsys, path)
    assert code == 1
    assert "skipped 2 of 2 complete events" in out and "nothing to analyze" in err


# --------------------------------------------------------- unreadable files: one line
def test_deeply_nested_json_is_one_error_line(tmp_path, capsys):
    path = tmp_path / "deep.json"
    path.write_text('{"traceEvents": ' + "[" * 100_000 + "]" * 100_000 + "}")
    code, _, err = inspect(capsys, path)
    assert code == 2
    one_error_line(err, "deep.json", "nested too deeply")


def _truncated_gzip(path: Path, payload: bytes) -> Path:
    packed = gzip.compress(payload)
    path.write_bytes(packed[: len(packed) // 2])
    return path


def test_a_truncated_json_gz_is_one_error_line(tmp_path, capsys):
    payload = json.dumps({"traceEvents": [event(ts=float(i)) for i in range(2000)]}).encode()
    path = _truncated_gzip(tmp_path / "t.json.gz", payload)
    code, _, err = inspect(capsys, path)
    assert code == 2
    one_error_line(err, "t.json.gz", "truncated")


def _sqlite(path: Path, *statements: str) -> Path:
    db = sqlite3.connect(path)
    for statement in statements:
        db.execute(statement)
    db.commit()
    db.close()
    return path


KERNEL_TABLE = ("CREATE TABLE CUPTI_ACTIVITY_KIND_KERNEL (start INT, end INT, deviceId INT, "
                "streamId INT, shortName)")


def test_a_truncated_sqlite_gz_is_one_error_line(tmp_path, capsys):
    rows = [f"INSERT INTO CUPTI_ACTIVITY_KIND_KERNEL VALUES ({i}, {i + 500}, 0, 7, 'k{i}')"
            for i in range(0, 2_000_000, 1000)]
    raw = _sqlite(tmp_path / "t.sqlite", KERNEL_TABLE, *rows).read_bytes()
    path = _truncated_gzip(tmp_path / "t.sqlite.gz", raw)
    code, _, err = inspect(capsys, path)
    assert code == 2
    one_error_line(err, "t.sqlite.gz", "truncated")


def test_a_string_table_with_other_columns_is_one_error_line(tmp_path, capsys):
    path = _sqlite(tmp_path / "t.sqlite", "CREATE TABLE StringIds (a INT, b TEXT)", KERNEL_TABLE,
                   "INSERT INTO CUPTI_ACTIVITY_KIND_KERNEL VALUES (0, 4000, 0, 7, 1)")
    code, _, err = inspect(capsys, path)
    assert code == 2
    one_error_line(err, "t.sqlite", "StringIds", "(a, b)", "(id, value)")


def test_nsys_rows_with_bad_times_are_skipped_and_counted(tmp_path, capsys):
    path = _sqlite(tmp_path / "t.sqlite", KERNEL_TABLE,
                   "INSERT INTO CUPTI_ACTIVITY_KIND_KERNEL VALUES (0, 10000, 0, 7, 'gemm')",
                   "INSERT INTO CUPTI_ACTIVITY_KIND_KERNEL VALUES (9000, 4000, 0, 7, 'gemm')",
                   "INSERT INTO CUPTI_ACTIVITY_KIND_KERNEL VALUES ('abc', 4000, 0, 7, 'gemm')",
                   "INSERT INTO CUPTI_ACTIVITY_KIND_KERNEL VALUES (20000, 25000, 'x', 7, 'g')")
    code, out, err = inspect(capsys, path)
    assert code == 0, err
    rep = report(out)
    assert rep["devices"]["0"]["compute_busy_us"] == 10.0
    note = next(n for n in rep["notes"] if "CUPTI_ACTIVITY_KIND_KERNEL" in n)
    assert note.startswith("skipped 3 of 4 rows of CUPTI_ACTIVITY_KIND_KERNEL"), note
    assert "a negative duration" in note and "not a finite number" in note and \
        "not an integer" in note, note


# ------------------------------------------------------------------ the unpacked limit
def test_a_gzip_bomb_is_refused_with_bounded_memory(tmp_path, capsys):
    path = tmp_path / "bomb.json.gz"
    path.write_bytes(gzip.compress(b" " * (64 << 20), compresslevel=9))  # 64 MiB of spaces
    assert path.stat().st_size < (1 << 20)
    limit = 4 << 20
    tracemalloc.start()
    try:
        with pytest.raises(ValueError) as exc:
            read_trace(path, config=ReadConfig(max_unpacked_bytes=limit))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert "bomb.json.gz" in str(exc.value) and "more than 4 MiB" in str(exc.value)
    # Unpacked in chunks and stopped past the limit: the peak is the limit plus the
    # unpacker's buffers (about 4 MiB, measured for limits of 1 to 32 MiB), not the
    # 64 MiB the file unpacks to.
    assert peak < limit + (8 << 20), peak
    code, _, err = inspect(capsys, path, "--max-unpacked-mb", 4)
    assert code == 2
    one_error_line(err, "bomb.json.gz", "--max-unpacked-mb")
    assert ReadConfig().max_unpacked_bytes < (64 << 20) * 16  # a 1 MB bomb is refused too


def test_the_limit_applies_to_a_gzipped_sqlite_export(tmp_path, capsys):
    rows = [f"INSERT INTO CUPTI_ACTIVITY_KIND_KERNEL VALUES ({i}, {i + 500}, 0, 7, "
            f"'{'k' * 100}{i}')" for i in range(0, 20_000_000, 1000)]
    raw = _sqlite(tmp_path / "t.sqlite", KERNEL_TABLE, *rows).read_bytes()
    assert len(raw) > (1 << 20)
    path = tmp_path / "t.sqlite.gz"
    path.write_bytes(gzip.compress(raw))
    code, _, err = inspect(capsys, path, "--max-unpacked-mb", 1)
    assert code == 2
    one_error_line(err, "t.sqlite.gz", "more than 1 MiB", "--max-unpacked-mb")
    code, out, err = inspect(capsys, path)
    assert code == 0 and report(out)["devices"]["0"]["num_kernels"] == len(rows), err


@pytest.mark.parametrize("value", ["0", "-3", "abc"])
def test_a_bad_limit_is_refused(tmp_path, capsys, value):
    path = write(tmp_path / "t.json", [event()])
    with pytest.raises(SystemExit) as info:
        main([str(path), "--max-unpacked-mb", value])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"argument --max-unpacked-mb: {value!r}: must be an int >= 1" in err, err


# ---------------------------------------------------------------------- --json, --png
def test_json_over_an_existing_file_replaces_it_with_a_note(tmp_path, capsys):
    path = write(tmp_path / "t.json", [event()])
    old = tmp_path / "report.json"
    old.write_text("old")
    code, out, err = inspect(capsys, path, "--json", old)
    assert code == 0, err
    assert json.loads(old.read_text()) == report(out)
    assert f"note: --json {old}: replaced the existing file" in err


@pytest.mark.parametrize("option", ["--json", "--png"])
def test_an_output_that_is_the_trace_is_refused(tmp_path, capsys, option):
    path = write(tmp_path / "t.json", [event()])
    before = path.read_bytes()
    code, _, err = inspect(capsys, path, option, tmp_path / "." / "t.json")
    assert code == 2
    one_error_line(err, option, "is the trace being read")
    assert path.read_bytes() == before


@pytest.mark.parametrize("option", ["--json", "--png"])
def test_an_output_that_cannot_be_written_is_one_error_line(tmp_path, capsys, option):
    path = write(tmp_path / "t.json", [event()])
    code, _, err = inspect(capsys, path, option, tmp_path)
    assert code == 2
    one_error_line(err, option, "is a folder")
    code, _, err = inspect(capsys, path, option, path / "out.json")
    assert code == 2
    one_error_line(err, option, "is a file, not a folder")
