"""Layer 1 (CPU): traces.alignment — the capture windows of the devices of one trace, and
the misaligned-capture warning of the analyzer's table and `dbo inspect`. (The committed
two-GPU Nsight report's windows are checked in test_committed_nsys_trace.py.)"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.traces.test_analyze import gpu_label, kernel, write_chrome
from traces.alignment import ALIGN_TOLERANCE, capture_windows
from traces.analyze import analyze, main
from traces.intervals import Span
from traces.readers import read_trace

STEP_US = 52_000.0
EARLY_US = 3_200_000.0


def test_windows_within_the_tolerance_agree_and_beyond_it_do_not() -> None:
    shortest = 100.0
    limit = ALIGN_TOLERANCE * shortest
    at_limit = capture_windows({"device 0": Span(0, shortest),
                                "device 1": Span(limit, limit + shortest)})
    assert at_limit.start_spread_us == limit and at_limit.end_spread_us == limit
    assert at_limit.shortest_us == shortest and at_limit.aligned
    beyond = capture_windows({"device 0": Span(0, shortest),
                              "device 1": Span(-limit - 1, shortest)})
    assert beyond.start_spread_us == limit + 1 and beyond.end_spread_us == 0
    assert not beyond.aligned
    assert "device 1 started" in beyond.verdict() and "before device 0" in beyond.verdict()
    assert capture_windows({"device 0": Span(0, 1)}) is None  # one device: nothing to compare
    with pytest.raises(ValueError, match="tolerance=-0.1"):
        capture_windows({"a": Span(0, 1), "b": Span(0, 1)}, tolerance=-0.1)


def misaligned_pair(early_us: float = EARLY_US) -> list[dict[str, Any]]:
    """Two GPUs of one trace running the same 52-ms step; GPU 1's rank entered the
    capture ``early_us`` before GPU 0's: its step label opens then, and its first
    collective (the vote) waits for GPU 0 until GPU 0's step starts."""
    events: list[dict[str, Any]] = []
    for device, enter in ((0, early_us), (1, 0.0)):
        start = early_us  # where the ranks meet: both steps run from here on
        events.append(gpu_label("step/0", enter, start + STEP_US - enter, pid=device))
        events.append(kernel("ncclDevKernel_AllReduce", enter, start - enter + 50, pid=device,
                             tid=20))  # the vote
        for i in range(10):  # attention and experts beside a dispatch, 5 ms a layer
            t = start + 100 + i * 5_000
            events.append(kernel("gemm", t, 4_000, pid=device))
            events.append(kernel("ncclDevKernel_AllToAll", t + 1_000, 3_500, pid=device, tid=13))
    return events


def test_a_misaligned_pair_is_flagged(tmp_path: Path) -> None:
    report = analyze(read_trace(write_chrome(tmp_path / "t.json", misaligned_pair())))
    windows = report.windows
    assert windows is not None and report.misaligned
    assert windows.start_spread_us == EARLY_US
    assert windows.shortest_us == pytest.approx(STEP_US)
    # The early device's overlap is diluted by its vote's wait: the reason for the flag.
    assert report.devices[1].wall_us == pytest.approx(EARLY_US + STEP_US)
    assert report.devices[1].overlap_fraction < 0.5 * report.devices[0].overlap_fraction
    verdict = windows.verdict()
    assert verdict.startswith("misaligned capture")
    assert "device 1 started 3.2 s before device 0" in verdict
    assert "barrier" in verdict and "warm" in verdict
    assert report.to_json()["capture_windows"]["aligned"] is False
    table = report.format_table()
    assert "WARNING: misaligned capture" in table
    # Shifted to start together, the same pair agrees.
    aligned = analyze(read_trace(write_chrome(tmp_path / "a.json", misaligned_pair(early_us=0.0))))
    assert aligned.windows is not None and not aligned.misaligned
    assert "WARNING" not in aligned.format_table()


def test_dbo_inspect_warns_when_it_shows_the_overlap_of_a_misaligned_capture(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(write_chrome(tmp_path / "t.json", misaligned_pair()))]) == 0
    out, err = capsys.readouterr()
    assert "misaligned capture" in err and "t.json" in err
    assert "WARNING: misaligned capture" in out  # in the table beside the overlap figures
    final = json.loads(out.strip().splitlines()[-1])
    assert final["capture_windows"]["aligned"] is False
    assert main([str(write_chrome(tmp_path / "a.json", misaligned_pair(early_us=0.0)))]) == 0
    out, err = capsys.readouterr()
    assert "misaligned" not in err and "capture windows agree" in out
