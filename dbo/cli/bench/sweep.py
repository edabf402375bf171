"""The sweep: tokens per rank x backend x DBO off / SBO / DBO on / DBO with joined experts,
the ceiling probe, the gate.

    result = run_sweep(cfg, group=dist.group.WORLD, device=device)   # on every rank
    result.points[0].speedup, result.points[0].gate, ...

Per point (backend outer, tokens inner, so a model is rebuilt only when it must be),
`rounds` times in a row: DBO off timed, the ceiling probed on that same workload (GPU),
single-batch overlap (SBO) timed on that same model (`dbo.cli.bench.sbo`), DBO on timed,
then its split compute (GPU; `dbo.cli.bench.ceiling.probe_split_compute`), then DBO with
joined experts on the DBO-on model (`dbo.cli.bench.joined`); `--overlaps` leaves out any
of SBO, DBO and joined.
A backend whose exchange is not made of the collectives the probe records (DeepEP,
symm_mem: `dbo.cli.bench.probe_scope`) gets no probe, split compute, phase times or
prediction; its point says why (`probe_note`).
In round 0 the point's per-phase times are measured too (`dbo.cli.bench.phases`;
eagerly, then under --cuda-graph scaled to the probe's graphed compute alone and comm
alone, `phases.to_graph_mode`), and the cost model's prediction from them is reported beside the measured times
(`dbo.cli.bench.predicted`). Then the gate is decided from the tokens and the measured
ceiling and trials, or, where a --calibration's measured points cover the point, from
the prediction, with no trial steps. Times are medians
of `iters` steps per rank (see `dbo.cli.bench.timing`), folded over the rounds (per rank,
the median of the round medians); the derived figures use the slowest rank's time (the
step time the group sees), and rank 0's are reported beside them. Alternating the
measurements puts slow drift (clocks, host load) into all of them alike; each
round's eta is kept, and its range is reported beside the eta of the medians. On a GPU,
rank 0's SM clock is logged in the background (`moe.bench.gpu_clocks.ClockLog`), and each point
reports its median over the no-DBO, DBO, split and probe timings (`sm_mhz`, `capped`): the GPU
runs these steps at its power limit, where the clock moves with the load.
With `cuda_graph` (`--cuda-graph`) every timing is of CUDA graph replays: DBO off, the
probe's timings and the split compute are each captured whole after their warmup
(`timing.time_steps`); DBO on runs through a `dbo.graphs.GraphedRunner`, which votes on
each step and replays its graph. A point's figures, and their definitions (in every JSON
output), are `dbo.cli.bench.point`'s.
"""
from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

from dbo import Calibration, MeasuredPoint
from dbo.cli.bench.ceiling import moe_layers, probe_ceiling, probe_split_compute
from dbo.cli.bench.config import BenchConfig
from dbo.cli.bench.gating import GatePolicy
from dbo.cli.bench.joined import (attach_joined, decide_joined, joined_missing, joined_trials,
                                  measure_joined)
from dbo.cli.bench.phases import probe_phases, step_is_decode, to_graph_mode
from dbo.cli.bench.point import Point, Round, add_rounds, make_point
from dbo.cli.bench.predicted import (attach_prediction, bench_calibration, bench_shape,
                                     covered)
from dbo.cli.bench.probe_scope import probe_scope
from dbo.cli.bench.sbo import (DBO_SKIPPED, attach_choice, attach_sbo, gate_point, measure_sbo,
                              sbo_missing)
from dbo.cli.bench.timing import SpanFn, no_spans, time_steps
from dbo.cli.bench.workload import WorkloadFactory
from traces.capture import capture
from moe.bench.gpu_clocks import ClockLog

PROBE_SKIPPED_CPU = ("skipped on CPU: gloo runs each collective synchronously on the "
                     "calling thread, there are no streams to overlap")
