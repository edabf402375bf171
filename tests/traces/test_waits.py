"""Layer 1 (CPU): waits for a peer in CPU traces (traces.waits), how the analyzer counts
them (the compute thread's idle time) and how the timeline shows them: the step's
active part, leading and trailing waits cropped and named in the title, waits drawn as
waits, not as compute or comm. Every expected number is worked out by hand (us)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.traces.test_analyze import cpu_label, kernel, write_chrome
from traces.analyze import analyze
from traces.classify import Classifier
from traces.intervals import Span
from traces.readers import read_trace
from traces.waits import peer_waits

PID, THREAD, GLOO = 77, 78, 90


def op(name: str, ts: float, dur: float) -> dict[str, Any]:
    """A CPU op on the step's thread."""
    return kernel(name, ts, dur, pid=PID, tid=THREAD, cat="cpu_op")


def gloo(name: str, ts: float, dur: float) -> dict[str, Any]:
    """A collective in flight, as gloo's worker thread records it."""
    return cpu_label(name, ts, dur, tid=GLOO)


def cpu_step() -> list[dict[str, Any]]:
    """One thread, step [0, 100):
    - the vote: c10d::allreduce_ [10, 11) issues it, gloo runs it [10.5, 48) while the
      thread computes nothing until 50: a wait [10.5, 48), from when gloo took it (the
      rest of the issue op included);
    - an async dispatch in flight [55, 70) while the thread computes [50, 60) and
      [62, 80): it ends during compute, so no wait (the pause [60, 62) is the host's);
    - a synchronous all_to_all op [80, 95) blocked on gloo's [81, 94.5): a wait inside
      the comm op."""
    return [cpu_label("step/0", 0, 100, tid=THREAD),
            op("aten::mm", 0, 10), op("c10d::allreduce_", 10, 1), gloo("gloo:all_reduce", 10.5, 37.5),
            op("aten::mm", 50, 10), op("aten::mm", 62, 18), gloo("gloo:all_to_all", 55, 15),
            op("c10d::alltoall_base_", 80, 15), gloo("gloo:all_to_all", 81, 13.5),
            op("aten::add", 96, 4)]


def test_peer_waits_are_blocked_stretches_that_end_with_a_collective(tmp_path: Path) -> None:
    trace = read_trace(write_chrome(tmp_path / "t.json", cpu_step()))
    waits = peer_waits(trace.kernels, trace.labels, Span(0, 100), classifier=Classifier(),
                       stream=THREAD)
    assert waits == [Span(10.5, 48), Span(81, 94.5)]
    # Clipped to the window, and none on a GPU trace (its comm kernels are not waits).
    assert peer_waits(trace.kernels, trace.labels, Span(20, 90), classifier=Classifier(),
                      stream=THREAD) == [Span(20, 48)]
    gpu = read_trace(write_chrome(tmp_path / "g.json", [kernel("gemm", 0, 10)] + cpu_step()[2:4]))
    assert peer_waits([k for k in gpu.kernels if k.category == "kernel"], gpu.labels,
                      Span(0, 100), classifier=Classifier(), stream=7) == []


def test_the_analyzer_counts_waits_apart_from_the_host(tmp_path: Path) -> None:
    report = analyze(read_trace(write_chrome(tmp_path / "t.json", cpu_step())))
    dev = report.to_json()["devices"][str(PID)]
    assert dev["wall_us"] == 100 and dev["peer_wait_us"] == 37.5 + 13.5
    # Idle gaps of the thread: [11, 50) (37 of it the vote's wait, from 11 when the issue
    # op ended), [60, 62) and [95, 96) the host's. The wait inside the comm op is not idle.
    idle = dev["compute_idle"]
    assert (idle["idle_us"], idle["num_gaps"]) == (42, 3)
    assert (idle["peer_us"], idle["host_us"], idle["wait_us"]) == (37, 5, 0)
    assert idle["largest"][0] == {"offset_us": 11, "length_us": 39, "host_us": 2, "peer_us": 37,
                                  "before": "aten::mm"}
    table = report.format_table()
    assert "waited for a peer 51.0 us (2 waits" in table and "for a peer 37.0" in table


