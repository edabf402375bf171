"""Layer 1 (CPU): unit tests of dbo.ranges — phase ranges that two greenlets interleave on
one thread: NVTX start/end pairing by id, torch.profiler labels in a real CPU trace, the
trace rewritten so those ranges nest (traces.perfetto), and the off state doing nothing.
"""
from __future__ import annotations

import itertools
import logging
import sys
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import greenlet
import pytest
import torch

import dbo.ranges as ranges
from traces.classify import kernel_ubatches
from dbo.ranges import (
    TraceConfig,
    configure,
    end_phase,
    phase_name,
    phase_range,
    start_label,
    start_phase,
)
from traces.readers import ReadConfig, read_chrome_trace
from traces.active import phase_pieces, run_spans
from traces.intervals import intersect, total
from traces.perfetto import ACTIVE_SEGMENT_ARG, nesting_violations, rewrite_chrome_trace


@pytest.fixture(autouse=True)
def _ranges_off() -> Iterator[None]:
    configure(TraceConfig())
    yield
    configure(TraceConfig())


class _RecordingNvtx:
    """Stands in for an NVTX domain: records starts and ends by id."""

    def __init__(self) -> None:
        self.events: list[tuple[str, Any, Any]] = []
        self._next = 100

    def start(self, name: str, color: int) -> int:
        self._next += 1
        self.events.append(("start", name, self._next))
        return self._next

    def end(self, range_id: int) -> None:
        self.events.append(("end", None, range_id))


def _use_recorder(monkeypatch: pytest.MonkeyPatch) -> _RecordingNvtx:
    configure(TraceConfig(nvtx=True))
    rec = _RecordingNvtx()
    monkeypatch.setattr(ranges._STATE, "nvtx", ranges._NvtxBackend(rec.start, rec.end, "recording"))
    return rec


def test_names() -> None:
    assert phase_name("dispatch_send", ubatch_id=0, layer=3) == "ub0/L3/dispatch_send"
    assert phase_name("attention", ubatch_id=1) == "ub1/attention"
    assert ranges.step_name(4) == "step/4"


def _peak_bytes(start: Any, end: Any, ctx: Any) -> int:
    """Peak traced memory above the start level over a loop of range calls."""

    def loop() -> None:
        for _ in itertools.repeat(None, 500):
            end(start("experts", ubatch_id=1, layer=3))
            with ctx("router", ubatch_id=0, layer=3):
                pass

    loop()  # warm up anything created lazily
    tracemalloc.start()
    try:
        loop()
        base, _ = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        loop()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return peak - base


def test_off_by_default_does_nothing_and_allocates_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not ranges.enabled()
    assert start_phase("experts", ubatch_id=0, layer=1) is None
    assert phase_range("experts", ubatch_id=0, layer=1) is phase_range("router", ubatch_id=1, layer=2)
    end_phase(None)

    # Reference: the same loop calling functions that do nothing at all. The loop itself
    # costs a constant few hundred bytes; ranges that are off must add nothing to it,
    # whereas ranges that are on build a name and a handle per call.
    null = ranges._NULL_RANGE

    def noop_start(phase: str, *, ubatch_id: int, layer: int | None = None) -> None:
        return None

    def noop_end(handle: Any) -> None:
        return None

    def noop_ctx(phase: str, *, ubatch_id: int, layer: int | None = None) -> Any:
        return null

    reference = _peak_bytes(noop_start, noop_end, noop_ctx)
    assert _peak_bytes(start_phase, end_phase, phase_range) <= reference
    _use_recorder(monkeypatch)
    assert _peak_bytes(start_phase, end_phase, phase_range) > reference


