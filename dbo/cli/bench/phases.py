"""Per-phase times of one sweep point, for the cost model: attention (and router), shared
experts, routed experts, dispatch, combine; and the predicted step times beside the
measured ones.

    point = probe_phases(off_workload, device=device, group=group, warmup=2, iters=5,
                         tokens=1024, decode=False, backend="a2a", label="...")
    prediction = predict(*point_inputs(point, calibration), calibration)

From the DBO-off step, as the ceiling probe (`dbo.cli.bench.ceiling`) does:
- **dispatch, combine**: the step's recorded collectives replayed alone, split per MoE
  layer: its last collective is the combine (a2a, a2a_ll: the return all-to-all; naive:
  the reduce-scatter), the ones before it the dispatch (count exchange, data, gathers),
  collectives before the first MoE layer with the dispatch. Each half timed on its own.
- **compute**: the step with every collective replaced by its recorded result, timed per
  step (start to end) and per phase with forward hooks on each MoE layer, its router and
  its shared experts (CUDA events on the current stream on a GPU, the host clock on CPU):
  attention = step - MoE layers + routers, shared = shared experts, experts = MoE layers
  - routers - shared experts (packing included).
Each figure is the median over `iters` steps of the slowest rank's value. Works on CPU
(gloo) and GPU alike; on CPU the figures are a functional check.

Both are timed eagerly: hooks cannot mark a CUDA-graph replay, and the replays run one
launch at a time. Where the step itself is timed as CUDA-graph replays (--cuda-graph), a
small step's eager phases hold host time its replay never pays (launch gaps, the hooks'
own marks, host syncs: at 64 decode requests on 2x H200 they summed to 5.59 ms against a
graphed step of 3.20 ms). `to_graph_mode` scales them to the ceiling probe's graphed
compute-alone and comm-alone times of the same step; that assumes the host time is
spread over the compute phases (and over dispatch and combine) in proportion to their
eager times.
"""
from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn

from dbo import MeasuredPoint
from dbo.cli.bench.ceiling import (CommRecording, CommReplay, log_drift, moe_layers,
                                   record_collectives, replayed_results)
from dbo.cli.bench.timing import gather_floats, time_steps
from dbo.cli.bench.workload import Workload
from moe.backends import PrepareFinalize
from moe.bench.timing import barrier

__all__ = ["probe_phases", "split_recording", "step_is_decode", "to_graph_mode"]


def step_is_decode(workload: Workload, split: Any) -> bool:
    """Whether the runner plans this workload's step as decode (`SplitPlan.is_decode`):
    "tokens" split always; "requests" when every request has one token; "batch" when
    the sequences are one token long."""
    if split == "requests":
        lens = workload.kwargs["seq_lens"]
        return len(lens) > 0 and max(int(v) for v in lens) <= 1
    if split == "batch":
        x = next(a for a in (*workload.args, *workload.kwargs.values())
                 if isinstance(a, torch.Tensor))
        return x.dim() < 2 or x.shape[1] == 1
    return True


def split_recording(recording: CommRecording) -> tuple[CommRecording, CommRecording]:
    """(dispatch, combine): each MoE layer's last collective is its combine (module doc)."""
    dispatch, combine = CommRecording(segments=[]), CommRecording(segments=[])
    for index, segment in enumerate(recording.segments):
        last = len(segment) if index == 0 else len(segment) - 1
        dispatch.segments.append(segment[:max(last, 0)])
        combine.segments.append(segment[max(last, 0):])
    return dispatch, combine


class _Clock:
    """Marks on the current stream (GPU) or the host clock (CPU); `elapsed(a, b)` in ms."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def elapsed(self, start: Any, end: Any) -> float:
        if self.cuda:
            end.synchronize()
            return float(start.elapsed_time(end))
        return (end - start) * 1e3


@contextlib.contextmanager
def _phase_hooks(model: nn.Module, clock: _Clock) -> Iterator[dict[str, list[tuple[Any, Any]]]]:
    """Collect (start, end) marks of every MoE layer, router and shared-experts call."""
    spans: dict[str, list[tuple[Any, Any]]] = {"moe": [], "router": [], "shared": []}
    handles = []

    def watch(module: nn.Module, kind: str) -> None:
        opened: list[Any] = []
        handles.append(module.register_forward_pre_hook(lambda *_: opened.append(clock.mark())))
        handles.append(module.register_forward_hook(
            lambda *_: spans[kind].append((opened.pop(), clock.mark()))))

    for layer in moe_layers(model):
        watch(layer, "moe")
        watch(layer.router, "router")
        if getattr(layer, "shared_experts", None) is not None:
            watch(layer.shared_experts, "shared")
    try:
        yield spans
    finally:
        for h in handles:
            h.remove()


def _compute_phases(workload: Workload, *, device: torch.device,
                    group: Optional[dist.ProcessGroup], warmup: int, iters: int
                    ) -> dict[str, float]:
    """Median (over steps) of the slowest rank's attention / shared / experts time."""
    clock = _Clock(device)
    for _ in range(warmup):
        workload.step()
    samples: dict[str, list[float]] = {"attention": [], "shared": [], "experts": []}
    with _phase_hooks(workload.model, clock) as spans:
        for _ in range(iters):
            for kind in spans:
                spans[kind].clear()
            barrier(group, device)
            start = clock.mark()
            workload.step()
            end = clock.mark()
            total = {k: sum(clock.elapsed(a, b) for a, b in v) for k, v in spans.items()}
            step_ms = clock.elapsed(start, end)
            mine = {"attention": max(step_ms - total["moe"] + total["router"], 0.0),
                    "shared": total["shared"],
                    "experts": max(total["moe"] - total["router"] - total["shared"], 0.0)}
            for kind, value in mine.items():
                samples[kind].append(max(gather_floats(value, group)))
    return {k: statistics.median(v) for k, v in samples.items()}


