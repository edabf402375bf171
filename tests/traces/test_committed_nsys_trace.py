"""Layer 1 (CPU): a real Nsight Systems report of a 2-GPU DBO step (`dbo trace --profiler
nsys` under `nsys profile`, exported to SQLite), committed under traces/data/, re-analyzed.

The analyzer must reproduce the recorded metrics for both GPUs; the main ones are
re-derived here from the SQLite tables with a separate, plain method (each rank's kernels
launched inside its own `step/0` NVTX range, unions by sort-and-sweep); dbo's NVTX
ranges must be present for both ubatches and both layers of each rank, each one closed;
and the two ranks' capture windows must agree (`traces.alignment`).
"""
from __future__ import annotations

import gzip
import json
import re
import shutil
import sqlite3
from collections import Counter, defaultdict
from pathlib import Path

import pytest

from traces.alignment import ALIGN_TOLERANCE
from traces.analyze import analyze
from traces.readers import read_trace
from tests.traces.test_committed_traces import union_us

DATA = Path(__file__).resolve().parents[2] / "traces" / "data"
TRACE = DATA / "h100x2_a2a_T4096_nsys.sqlite.gz"
EXPECTED = json.loads((DATA / "h100x2_a2a_T4096_nsys_expected.json").read_text())["devices"]
PID = lambda global_id: (int(global_id) >> 24) & 0xFFFFFF  # noqa: E731 (Nsight's id layout)


@pytest.fixture(scope="module")
def db(tmp_path_factory: pytest.TempPathFactory) -> sqlite3.Connection:
    path = tmp_path_factory.mktemp("nsys") / "trace.sqlite"
    with gzip.open(TRACE, "rb") as src, path.open("wb") as dst:
        shutil.copyfileobj(src, dst)
    return sqlite3.connect(path)


def nvtx_ranges(db: sqlite3.Connection) -> list[tuple[str, int, int | None, int]]:
    """(name, start ns, end ns, process id) of every NVTX range with a name."""
    strings = dict(db.execute("SELECT id, value FROM StringIds"))
    rows = db.execute("SELECT text, textId, start, end, globalTid FROM NVTX_EVENTS").fetchall()
    return [(text or strings.get(text_id), start, end, PID(tid))
            for text, text_id, start, end, tid in rows if (text or text_id)]


def raw_kernels(db: sqlite3.Connection) -> tuple[dict[int, list[tuple[int, int, str]]],
                                                 dict[int, list[int]]]:
    """Per device: (start ns, end ns, name) of its kernels, and the starts and ends of its
    kernels, copies and memsets, each launched inside its own rank's `step/0` range."""
    strings = dict(db.execute("SELECT id, value FROM StringIds"))
    steps = {pid: (s, e) for name, s, e, pid in nvtx_ranges(db) if name == "step/0"}
    launches = {(PID(tid), corr): start for start, tid, corr in
                db.execute("SELECT start, globalTid, correlationId FROM CUPTI_ACTIVITY_KIND_RUNTIME")}
    per_device: dict[int, list[tuple[int, int, str]]] = defaultdict(list)
    extent: dict[int, list[int]] = defaultdict(list)  # of kernels, copies and memsets
    for table, name in (("KERNEL", "demangledName"), ("MEMCPY", "NULL"), ("MEMSET", "NULL")):
        for start, end, device, pid, corr, name_id in db.execute(
                f"SELECT start, end, deviceId, globalPid, correlationId, {name} "
                f"FROM CUPTI_ACTIVITY_KIND_{table}"):
            lo, hi = steps[PID(pid)]
            if lo <= launches[(PID(pid), corr)] <= hi:
                extent[device] += [start, end]
                if name_id is not None:
                    per_device[device].append((start, end, strings[name_id]))
    return per_device, extent


def raw_metrics(db: sqlite3.Connection) -> dict[str, dict[str, float]]:
    per_device, extent = raw_kernels(db)
    out = {}
    for device, kernels in per_device.items():
        comm = [(s / 1e3, e / 1e3) for s, e, n in kernels if "nccl" in n.lower()]
        compute = [(s / 1e3, e / 1e3) for s, e, n in kernels if "nccl" not in n.lower()]
        both = union_us(comm) + union_us(compute) - union_us(comm + compute)
        out[str(device)] = {"wall_us": (max(extent[device]) - min(extent[device])) / 1e3,
                            "comm_us": union_us(comm), "compute_busy_us": union_us(compute),
                            "comm_overlapped_us": both}
    return out


