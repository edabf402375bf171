"""How the comm benchmark times one engine (`moe.bench.comm`): eagerly, call by call, or
replayed from a CUDA graph (`dbo bench-comm --cuda-graph`).

Eager (`time_engine`): `iters` dispatch + combine calls back to back after `warmup`, as
DeepEP's `bench` times them: CUDA events around the dispatch and the combine of each call,
no synchronisation in between, and perf_counter around each call for the host time (the
host waits only where the engine itself does). At small T this measures the host: each
call's Python and launches, not the exchange.

Graphed (`capture_layers`, then `time_replays`): N = `layers` dispatch + combine pairs
back to back, as N MoE layers of one decode step would issue them, captured in ONE CUDA
graph (`dbo.graphs.capture_graph`: two eager calls of the N pairs on a side stream
first), with an external timing event between every two calls (2N + 1 marks, recorded
by the replay itself). Then:

1. `warmup` untimed replays; `iters` replays back to back, a CUDA event before and after
   each (outside the graph): pair latency = median replay time / N. The host queues the
   replays ahead of the GPU, so this is the device's time of the N pairs, without any
   per-call launch cost (the graph's own launch is amortised over the N pairs).
2. `iters` replays one at a time, every rank starting together (a barrier) and the host
   waiting for each: perf_counter around the replay call gives host time per layer =
   call time / N (nothing queued, so the call never waits for the GPU); the marks give
   each pair's dispatch and combine, and the figures are their medians over all pairs of
   all these replays (the first pair of a replay also waits out the ranks' start skew;
   the median leaves it out).

The arithmetic of both is `replay_timing` (pure, tested on CPU). An engine must launch
the same work on every call and read nothing back on the host (`Engine.graph_blocker`).
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from time import perf_counter
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from moe.bench.comm_engines import Engine
from moe.bench.timing import barrier

DEFAULT_GRAPH_LAYERS = 10
"""Dispatch + combine pairs per graph (`--graph-layers`)."""


@dataclass(frozen=True)
class RankTiming:
    """One rank's medians (device ms; host us). Eager: per call; host_dispatch_us and
    host_combine_us per call, host_total_us of their sum. Graphed (`replay_timing`):
    per pair of a replay; no per-call host figure (None), host_total_us = replay call
    time / N."""

    dispatch_ms: float
    combine_ms: float
    total_ms: float
    host_dispatch_us: Optional[float]
    host_combine_us: Optional[float]
    host_total_us: float


def time_engine(engine: Engine, *, device: torch.device, group: Optional[dist.ProcessGroup],
                warmup: int, iters: int) -> RankTiming:
    """Time `iters` back-to-back dispatch + combine calls after `warmup` (module doc)."""
    cuda = device.type == "cuda"
    for _ in range(warmup):
        engine.combine(engine.dispatch())
    if cuda:
        torch.cuda.synchronize(device)
    barrier(group, device)
    events = [tuple(torch.cuda.Event(enable_timing=True) for _ in range(3))
              for _ in range(iters)] if cuda else []
    host: list[tuple[float, float]] = []
    for i in range(iters):
        if cuda:
            events[i][0].record()
        t0 = perf_counter()
        state = engine.dispatch()
        t1 = perf_counter()
        if cuda:
            events[i][1].record()
        t2 = perf_counter()
        engine.combine(state)
        t3 = perf_counter()
        if cuda:
            events[i][2].record()
        host.append(((t1 - t0) * 1e3, (t3 - t2) * 1e3))
        del state
    if cuda:
        torch.cuda.synchronize(device)
        device_ms = [(a.elapsed_time(b), b.elapsed_time(c)) for a, b, c in events]
    else:
        device_ms = host
    med = statistics.median
    return RankTiming(dispatch_ms=med(d for d, _ in device_ms),
                      combine_ms=med(c for _, c in device_ms),
                      total_ms=med(d + c for d, c in device_ms),
                      host_dispatch_us=1e3 * med(d for d, _ in host),
                      host_combine_us=1e3 * med(c for _, c in host),
                      host_total_us=1e3 * med(d + c for d, c in host))


def replay_timing(replay_ms: Sequence[float], call_us: Sequence[float],
                  segments_ms: Sequence[Sequence[float]], *, layers: int) -> RankTiming:
    """One rank's graphed figures (module doc) from what its replays measured.

    replay_ms: device time of each back-to-back replay of the N = `layers` pairs;
    call_us: host time of each waited-for replay call; segments_ms: per waited-for
    replay, the 2N times between consecutive marks (dispatch 1, combine 1, dispatch 2,
    ...). Pair latency = median replay / N, dispatch and combine = medians over every
    pair, host per layer = median call / N.
    """
    if not replay_ms or not call_us or not segments_ms:
        raise ValueError("replay_timing needs at least one timed replay of each kind")
    for segments in segments_ms:
        if len(segments) != 2 * layers:
            raise ValueError(f"a replay of {layers} pairs has {2 * layers} segments between "
                             f"its marks, got {len(segments)}")
    med = statistics.median
    return RankTiming(dispatch_ms=med(s for seg in segments_ms for s in seg[0::2]),
                      combine_ms=med(s for seg in segments_ms for s in seg[1::2]),
                      total_ms=med(replay_ms) / layers,
                      host_dispatch_us=None, host_combine_us=None,
                      host_total_us=med(call_us) / layers)


@dataclass
class LayersGraph:
    """N dispatch + combine pairs captured in one CUDA graph, and its 2N + 1 marks
    (external timing events that each replay records between the calls)."""

    captured: Any  # dbo.graphs.CapturedGraph
    marks: list[Any]  # torch.cuda.Event
    layers: int

    def segments_ms(self) -> list[float]:
        """The 2N times between consecutive marks of the last replay (after a sync)."""
        return [a.elapsed_time(b) for a, b in zip(self.marks, self.marks[1:])]


def capture_layers(engine: Engine, *, layers: int, device: torch.device) -> LayersGraph:
    """Capture `layers` dispatch + combine pairs of `engine` in one CUDA graph (module doc;
    every rank at once: the capture itself issues no collective). RuntimeError where the
    engine cannot be captured."""
    from dbo import capture_graph

    # external=True: recorded by the replay as graph nodes, so they time inside it.
    marks = [torch.cuda.Event(enable_timing=True, external=True)
             for _ in range(2 * layers + 1)]

    def run_layers() -> Any:
        out = None
        marks[0].record()
        for i in range(layers):
            state = engine.dispatch()
            marks[2 * i + 1].record()
            out = engine.combine(state)
            marks[2 * i + 2].record()
        return out

    return LayersGraph(capture_graph(run_layers, device=device), marks, layers)


def time_replays(graph: LayersGraph, *, device: torch.device,
                 group: Optional[dist.ProcessGroup], warmup: int, iters: int) -> RankTiming:
    """Time `graph`'s replays (module doc, steps 1 and 2); every rank at once."""
    replay = graph.captured.replay
    for _ in range(warmup):
        replay()
    torch.cuda.synchronize(device)
    barrier(group, device)
    spans = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
             for _ in range(iters)]
    for start, end in spans:
        start.record()
        replay()
        end.record()
    torch.cuda.synchronize(device)
    replay_ms = [start.elapsed_time(end) for start, end in spans]
    call_us: list[float] = []
    segments_ms: list[list[float]] = []
    for _ in range(iters):
        barrier(group, device)
        t0 = perf_counter()
        replay()
        t1 = perf_counter()
        torch.cuda.synchronize(device)
        call_us.append((t1 - t0) * 1e6)
        segments_ms.append(graph.segments_ms())
    return replay_timing(replay_ms, call_us, segments_ms, layers=graph.layers)
