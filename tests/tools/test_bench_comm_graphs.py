"""Layer 1 (CPU, in-process): `dbo bench-comm --cuda-graph` without a GPU. The graphed
timing arithmetic (`replay_timing`) on hand-computed numbers; the capture-and-replay
path (`capture_layers`, `time_replays`) end to end on a fake clock, with a stand-in for
`dbo.graphs.capture_graph` (a replay re-runs the captured calls) and stand-in CUDA
events that read that clock; the eager host time per layer on the same clock; which
engines a graph can capture; the graphed table, files and JSON line. Real CUDA graphs
run in tests/tools/test_bench_comm_gpu.py.
"""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import moe.bench.comm_timing as timing
from moe.bench.comm import CommBenchConfig, CommResult, Skip, make_point
from moe.bench.comm_engines import BackendEngine
from moe.bench.comm_raw import _LowLatencyEngine, _NormalEngine
from moe.bench.comm_report import file_stem, final_line, format_table, write_outputs
from moe.bench.comm_timing import (LayersGraph, RankTiming, capture_layers, replay_timing,
                                   time_engine, time_replays)


def test_replay_timing_divides_the_replay_by_its_layers() -> None:
    # 3 layers per graph. Back-to-back replays of 0.45, 0.39, 0.42 ms: median 0.42 / 3.
    # Waited-for replays: d, c, d, c, d, c segments; the first pair of each also waits out
    # the ranks' skew (0.5, 0.4 ms), which the median over all pairs leaves out.
    got = replay_timing([0.45, 0.39, 0.42], [40.0, 30.0, 36.0],
                        [[0.5, 0.07, 0.05, 0.08, 0.06, 0.07],
                         [0.4, 0.09, 0.06, 0.07, 0.05, 0.08]], layers=3)
    assert got.total_ms == pytest.approx(0.14)
    assert got.dispatch_ms == pytest.approx(0.06)  # 0.05 0.05 0.06 | 0.06 0.4 0.5
    assert got.combine_ms == pytest.approx(0.075)  # 0.07 0.07 0.07 | 0.08 0.08 0.09
    assert got.host_total_us == pytest.approx(12.0)  # median 36 us / 3 layers
    assert got.host_dispatch_us is None and got.host_combine_us is None
    with pytest.raises(ValueError, match="has 4 segments between its marks, got 3"):
        replay_timing([1.0], [1.0], [[0.1, 0.2, 0.3]], layers=2)
    with pytest.raises(ValueError, match="at least one timed replay"):
        replay_timing([], [1.0], [[0.1, 0.2]], layers=1)


class _Clock:
    """One clock (ms) for host and device: a call advances it by its cost."""

    def __init__(self) -> None:
        self.now_ms = 0.0

    def advance(self, ms: float) -> None:
        self.now_ms += ms

    def seconds(self) -> float:
        return self.now_ms / 1e3


def _fake_cuda(monkeypatch: pytest.MonkeyPatch, clock: _Clock) -> list[dict]:
    """torch.cuda.Event reading `clock`, a no-op synchronize, and perf_counter = `clock`;
    returns the constructor arguments of every event made."""
    made: list[dict] = []

    class Event:
        def __init__(self, enable_timing: bool = False, external: bool = False) -> None:
            made.append({"enable_timing": enable_timing, "external": external})
            self.t: Any = None

        def record(self) -> None:
            self.t = clock.now_ms

        def elapsed_time(self, end: "Event") -> float:
            return end.t - self.t

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(timing, "perf_counter", clock.seconds)
    return made


class _Engine:
    """A dispatch costs 3 ms, a combine 5 ms (on `clock`)."""

    def __init__(self, clock: _Clock, log: list[str]) -> None:
        self.clock, self.log = clock, log

    def dispatch(self) -> str:
        self.clock.advance(3.0)
        self.log.append("d")
        return "state"

    def combine(self, state: str) -> torch.Tensor:
        assert state == "state"
        self.clock.advance(5.0)
        self.log.append("c")
        return torch.zeros(1)


