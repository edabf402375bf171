"""Layer 1 (CPU): unit tests of traces.timeline — the timeline PNG from Chrome and Nsight traces."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("matplotlib")

from tests.traces.test_analyze import cpu_label, gpu_label, kernel, write_chrome, write_nsys_sqlite  # noqa: E402
from traces.analyze import AnalyzeConfig, analyze  # noqa: E402
from traces.classify import ClassifyConfig  # noqa: E402
from traces.model import Trace  # noqa: E402
from traces.readers import read_trace  # noqa: E402
from traces.intervals import Span, intersect  # noqa: E402
from traces.timeline import build_timeline, draw_timeline, phase_bars  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _timeline(trace: Trace) -> Any:
    """The figure, with the default analysis supplying the report."""
    return build_timeline(trace, report=analyze(trace))


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


def test_png_from_nsys_sqlite(tmp_path: Path) -> None:
    trace = read_trace(write_nsys_sqlite(tmp_path / "t.sqlite"))
    out = draw_timeline(trace, tmp_path / "nsys.png", report=analyze(trace))
    assert out.read_bytes()[:8] == PNG_MAGIC
    report = analyze(trace, AnalyzeConfig(classify=ClassifyConfig(comm_patterns=())))
    assert draw_timeline(trace, tmp_path / "no_comm.png", report=report).stat().st_size > 1000


def test_png_of_a_trace_without_kernels(tmp_path: Path) -> None:
    trace = read_trace(write_chrome(tmp_path / "empty.json", [gpu_label("ub0/L0/attention", 0, 5)]))
    assert draw_timeline(trace, tmp_path / "empty.png", report=analyze(trace)).read_bytes()[:8] == PNG_MAGIC


def test_missing_matplotlib_gives_install_hint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    trace = read_trace(write_chrome(tmp_path / "t.json", [kernel("gemm", 0, 1)]))
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ImportError, match=r"pip install dbo-runtime\[plot\]"):
        draw_timeline(trace, tmp_path / "t.png", report=analyze(trace))


def shifted(events: list[dict[str, Any]], offset: float) -> list[dict[str, Any]]:
    """The same events on a clock that starts at ``offset`` us (profiler clocks do)."""
    return [dict(e, ts=e["ts"] + offset) for e in events]


def paused_cpu_events(offset: float = 0.0) -> list[dict[str, Any]]:
    """A CPU trace of one thread: ub0's dispatch_send stays open (30..80) while ub1 runs
    (40..70); the scheduler's run ranges say who held the thread."""
    ops = [kernel(f"aten::op{i}", 10 * i, 8, pid=77, tid=78, cat="cpu_op") for i in range(10)]
    return shifted(ops + [
        cpu_label("step/0", 0, 100, tid=78),
        cpu_label("ub0/run", 0, 40, tid=78), cpu_label("ub1/run", 40, 30, tid=78),
        cpu_label("ub0/run", 70, 30, tid=78),
        cpu_label("ub0/L1/attention", 0, 30, tid=78),
        cpu_label("ub0/L1/dispatch_send", 30, 50, tid=78),
        cpu_label("ub1/L1/attention", 40, 25, tid=78),
    ], offset)


def test_time_axis_counts_from_the_step_start_not_the_profiler_clock(tmp_path: Path) -> None:
    offset = 4_780_396_501_362.6
    trace = read_trace(write_chrome(tmp_path / "t.json", shifted(dbo_like_events(), offset)))
    ax = _timeline(trace).axes[0]
    label = ax.get_xlabel()
    assert "step" in label and not any(len(tok) > 6 for tok in label.replace(".", " ").split()
                                       if tok.isdigit())
    lo, hi = ax.get_xlim()
    assert lo < 0 < hi < 1e4  # the step starts at 0


def test_rows_are_named_by_device_and_stream_role(tmp_path: Path) -> None:
    gpu = [t.get_text() for t in _timeline(
        read_trace(write_chrome(tmp_path / "g.json", dbo_like_events()))).axes[0].get_yticklabels()]
    assert any("GPU 0" in r and "stream 7" in r and "compute" in r and "comm" not in r for r in gpu)
    assert any("GPU 1" in r and "stream 13" in r and "comm" in r for r in gpu)
    assert any("ub0" in r and "ub1" in r and "stream 7" in r for r in gpu)
    cpu = [t.get_text() for t in _timeline(
        read_trace(write_chrome(tmp_path / "c.json", paused_cpu_events()))).axes[0].get_yticklabels()]
    assert any(r.startswith("CPU pid 77 thread 78") for r in cpu)
    assert not any("dev " in r or "GPU" in r for r in cpu)


def test_phase_names_do_not_overlap(tmp_path: Path) -> None:
    """Nested phases (own_experts inside combine_send) would centre their names on the
    same spot, and neighbours crowd each other: names move or are left out instead."""
    events = [gpu_label("ProfilerStep#1", 0, 1600), kernel("gemm", 0, 1600)]
    for layer in range(4):
        t = 400 * layer
        events += [gpu_label(f"ub0/L{layer}/combine_send", t, 400),
                   gpu_label(f"ub0/L{layer}/own_experts", t + 100, 200),
                   gpu_label(f"ub1/L{layer}/attention", t, 10)]
        events += [gpu_label(f"ub1/L{layer}/router{i}", t + 20 + 12 * i, 12) for i in range(30)]
    trace = read_trace(write_chrome(tmp_path / "t.json", events))
    fig = _timeline(trace)
    ax, renderer = fig.axes[0], fig.canvas.get_renderer()
    names = [t for t in ax.texts if t.get_transform() == ax.transData]
    assert names  # the wide enough ones are still written
    boxes = [(round(t.get_position()[1]), t.get_window_extent(renderer)) for t in names]
    for i, (row_a, a) in enumerate(boxes):
        for row_b, b in boxes[i + 1:]:
            assert row_a != row_b or a.x1 <= b.x0 or b.x1 <= a.x0


def test_phase_bars_are_solid_only_where_the_ubatch_ran(tmp_path: Path) -> None:
    trace = read_trace(write_chrome(tmp_path / "t.json", paused_cpu_events(offset=1e9)))
    bars = {b.name: b for b in phase_bars(trace.labels)}
    assert "ub0/run" not in bars and "ub1/run" not in bars
    send = bars["ub0/L1/dispatch_send"]
    ub1_ran = [Span(1e9 + 40, 1e9 + 70)]
    assert intersect(send.active, ub1_ran) == [] and send.paused == ub1_ran
    assert sum(s.length for s in send.active) == 20.0
    # In the picture: ub0's solid bars leave ub1's run (40..70 us from the step) open.
    ax = _timeline(trace).axes[0]
    row = next(i for i, t in enumerate(ax.get_yticklabels()) if "ub0 phases" in t.get_text())
    solid = next(c for c in ax.collections if c.get_gid() == f"phase-active-{row}")
    for path in solid.get_paths():
        x0, x1 = path.vertices[:, 0].min(), path.vertices[:, 0].max()
        assert x1 <= 40 + 1e-6 or x0 >= 70 - 1e-6
    assert any(c.get_gid() == f"phase-paused-{row}" for c in ax.collections)