PROBE_MEASURED = ("measured: compute alone (collectives replaced by their recorded results), comm "
                  "alone (the step's recorded collectives replayed), both on two CUDA streams; "
                  "split: the DBO step's compute alone, the same way")


@dataclass
class SweepResult:
    config: BenchConfig
    world_size: int
    shapes: dict[str, Any]
    probe: str
    points: list[Point]


def run_sweep(cfg: BenchConfig, *, group: Optional[dist.ProcessGroup],
              device: torch.device, factory: Optional[WorkloadFactory] = None) -> SweepResult:
    """Run every point on this rank (all ranks call this with the same `cfg`).
    `factory`: builds the workloads (default: a `WorkloadFactory` of `cfg`, `group`,
    `device`)."""
    if factory is None:
        factory = WorkloadFactory(cfg, group=group, device=device)
    gate = GatePolicy(min_tokens_per_rank=cfg.gate_min_tokens, min_gain=cfg.min_gain)
    calibration = bench_calibration(cfg.calibration)
    probe_note = PROBE_MEASURED if device.type == "cuda" else PROBE_SKIPPED_CPU
    show = cfg.progress and factory.rank == 0
    progress = Progress(len(cfg.backends) * len(cfg.tokens) * (1 + len(cfg.overlaps))
                        * cfg.rounds, enabled=show)
    timing = dict(device=device, group=group, warmup=cfg.warmup, iters=cfg.iters)
    clocks = ClockLog.start(device) if factory.rank == 0 else None
    points = []
    try:
        for backend in cfg.backends:
            for tokens in cfg.tokens:
                span = _clock_spans(clocks, backend, tokens)
                points.append(_measure_point(cfg, factory, gate, progress, backend=backend,
                                             tokens=tokens, timing=timing, span=span,
                                             calibration=calibration))
    finally:
        if clocks is not None:
            clocks.stop()
    if clocks is not None:
        for point in points:
            attach_clocks(point, clocks)
    progress.close()
    factory.release()
    return SweepResult(cfg, factory.world_size, factory.describe(), probe_note, points)


#: The timings whose clock a point reports (name -> label), in the report's order.
CLOCKED = {"nodbo": "no DBO", "dbo": "DBO", "split": "split", "compute": "compute",
           "comm": "comm", "both": "both", "sbo": "SBO", "joined": "joined"}


def _clock_spans(clocks: Optional[ClockLog], backend: str, tokens: int) -> SpanFn:
    """`span(name)` marks a timing of this point in the clock log (nothing without one)."""
    if clocks is None:
        return no_spans
    return lambda name: clocks.span((backend, tokens, name))


def attach_clocks(point: Point, clocks: ClockLog) -> None:
    """Set `sm_mhz` / `capped` of `point` from the (stopped) log, per timing with samples."""
    for name in CLOCKED:
        summary = clocks.summary((point.backend, point.tokens_per_rank, name))
        if summary is not None:
            point.sm_mhz[name] = float(summary["sm_mhz"])  # type: ignore[arg-type]
            point.capped[name] = str(summary["capped"])


