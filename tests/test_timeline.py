"""Layer: CPU unit tests of traces.timeline — the timeline PNG from Chrome and Nsight traces."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("matplotlib")

from tests.test_analyze import gpu_label, kernel, write_chrome, write_nsys_sqlite  # noqa: E402
from traces.analyze import AnalyzeConfig, analyze  # noqa: E402
from traces.classify import ClassifyConfig  # noqa: E402
from traces.readers import read_trace  # noqa: E402
from traces.timeline import draw_timeline  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def dbo_like_events(num_layers: int = 3) -> list[dict[str, Any]]:
    """Two GPUs, two ubatches per layer: attention/experts on stream 7, a2a on stream 13."""
    events: list[dict[str, Any]] = []
    for dev in (0, 1):
        t = 0.0
        events.append(gpu_label("ProfilerStep#1", 0, 40 * 4 * num_layers + 40, pid=dev))
        for layer in range(num_layers):
            for ub in (0, 1):
                other = 1 - ub
                events.append(gpu_label(f"ub{ub}/L{layer}/attention", t, 30, pid=dev))
                events.append(kernel("flash_attn_fwd", t, 30, pid=dev))
                # The other ubatch's dispatch runs beside this attention, 10 us of it exposed.
                events.append(gpu_label(f"ub{other}/L{layer}/dispatch_recv", t + 5, 35, pid=dev, tid=13))
                events.append(kernel("ncclDevKernel_AllToAll", t + 5, 35, pid=dev, tid=13))
                events.append(gpu_label(f"ub{ub}/L{layer}/experts", t + 40, 40, pid=dev))
                events.append(kernel("fused_moe_kernel", t + 40, 40, pid=dev))
                t += 80
    return events


def test_png_from_chrome_trace(tmp_path: Path) -> None:
    import matplotlib

    backend = matplotlib.get_backend()
    trace = read_trace(write_chrome(tmp_path / "dbo.json", dbo_like_events()))
    report = analyze(trace)
    out = draw_timeline(trace, tmp_path / "pics" / "dbo.png", report=report, title="synthetic DBO, 2 GPUs")
    data = out.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 10_000
    assert matplotlib.get_backend() == backend  # the Agg canvas is used directly
    assert report.devices[0].comm_exposed_us > 0


def test_png_from_nsys_sqlite_and_without_report(tmp_path: Path) -> None:
    trace = read_trace(write_nsys_sqlite(tmp_path / "t.sqlite"))
    out = draw_timeline(trace, tmp_path / "nsys.png")
    assert out.read_bytes()[:8] == PNG_MAGIC
    report = analyze(trace, AnalyzeConfig(classify=ClassifyConfig(comm_patterns=())))
    assert draw_timeline(trace, tmp_path / "no_comm.png", report=report).stat().st_size > 1000


def test_png_of_a_trace_without_kernels(tmp_path: Path) -> None:
    trace = read_trace(write_chrome(tmp_path / "empty.json", [gpu_label("ub0/L0/attention", 0, 5)]))
    assert draw_timeline(trace, tmp_path / "empty.png").read_bytes()[:8] == PNG_MAGIC


def test_missing_matplotlib_gives_install_hint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    trace = read_trace(write_chrome(tmp_path / "t.json", [kernel("gemm", 0, 1)]))
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ImportError, match=r"pip install dbo-runtime\[plot\]"):
        draw_timeline(trace, tmp_path / "t.png")