def late_peer_step() -> list[dict[str, Any]]:
    """A rank that entered the step 300 us before its peer: the vote's op [0, 1), gloo's
    all-reduce waits until 300; the ubatches run [305, 400)."""
    return [cpu_label("step/0", 0, 400, tid=THREAD),
            op("c10d::allreduce_", 0, 1), gloo("gloo:all_reduce", 0.5, 299.5),
            cpu_label("ub0/run", 310, 40, tid=THREAD), cpu_label("ub1/run", 350, 50, tid=THREAD),
            cpu_label("ub0/L0/attention", 310, 40, tid=THREAD),
            cpu_label("ub1/L0/attention", 350, 50, tid=THREAD),
            op("aten::embedding", 305, 5), op("aten::mm", 310, 40), op("aten::mm", 350, 50)]


def test_timeline_crops_a_leading_wait_and_says_so(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from traces.timeline import active_view, build_timeline

    trace = read_trace(write_chrome(tmp_path / "t.json", late_peer_step()))
    report = analyze(trace)
    active = active_view(trace, report)
    assert active is not None
    assert (active.view.start, active.view.end) == (305, 400)  # the first op after the wait
    assert active.cropped_before_us == 305 and active.cropped_after_us == 0
    assert active.peer_wait_us == 299.5
    assert active.note() == ("idle cropped: 305 us before the view, 0 us after it, 300 us of "
                             "it waiting for a peer; the step's window is 400 us")
    fig = build_timeline(trace, report=report)
    assert "idle cropped: 305 us before the view" in fig._suptitle.get_text()
    lo, hi = fig.axes[0].get_xlim()
    assert 300 < lo < 305 < 400 < hi < 405  # the view, padded by 1% of it
    # A wait after the last phase (a collective the peer joins late) goes too.
    trailing = late_peer_step() + [op("c10d::allreduce_", 400, 1), gloo("gloo:all_reduce", 400.5, 99.5),
                                   op("aten::add", 505, 5)]
    trailing[0] = cpu_label("step/0", 0, 510, tid=THREAD)
    both = read_trace(write_chrome(tmp_path / "b.json", trailing))
    both_view = active_view(both, analyze(both))
    assert (both_view.view.start, both_view.view.end) == (305, 400.5)
    assert both_view.cropped_after_us == 109.5 and both_view.peer_wait_us == 299.5 + 99.5
    # Without a wait before the first phase, only the idle edges go: nothing here.
    plain = read_trace(write_chrome(tmp_path / "p.json", late_peer_step()[3:]))
    plain_view = active_view(plain, analyze(plain))
    assert plain_view.view == plain_view.windows and plain_view.note() is None


def test_timeline_draws_waits_as_waits_not_as_comm(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from traces.timeline import build_timeline

    trace = read_trace(write_chrome(tmp_path / "t.json", cpu_step()))
    ax = build_timeline(trace, report=analyze(trace)).axes[0]
    rows = [t.get_text() for t in ax.get_yticklabels()]
    thread_row = next(i for i, r in enumerate(rows) if f"thread {THREAD}" in r)
    exposed_row = next(i for i, r in enumerate(rows) if "exposed comm" in r)
    waits = next(c for c in ax.collections if c.get_gid() == f"peer-wait-{thread_row}")
    drawn = sorted((p.vertices[:, 0].min(), p.vertices[:, 0].max()) for p in waits.get_paths())
    assert drawn == [pytest.approx((10.5, 48)), pytest.approx((81, 94.5))]
    # Exposed comm: the ops [10, 11) and [80, 95) less the waits.
    red = next(c for c in ax.collections if c.get_gid() == f"exposed-{exposed_row}")
    spans = sorted((p.vertices[:, 0].min(), p.vertices[:, 0].max()) for p in red.get_paths())
    assert spans == [pytest.approx((10, 10.5)), pytest.approx((80, 81)), pytest.approx((94.5, 95))]
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "waiting for a peer (blocked on a collective)" in legend
    # Of the 16 us of exposed comm, 0.5 + 13.5 were waits.
    assert any("(14 us of it waiting for a peer)" in t.get_text() for t in ax.texts)