def _measure_point(cfg: BenchConfig, factory: WorkloadFactory, gate: GatePolicy,
                   progress: "Progress", *, backend: str, tokens: int,
                   timing: dict[str, Any], span: SpanFn, calibration: Calibration) -> Point:
    """`cfg.rounds` rounds of (DBO off, the probe (GPU), SBO's trial and SBO, DBO's trial,
    DBO on, its split compute (GPU), joined's trial and joined), then the gate. Workloads
    die within a round, so the factory can free a model before building the next one."""
    on_gpu = factory.device.type == "cuda"
    rounds: list[Round] = []
    trial_speedups: list[float] = []
    phases: Optional[MeasuredPoint] = None
    sbo_note = ""
    joined_note = joined_missing(cfg)
    issue_only = False
    prediction = None  # the calibration's, where it covers this point: no trials then
    for index in range(cfg.rounds):
        tag = f" (round {index + 1}/{cfg.rounds})" if cfg.rounds > 1 else ""
        off = factory.get(tokens=tokens, backend=backend, dbo=False)
        # A backend that communicates outside the recorded collectives gets no probe,
        # no split compute and no phase times: they would be wrong (`probe_scope`).
        scope = probe_scope(off.model)
        probe = on_gpu and scope.measurable
        progress.step(f"{backend} T={tokens}/rank: DBO off" +
                      (" + ceiling probe" if probe else "") + tag)
        t_off = time_steps(off.step, **timing, span=span("nodbo"), cuda_graph=cfg.cuda_graph)
        if index == 0:
            _maybe_trace(cfg, factory, off.step, f"{backend}_T{tokens}_dbo-off")
        ceiling = (probe_ceiling(off, **timing, span=span, gemm_sm_carveout=cfg.gemm_sm_carveout,
                                 cuda_graph=cfg.cuda_graph) if probe else None)
        if index == 0 and scope.measurable:
            decode = step_is_decode(off, factory.dbo_config.split)
            prediction = covered(calibration, backend=backend, tokens=tokens, decode=decode)
            phases = probe_phases(off, **timing, tokens=tokens, decode=decode,
                                  backend=backend, label=f"bench {cfg.mode} {cfg.preset} "
                                  f"w{factory.world_size} {cfg.regime}")
            sbo_note = sbo_missing(cfg, off.model)
            # Only a backend that never waits on the device leaves a host time that is
            # the issue time alone: the cost model's host floor.
            issue_only = all(layer.backend.graph_safe for layer in moe_layers(off.model))
        sbo = None
        if not sbo_note:  # the SBO model is the DBO-off one: no rebuild between them
            progress.step(f"{backend} T={tokens}/rank: SBO" + tag)
            sbo = measure_sbo(factory, cfg, backend=backend, tokens=tokens, t_off=t_off,
                              timing=timing, span=span, trial=prediction is None)
        del off  # a2a_ll's DBO-on model differs: let the factory free this one first
        t_on = t_split = None
        was_split, split_reason = False, DBO_SKIPPED
        if "dbo" in cfg.overlaps:
            progress.step(f"{backend} T={tokens}/rank: DBO on" + tag)
            on = factory.get(tokens=tokens, backend=backend, dbo=True)
            # The gate's trial of this round: its own short timing, before (and apart
            # from) the reported one, against this round's DBO-off time, after as many
            # warmup steps. Trials of a host-bound point still spread widely (a2a at 1024
            # tokens on 4x H200: 0.67-1.07x within one run), hence one per round and the
            # worst decides.
            if prediction is None:
                trial = time_steps(on.step, **{**timing, "iters": cfg.gate_trial_iters})
                trial_speedups.append(t_off.max_ms / trial.max_ms)
            t_on = time_steps(on.step, **timing, span=span("dbo"))
            if index == 0:
                _maybe_trace(cfg, factory, on.step, f"{backend}_T{tokens}_dbo-on")
            was_split, split_reason = on.was_split, on.split_reason  # of the timed steps
            t_split = (probe_split_compute(on, **timing, span=span, cuda_graph=cfg.cuda_graph)
                       if probe else None)
            del on
        joined = None
        if not joined_note:  # the DBO-on model (a2a_ll's capacity): no rebuild after DBO on
            progress.step(f"{backend} T={tokens}/rank: joined experts" + tag)
            joined = measure_joined(factory, cfg, backend=backend, tokens=tokens, t_off=t_off,
                                    timing=timing, span=span, trial=prediction is None)
        rounds.append(Round(t_off, t_on, ceiling, was_split, split_reason, t_split, sbo,
                            joined))
    merged = Round.median(rounds)
    ceiling_x = None if merged.ceiling is None else merged.ceiling.ceiling
    no_probe = scope.gate_reason if not scope.measurable else "probe skipped on CPU"
    decision = (gate.decide(tokens_per_rank=tokens, ceiling=ceiling_x,
                            trial_speedups=trial_speedups, no_probe_reason=no_probe)
                if "dbo" in cfg.overlaps else None)
    sbo_rounds = [r.sbo for r in rounds if r.sbo is not None]
    joined_rounds = [r.joined for r in rounds if r.joined is not None]
    joined_decision = (decide_joined(gate, tokens=tokens, ceiling=ceiling_x,
                                     rounds=joined_rounds, no_probe_reason=no_probe)
                       if not joined_note else None)
    choice = gate_point(gate, dbo=decision, dbo_trials=trial_speedups, sbo_rounds=sbo_rounds,
                        sbo_note=sbo_note, dbo_note="" if decision else DBO_SKIPPED,
                        joined=joined_decision, joined_trials=joined_trials(joined_rounds),
                        joined_note=joined_note, prediction=prediction)
    point = make_point(cfg, backend=backend, tokens=tokens, world_size=factory.world_size,
                       t_off=merged.t_off, t_on=merged.t_on, ceiling=merged.ceiling,
                       split=merged.split, split_reason=merged.split_reason,
                       use_dbo=choice.mode == "dbo", gate_reason=choice.reason,
                       t_split=merged.t_split)
    add_rounds(point, rounds)
    point.trial_speedups = trial_speedups
    point.probe_note = scope.note
    attach_sbo(point, sbo_rounds, note=sbo_note)
    attach_joined(point, joined_rounds, note=joined_note)
    attach_choice(point, choice)
    if phases is not None:  # what `dbo plan` needs to find the roofline of this shape
        phases = bench_shape(phases, cfg, num_experts=factory.num_experts,
                             world_size=factory.world_size)
    if phases is not None and cfg.cuda_graph and merged.ceiling is not None:
        # The step times are of graph replays; the phases were timed eagerly.
        phases = to_graph_mode(phases, compute_ms=merged.ceiling.compute.max_ms,
                               comm_ms=merged.ceiling.comm.max_ms)
    if phases is not None and issue_only:
        # Eager: each step's issue time, its floor; graphed: the host's time around each
        # replay (the runner's vote), which the GPU waits for (`dbo.cost_model`).
        phases = dataclasses.replace(
            phases, host_ms=merged.t_off.host_max_ms or 0.0,
            host_dbo_ms=(merged.t_on.host_max_ms or 0.0) if merged.t_on is not None else 0.0,
            host_sbo_ms=point.host_sbo_ms or 0.0, host_joined_ms=point.host_joined_ms or 0.0)
    if phases is not None:
        attach_prediction(point, phases, calibration)
    return point


def _maybe_trace(cfg: BenchConfig, factory: WorkloadFactory, step: Any, name: str) -> None:
    """With --trace: one step under torch.profiler on every rank (the step's collectives
    must match), rank 0's trace kept under <out>/traces/."""
    if not cfg.trace:
        return
    out = Path(cfg.out_dir) / "traces"
    capture(step, out, name=name, title=f"dbo bench {name}", keep=factory.rank == 0)


class Progress:
    """A plain progress bar on stderr (one line per update when stderr is not a tty)."""

    def __init__(self, total: int, *, enabled: bool, width: int = 24) -> None:
        self.total, self.enabled, self.width = total, enabled, width
        self.done = 0
        self.tty = sys.stderr.isatty()

    def step(self, label: str) -> None:
        if not self.enabled:
            return
        self.done += 1
        filled = self.width * (self.done - 1) // max(self.total, 1)
        bar = "#" * filled + "." * (self.width - filled)
        line = f"[dbo bench] [{bar}] {self.done}/{self.total} {label}"
        if self.tty:
            sys.stderr.write("\r\033[K" + line)
        else:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled and self.tty:
            sys.stderr.write("\n")
            sys.stderr.flush()