def test_nsys_trace_reproduces_recorded_metrics() -> None:
    report = analyze(read_trace(TRACE)).to_json()
    assert sorted(report["devices"]) == sorted(EXPECTED) == ["0", "1"]
    for device, want in EXPECTED.items():
        got = report["devices"][device]
        for key in ("wall_us", "compute_busy_us", "comm_us", "comm_overlapped_us",
                    "comm_exposed_us", "overlap_fraction", "num_kernels"):
            assert got[key] == pytest.approx(want[key], abs=0.01), (device, key)
        assert sorted(got["phases"]) == want["ubatches"]
        assert got["phase_source"] == "cpu"


def test_nsys_metrics_rederived_from_the_sqlite_tables(db: sqlite3.Connection) -> None:
    raw = raw_metrics(db)
    assert sorted(raw) == sorted(EXPECTED)
    for device, metrics in raw.items():
        for key, value in metrics.items():
            assert value == pytest.approx(EXPECTED[device][key], abs=1.0), (device, key)


def test_each_rank_has_closed_nvtx_ranges_for_both_ubatches_and_layers(
        db: sqlite3.Connection) -> None:
    phase = re.compile(r"^ub([01])/L(\d+)/(\w+)$")
    counts: dict[int, Counter] = defaultdict(Counter)
    for name, start, end, pid in nvtx_ranges(db):
        match = phase.match(name)
        if match:
            assert end is not None and end >= start, name  # a start/end range, closed
            counts[pid][match.groups()] += 1
    assert len(counts) == 2  # one process per GPU
    moe_phases = ("attention", "router", "dispatch_send", "dispatch_recv", "experts",
                  "combine_send", "combine_recv", "shared_experts")
    for per_rank in counts.values():
        for ub in "01":
            assert per_rank[(ub, "0", "attention")] == 1  # layer 0 is dense
            for name in moe_phases:
                assert per_rank[(ub, "1", name)] == 1, (ub, name)
        # The last MoE layer's last ubatch computes its own rows after sending the rest.
        assert per_rank[("1", "1", "own_experts")] == 1
    # Per rank, the analyzer's phases come from that rank's own ranges only.
    report = analyze(read_trace(TRACE)).to_json()["devices"]
    assert report["0"]["phases"] != report["1"]["phases"]


def test_both_ranks_capture_windows_agree(db: sqlite3.Connection) -> None:
    """The two ranks ran one step together, so their windows (each device's kernels
    launched inside its rank's step range) cover the same time: rank 1 entered 2.3 ms
    after rank 0 (this capture had no barrier before the step; rank 0's first collective
    waited for it), they ended 0.5 ms apart, on 30.5- and 32.3-ms windows. The analyzer
    must find those windows and call them aligned: within ALIGN_TOLERANCE (a quarter) of
    the shorter window, which its docstring justifies."""
    _, extent = raw_kernels(db)
    raw = {f"device {d}": (min(e) / 1e3, max(e) / 1e3) for d, e in extent.items()}
    report = analyze(read_trace(TRACE))
    windows = report.windows
    assert windows is not None and sorted(windows.windows) == sorted(raw) == ["device 0", "device 1"]
    for name, (start, end) in raw.items():  # the same windows, to the nanosecond of the export
        assert (windows.windows[name].start, windows.windows[name].end) == \
            (pytest.approx(start, abs=1e-3), pytest.approx(end, abs=1e-3))
    starts = [s for s, _ in raw.values()]
    ends = [e for _, e in raw.values()]
    shortest = min(e - s for s, e in raw.values())
    assert windows.start_spread_us == pytest.approx(max(starts) - min(starts), abs=1e-3)
    assert windows.end_spread_us == pytest.approx(max(ends) - min(ends), abs=1e-3)
    assert max(windows.start_spread_us, windows.end_spread_us) <= ALIGN_TOLERANCE * shortest
    assert windows.aligned and not report.misaligned
    assert "WARNING" not in report.format_table()