def _weight_bytes(model: nn.Module) -> dict[str, float]:
    """Routed-expert, shared-expert and other (embeddings left out) weight bytes."""
    def nbytes(params: Callable[[], Iterator[nn.Parameter]]) -> float:
        return float(sum(p.numel() * p.element_size() for p in params()))
    layers = moe_layers(model)
    experts = sum(nbytes(lambda m=m: iter((m.w13, m.w2))) for m in layers)
    shared = sum(nbytes(m.shared_experts.parameters) for m in layers
                 if getattr(m, "shared_experts", None) is not None)
    moe = sum(nbytes(m.parameters) for m in layers)
    embeddings = sum(nbytes(m.parameters) for m in model.modules()
                     if isinstance(m, nn.Embedding))
    return {"expert_weight_bytes": experts, "shared_weight_bytes": shared,
            "attention_weight_bytes": max(nbytes(model.parameters) - moe - embeddings, 0.0)}


def probe_phases(workload: Workload, *, device: torch.device,
                 group: Optional[dist.ProcessGroup], warmup: int, iters: int, tokens: int,
                 decode: bool, backend: str, label: str, comm_latency_ms: float = 0.0,
                 measured_ms: Optional[dict[str, float]] = None) -> MeasuredPoint:
    """The DBO-off `workload`'s per-phase times (module doc) as a `MeasuredPoint`."""
    assert workload.runner is None, "probe the DBO-off workload"
    model = workload.model
    with record_collectives(model) as recording:
        workload.step()
    timing = dict(device=device, group=group, warmup=warmup, iters=iters)
    dispatch, combine = (time_steps(CommReplay(part).run_all, **timing).max_ms
                         for part in split_recording(recording))
    with replayed_results(recording) as drift:
        compute = _compute_phases(workload, **timing)
    log_drift("phase times", drift)
    layers = moe_layers(model)
    moe = layers[0].config
    world = dist.get_world_size(group) if group is not None and dist.is_initialized() else 1
    return MeasuredPoint(
        tokens=tokens, decode=decode, layers=len(layers), dispatch=dispatch, combine=combine,
        comm_latency=comm_latency_ms, rows_per_expert=max(tokens * moe.top_k * world
                                                          / moe.num_experts, 1e-3),
        backend=backend, label=label, measured_ms=dict(measured_ms or {}),
        **_sbo_passes(layers[0], world), **compute, **_weight_bytes(model))


def _sbo_passes(layer: Any, world: int) -> dict[str, Any]:
    """How the layer's SBO step passes over its rows (`dbo.cost_model`): the combine
    chunks where its backend chunks the combine, its expert groups where it groups it,
    and the own rows' share (1/W) where the backend splits its combine and the layer
    does (`moe.modular_kernel`)."""
    config, backend = layer.config, layer.backend
    splits = (config.split_last_combine and world > 1
              and type(backend).own_rows is not PrepareFinalize.own_rows)
    return {"sbo_chunks": backend.combine_chunks, "sbo_groups": backend.combine_groups,
            "own_row_share": 1.0 / world if splits else 0.0}


def to_graph_mode(point: MeasuredPoint, *, compute_ms: float, comm_ms: float) -> MeasuredPoint:
    """`point`'s eager phase times brought to CUDA-graph replays (module doc): attention,
    shared and experts scaled so that they sum to `compute_ms` (the graphed compute-alone
    step), dispatch and combine so that they sum to `comm_ms` (the graphed comm-alone
    replay); a group that measured nothing keeps its times (scale 1)."""
    def scale(target: float, names: tuple[str, ...]) -> float:
        total = sum(getattr(point, n) for n in names)
        return target / total if total > 0 and target > 0 else 1.0

    compute = ("attention", "shared", "experts")
    comm = ("dispatch", "combine")
    k_compute, k_comm = scale(compute_ms, compute), scale(comm_ms, comm)
    scaled = {n: getattr(point, n) * k_compute for n in compute}
    scaled.update({n: getattr(point, n) * k_comm for n in comm})
    return dataclasses.replace(point, **scaled, cuda_graph=True, compute_scale=k_compute,
                               comm_scale=k_comm)