def test_captured_layers_replay_into_per_pair_and_per_layer_figures(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import dbo

    clock, log = _Clock(), []
    made = _fake_cuda(monkeypatch, clock)
    captures: list[dict] = []

    def capture_graph(fn: Any, *, device: torch.device, warmup: int = 2) -> Any:
        captures.append({"device": device})
        fn()  # the capture: what a replay then runs
        log.append("captured")

        def replay() -> Any:
            clock.advance(2.0)  # the graph's launch on the device, once per replay
            log.append("replay")
            return fn()
        return SimpleNamespace(replay=replay)

    # The bench takes it from the package (`from dbo import capture_graph`).
    monkeypatch.setattr(dbo, "capture_graph", capture_graph)
    device = torch.device("cuda", 0)
    graph = capture_layers(_Engine(clock, log), layers=4, device=device)
    assert isinstance(graph, LayersGraph) and len(graph.marks) == 9
    assert made == [{"enable_timing": True, "external": True}] * 9
    assert log == ["d", "c"] * 4 + ["captured"] and captures == [{"device": device}]
    log.clear()
    got = time_replays(graph, device=device, group=None, warmup=2, iters=3)
    assert log.count("replay") == 2 + 3 + 3  # warmup, back to back, one at a time
    assert log.count("d") == log.count("c") == 4 * 8
    # A replay: 2 ms launch + 4 x (3 + 5) ms = 34 ms on the device: 8.5 ms per pair.
    assert got.total_ms == pytest.approx(8.5)
    assert (got.dispatch_ms, got.combine_ms) == pytest.approx((3.0, 5.0))
    assert got.host_total_us == pytest.approx(34_000 / 4)  # the replay call here: 34 ms
    assert got.host_dispatch_us is None and got.host_combine_us is None


def test_eager_host_per_layer_is_the_median_of_each_calls_sum(
        monkeypatch: pytest.MonkeyPatch) -> None:
    clock = _Clock()
    monkeypatch.setattr(timing, "perf_counter", clock.seconds)
    costs = iter([(1.0, 5.0), (2.0, 1.0), (9.0, 1.0)])  # (dispatch, combine) ms per call

    class Engine:
        def dispatch(self) -> None:
            self.cost = next(costs)
            clock.advance(self.cost[0])

        def combine(self, state: None) -> None:
            clock.advance(self.cost[1])

    got = time_engine(Engine(), device=torch.device("cpu"), group=None, warmup=0, iters=3)
    assert (got.host_dispatch_us, got.host_combine_us) == pytest.approx((2000.0, 1000.0))
    assert got.host_total_us == pytest.approx(6000.0)  # sums 6, 3, 10 ms: not 2 + 1


def test_both_benches_align_their_ranks_with_one_barrier(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import dbo.cli.bench.phases
    import dbo.cli.bench.timing
    import moe.bench.timing
    barrier = moe.bench.timing.barrier
    assert timing.barrier is dbo.cli.bench.timing.barrier is dbo.cli.bench.phases.barrier \
        is barrier
    calls: list[dict] = []
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "barrier", lambda **kw: calls.append(kw))
    group = object()
    barrier(None, torch.device("cpu"))  # no group: nothing to align
    barrier(group, torch.device("cpu"))
    barrier(group, torch.device("cuda", 1))  # on the bench's device, not NCCL's guess
    assert calls == [{"group": group}, {"group": group, "device_ids": [1]}]
    calls.clear()
    time_engine(_Engine(_Clock(), []), device=torch.device("cpu"), group=group, warmup=1,
                iters=2)
    assert calls == [{"group": group}]  # once, after the warmup


def test_only_engines_that_read_nothing_on_the_host_can_be_captured() -> None:
    x, w, ids = torch.zeros(2, 8), torch.ones(2, 1), torch.zeros(2, 1, dtype=torch.int64)
    for name, safe in (("a2a", False), ("deepep_ht", False), ("a2a_ll", True),
                       ("symm_mem", True), ("deepep_ll", True)):
        engine = BackendEngine(SimpleNamespace(name=name, graph_safe=safe), x, w, ids)
        reason = engine.graph_blocker()
        assert (reason is None) == safe, name
        if not safe:
            assert f"backend {name!r} reads device values on the host" in reason
            assert reason.endswith("time it without --cuda-graph")
    assert "DeepEP's normal dispatch waits on the host" in _NormalEngine(
        None, 8, x, w, ids).graph_blocker()
    assert _LowLatencyEngine(None, 8, 4, x, w, ids).graph_blocker() is None


def test_graphed_outputs_carry_the_mode_and_say_what_the_columns_are(tmp_path: Path) -> None:
    cfg = CommBenchConfig(tokens=(128,), cuda_graph=True, graph_layers=10, regime="NVLink",
                          out_dir=str(tmp_path), plot=False)
    rank = {"rank_rows": 100, "expert_slots": 800, "rows_delivered": 256, "sms": (24, 24),
            "kernels": {},
            "timing": RankTiming(dispatch_ms=0.04, combine_ms=0.05, total_ms=0.1,
                                 host_dispatch_us=None, host_combine_us=None,
                                 host_total_us=2.5)}
    point = make_point("symm_mem", 128, [rank, rank], itemsize=2, hidden=7168)
    assert point.host_dispatch_us is None and point.host_total_us == 2.5
    result = CommResult(cfg, 2, "NVIDIA H200", 132, points=[point], skipped=[
        Skip("a2a", 128, "rank 0: backend 'a2a' reads device values on the host")])
    assert file_stem(result) == "bench_comm_w2_nvlink_graphs"
    table = format_table(result)
    assert "cuda_graph=true" in table
    assert "d+c us = device time of one replay / 10" in table
    assert "host/layer = perf_counter around one replay call / 10" in table
    row = next(line for line in table.splitlines() if line.startswith("symm_mem"))
    assert row.split()[2:8] == ["40.0", "50.0", "100.0", "-", "-", "2.5"]
    assert "skipped a2a: rank 0: backend 'a2a' reads device values on the host" in table
    files = write_outputs(result)
    assert Path(files["csv"]).name == "bench_comm_w2_nvlink_graphs.csv"
    doc = json.loads(Path(files["json"]).read_text())
    assert doc["cuda_graph"] is True and doc["graph_layers"] == 10
    assert doc["definitions"]["latency"].startswith("N (graph_layers) dispatch + combine")
    line = json.loads(final_line(result, files))
    assert line["cuda_graph"] is True and line["points"][0]["host_total_us"] == 2.5
    assert line["points"][0]["host_dispatch_us"] is None