def test_interleaved_greenlets_close_their_own_ranges(monkeypatch: pytest.MonkeyPatch) -> None:
    rec = _use_recorder(monkeypatch)
    order: list[str] = []

    def ub0() -> None:
        h = start_phase("dispatch_send", ubatch_id=0, layer=0)   # A start
        order.append("A start")
        g1.switch()
        end_phase(h)                                              # A end, while B is open
        order.append("A end")
        g1.switch()

    def ub1() -> None:
        with phase_range("attention", ubatch_id=1, layer=0):      # B start
            order.append("B start")
            g0.switch()
            order.append("B end")

    g0, g1 = greenlet.greenlet(ub0), greenlet.greenlet(ub1)
    g0.switch()
    assert order == ["A start", "B start", "A end", "B end"]
    starts = {rid: name for kind, name, rid in rec.events if kind == "start"}
    ends = [starts[rid] for kind, _, rid in rec.events if kind == "end"]
    assert ends == ["ub0/L0/dispatch_send", "ub1/L0/attention"]


def test_handle_survives_reconfigure(monkeypatch: pytest.MonkeyPatch) -> None:
    rec = _use_recorder(monkeypatch)
    h = start_label("step/1")
    configure(TraceConfig())
    end_phase(h)
    assert [kind for kind, *_ in rec.events] == ["start", "end"]


def test_real_nvtx_package_start_end() -> None:
    pytest.importorskip("nvtx")
    configure(TraceConfig(nvtx=True))
    assert ranges.nvtx_backend() == "nvtx"
    a = start_phase("experts", ubatch_id=0, layer=0)
    b = start_phase("experts", ubatch_id=1, layer=0)
    end_phase(a)
    end_phase(b)
    with phase_range("router", ubatch_id=7):  # other ubatch ids get the grey colour
        pass


def test_missing_nvtx_without_cuda_logs_once(monkeypatch: pytest.MonkeyPatch,
                                             caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setitem(sys.modules, "nvtx", None)  # import nvtx -> ImportError
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(ranges, "_logged", set())
    with caplog.at_level(logging.WARNING, logger="dbo.ranges"):
        configure(TraceConfig(nvtx=True))
        configure(TraceConfig(nvtx=True))
        assert start_phase("experts", ubatch_id=0) is None and not ranges.enabled()
    assert [r.message for r in caplog.records].count(caplog.records[0].message) == 1
    assert "nvtx" in caplog.records[0].message


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="domain"):
        TraceConfig(domain="")
    with pytest.raises(TypeError, match="TraceConfig"):
        configure({"nvtx": True})  # type: ignore[arg-type]


def test_record_function_labels_interleave_in_a_cpu_profiler_trace(tmp_path: Path) -> None:
    configure(TraceConfig(record_function=True))
    x = torch.randn(32, 32)

    def ub0() -> None:
        h = start_phase("attention", ubatch_id=0, layer=0)      # A start
        torch.mm(x, x)
        g1.switch()
        end_phase(h)                                            # A end (B still open)
        with phase_range("router", ubatch_id=0, layer=0):
            torch.add(x, 1)
        g1.switch()

    def ub1() -> None:
        h = start_phase("attention", ubatch_id=1, layer=0)      # B start
        torch.mul(x, 2)
        g0.switch()
        torch.sub(x, 3)
        end_phase(h)                                            # B end

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        g0, g1 = greenlet.greenlet(ub0), greenlet.greenlet(ub1)
        g0.switch()
    path = tmp_path / "cpu_trace.json"
    prof.export_chrome_trace(str(path))

    trace = read_chrome_trace(path, config=ReadConfig(cpu_ops_as_kernels=False))
    assert trace.kernels == [] and any("no GPU kernels" in n for n in trace.notes)
    labels = {lb.name: lb for lb in trace.labels if lb.phase is not None}
    a, b, r = labels["ub0/L0/attention"], labels["ub1/L0/attention"], labels["ub0/L0/router"]
    assert a.start_us < b.start_us < a.end_us <= r.start_us < r.end_us <= b.end_us
    assert (a.ubatch, a.layer, a.phase, b.ubatch) == (0, 0, "attention", 1)

    cpu = read_chrome_trace(path, config=ReadConfig(cpu_ops_as_kernels=True))
    owner = {k.name: ub for k, ub in zip(cpu.kernels, kernel_ubatches(cpu))}
    assert owner["aten::mm"] == 0 and owner["aten::mul"] == 1
    assert owner["aten::add"] == 0 and owner["aten::sub"] == 1


def _dbo_step_trace(path: Path) -> Path:
    """A real CPU profiler trace of a two-ubatch scheduler step whose phases stay open
    across yields (as dispatch_send does), with the scheduler's ub<n>/run ranges."""
    from dbo.phases import phase_scope
    from dbo.scheduler import UBatchScheduler
    from dbo.yield_points import dbo_yield

    x = torch.randn(16, 16)

    def ubatch() -> None:
        for layer in range(2):
            with phase_scope("attention", layer=layer):
                torch.mm(x, x)
            with phase_scope("dispatch_send", layer=layer):
                torch.add(x, 1)
                dbo_yield()                 # paused here while the other ubatch runs
                torch.mul(x, 2)

    configure(TraceConfig(record_function=True))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        UBatchScheduler("cpu").run([ubatch, ubatch])
    prof.export_chrome_trace(str(path))
    return path


def _events(path: Path) -> list[dict[str, Any]]:
    import json

    return json.loads(path.read_text())["traceEvents"]


def test_rewritten_trace_nests_phase_ranges_and_reads_back_the_same(tmp_path: Path) -> None:
    path = _dbo_step_trace(tmp_path / "step.json")
    before = read_chrome_trace(path)
    assert nesting_violations(_events(path))  # the profiler's own export does not nest
    assert rewrite_chrome_trace(path) == 8    # 2 ubatches x 2 layers x 2 phases
    events = _events(path)
    assert nesting_violations(events) == []
    segments = [e for e in events if ACTIVE_SEGMENT_ARG in (e.get("args") or {})]
    assert {e["tid"] for e in segments} == {e["tid"] for e in events if e.get("name") == "ub0/run"}
    # A paused dispatch_send becomes two active segments on the thread.
    assert sum(e["name"] == "ub0/L0/dispatch_send" for e in segments) == 2
    after = read_chrome_trace(path)
    key = lambda lb: (lb.start_us, lb.name)  # noqa: E731
    assert sorted(after.labels, key=key) == sorted(before.labels, key=key)
    assert rewrite_chrome_trace(path) == 0    # nothing left to move


def test_active_time_of_a_paused_range_is_its_ubatchs_run_time(tmp_path: Path) -> None:
    trace = read_chrome_trace(_dbo_step_trace(tmp_path / "step.json"))
    runs = {ub: spans for (_, ub), spans in run_spans(trace.labels).items()}
    for piece in phase_pieces(trace.labels):
        lb = piece.label
        extent = lb.end_us - lb.start_us
        assert total(piece.active) + total(piece.paused) == pytest.approx(extent)
        assert intersect(piece.paused, runs[lb.ubatch]) == []
        assert intersect(piece.active, runs[1 - lb.ubatch]) == []
        if lb.phase == "dispatch_send" and (lb.ubatch, lb.layer) == (0, 0):
            assert total(piece.paused) > 0  # ub1 ran inside it


def test_capture_writes_a_trace_whose_ranges_nest(tmp_path: Path) -> None:
    """traces.capture (what `dbo run` and `dbo trace` write) rewrites the trace for Perfetto
    and, on CPU, analyzes the host ops without being told."""
    from traces.capture import capture
    from dbo.phases import phase_scope
    from dbo.scheduler import UBatchScheduler
    from dbo.yield_points import dbo_yield

    x = torch.randn(16, 16)

    def ubatch() -> None:
        with phase_scope("dispatch_send", layer=0):
            torch.add(x, 1)
            dbo_yield()
            torch.mul(x, 2)

    result = capture(lambda: UBatchScheduler("cpu").run([ubatch, ubatch]), tmp_path)
    assert nesting_violations(_events(result.trace_path)) == []
    assert result.report.devices and result.report.devices[next(iter(result.report.devices))].phases
