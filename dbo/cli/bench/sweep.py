"""The sweep: tokens per rank x backend x DBO off / SBO / DBO on, the ceiling probe, the gate.

    result = run_sweep(cfg, group=dist.group.WORLD, device=device)   # on every rank
    result.points[0].speedup, result.points[0].gate, ...

Per point (backend outer, tokens inner, so a model is rebuilt only when it must be),
`rounds` times in a row: DBO off timed, the ceiling probed on that same workload (GPU),
single-batch overlap (SBO) timed on that same model (`dbo.cli.bench.sbo`), DBO on timed,
then its split compute (GPU; `dbo.cli.bench.ceiling.probe_split_compute`); `--overlaps`
leaves out SBO or DBO.
A backend whose exchange is not made of the collectives the probe records (DeepEP,
symm_mem: `dbo.cli.bench.probe_scope`) gets no probe, split compute, phase times or
prediction; its point says why (`probe_note`).
In round 0 the point's per-phase times are measured too (`dbo.cli.bench.phases`), and
the cost model's prediction from them is reported beside the measured times
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
each step and replays its graph.

Definitions (also in every JSON output):
    tokens/s      = tokens per rank * world size / step time
    speedup       = T_noDBO / T_DBO
    speedup_sbo   = T_noDBO / T_SBO
    T_serial      = T_compute + T_comm             (both measured alone)
    ceiling       = T_serial / T_both
    T_split       = the DBO step with its collectives replaced by their results: its
                    compute alone, split in ubatches (GPU)
    eta           = (T_noDBO - T_DBO) / (T_noDBO - T_both); None when T_noDBO - T_both
                    is under 1% of T_noDBO (no headroom, or less than the timing noise);
                    above 1 where DBO's schedule beat the probe's interleaving (a note
                    says so)
    gated time    = the time of the mode the gate chose: T_DBO, T_SBO or T_noDBO
    best          = the fastest of the three reported times (an oracle, beside the gate)
"""
from __future__ import annotations

import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

from dbo.cli.bench.ceiling import Ceiling, median_ceiling, probe_ceiling, probe_split_compute
from dbo.cli.bench.config import BenchConfig
from dbo.calibration import Calibration, MeasuredPoint
from dbo.cli.bench.gating import GatePolicy
from dbo.cli.bench.phases import probe_phases, step_is_decode
from dbo.cli.bench.predicted import (PREDICTION_NOTE, attach_prediction, bench_calibration,
                                     covered)
from dbo.cli.bench.probe_scope import probe_scope
from dbo.cli.bench.sbo import (DBO_SKIPPED, SboRound, attach_sbo, best_overlap, gate_point,
                               measure_sbo, sbo_missing)
from dbo.cli.bench.timing import SpanFn, Timing, median_of_rounds, no_spans, time_steps
from dbo.cli.bench.workload import WorkloadFactory
from traces.capture import capture
from moe.bench.gpu_clocks import ClockLog

PROBE_SKIPPED_CPU = ("skipped on CPU: gloo runs each collective synchronously on the "
                     "calling thread, there are no streams to overlap")
PROBE_MEASURED = ("measured: compute alone (collectives replaced by their recorded results), comm "
                  "alone (the step's recorded collectives replayed), both on two CUDA streams; "
                  "split: the DBO step's compute alone, the same way")
DEFINITIONS = {
    "tokens_per_s": "tokens per rank * world size / step time",
    "step_time": ("per rank, the median over rounds of the median over iters of its steps; "
                  "the max over ranks unless *_rank0"),
    "speedup": "T_noDBO / T_DBO",
    "speedup_sbo": ("T_noDBO / T_SBO: single-batch overlap, the step unsplit through "
                    "DBOConfig(overlap='sbo'); null where not timed (sbo_note says why)"),
    "t_serial": "T_compute + T_comm, each measured alone",
    "ceiling": "T_serial / T_both",
    "ceiling_vs_nodbo": "T_noDBO / T_both",
    "t_split": ("the DBO step with every collective replaced by its recorded result: the "
                "compute a DBO step runs, split in ubatches, without communication (GPU). "
                "T_DBO - T_split: what comm still costs DBO; T_split - T_compute: what the "
                "split adds"),
    "eta": ("(T_noDBO - T_DBO) / (T_noDBO - T_both); null without a probe or when "
            "T_noDBO - T_both < 1% of T_noDBO"),
    "eta_min/eta_max": "the range of eta over the rounds, each round's eta from its own times",
    "host_nodbo_ms/host_dbo_ms": ("the host's time to issue one step (call to return, "
                                  "not waiting for the device), median, slowest rank"),
    "gated": ("the time of the gate's mode (gate: off, sbo or dbo); gated_speedup = "
              "T_noDBO / gated"),
    "best_overlap/best_speedup": ("the fastest of the reported off / sbo / dbo times and "
                                  "its T_noDBO / T; an oracle beside the gate's choice"),
    "pred": PREDICTION_NOTE,
    "probe_note": ("why the probe, the split compute and the phase times did not measure "
                   "this point (their fields are null), or empty"),
    "sm_mhz/capped": ("rank 0's median SM clock and power-capped samples (k/n) while each "
                      "timing ran: nodbo, dbo, split, the probe's compute, comm, both, "
                      "and sbo"),
}
ETA_NO_PROBE = "no probe, no T_both"
ETA_NO_HEADROOM = ("T_noDBO <= T_both: the unsplit step already runs at or under the "
                   "measured floor, there is nothing for DBO to recover")
# Below this share of T_noDBO the denominator of eta is within the spread of repeated
# step timings (~1% between rounds on one machine), and eta only amplifies that noise:
# a 0.02 ms headroom on a 12 ms step once printed eta = -181.
ETA_MIN_HEADROOM = 0.01
ETA_SMALL_HEADROOM = ("T_noDBO - T_both is under 1% of T_noDBO, inside the timing noise: "
                      "there is no measurable overlap for DBO to recover")
# The probe's `both` is one interleaving (each MoE layer's collectives issued beside its
# compute), not a bound on every schedule: on 4 ranks, where comm outweighs compute, its
# full-size transfers took 16-23% longer in sum beside the GEMMs than in a step without
# DBO, and DBO's half-size ones 5-16% (BENCHMARKS.md section 3).
ETA_ABOVE_ONE = ("eta > 1: the DBO step beat the probe's both; the probe's interleaving "
                 "slowed its transfers beside the GEMMs more than DBO's schedule did")


@dataclass
class Point:
    """One sweep point's measurements and derived figures (times in ms)."""

    regime: str
    mode: str
    preset: str
    backend: str
    tokens_per_rank: int
    world_size: int
    t_nodbo_ms: float
    t_nodbo_ms_rank0: float
    t_dbo_ms: Optional[float]  # None where --overlaps leaves DBO out (and its figures)
    t_dbo_ms_rank0: Optional[float]
    tokens_per_s_nodbo: float
    tokens_per_s_dbo: Optional[float]
    speedup: Optional[float]
    dbo_split: bool
    dbo_split_reason: str
    gate: str
    gate_reason: str
    t_gated_ms: float
    gated_speedup: float
    tokens_per_s_gated: float
    t_compute_ms: Optional[float] = None
    t_compute_ms_rank0: Optional[float] = None
    t_comm_ms: Optional[float] = None
    t_comm_ms_rank0: Optional[float] = None
    t_both_ms: Optional[float] = None
    t_both_ms_rank0: Optional[float] = None
    t_split_ms: Optional[float] = None
    t_split_ms_rank0: Optional[float] = None
    host_nodbo_ms: Optional[float] = None
    host_dbo_ms: Optional[float] = None
    t_serial_ms: Optional[float] = None
    ceiling: Optional[float] = None
    ceiling_vs_nodbo: Optional[float] = None
    tokens_per_s_ceiling: Optional[float] = None
    eta: Optional[float] = None
    eta_note: str = ""
    rounds: int = 1
    eta_min: Optional[float] = None
    eta_max: Optional[float] = None
    per_rank_ms: dict[str, list[float]] = field(default_factory=dict)
    rounds_ms: dict[str, list[float]] = field(default_factory=dict)
    eta_rounds: list[Optional[float]] = field(default_factory=list)
    # The gate's trial speedups, one per round (T_noDBO of the round / the trial's step).
    trial_speedups: list[float] = field(default_factory=list)
    # Rank 0's median SM clock (MHz) and power-capped samples ("k/n") per timing:
    # "nodbo", "dbo", "split", "sbo", the probe's "compute", "comm", "both" (GPU, where
    # readable).
    sm_mhz: dict[str, float] = field(default_factory=dict)
    capped: dict[str, str] = field(default_factory=dict)
    # The cost model's prediction from this point's measured phase times (`predicted`).
    t_nodbo_pred_ms: Optional[float] = None
    t_dbo_pred_ms: Optional[float] = None
    t_sbo_pred_ms: Optional[float] = None
    speedup_pred: Optional[float] = None
    pred_choice: str = ""
    pred_err_nodbo: Optional[float] = None
    pred_err_dbo: Optional[float] = None
    phase_ms: dict[str, float] = field(default_factory=dict)
    measured_point: Optional[MeasuredPoint] = None
    # Why the probe and the phase times did not measure this point ("" where they could
    # or, on CPU, where only the two-stream probe is skipped): `probe_scope`.
    probe_note: str = ""
    # Single-batch overlap (`dbo.cli.bench.sbo`): None where not timed, `sbo_note` why.
    t_sbo_ms: Optional[float] = None
    t_sbo_ms_rank0: Optional[float] = None
    host_sbo_ms: Optional[float] = None
    tokens_per_s_sbo: Optional[float] = None
    speedup_sbo: Optional[float] = None
    sbo_note: str = ""
    sbo_trial_speedups: list[float] = field(default_factory=list)
    pred_err_sbo: Optional[float] = None
    best_overlap: str = "off"
    best_speedup: float = 1.0

    def row(self) -> dict[str, Any]:
        """The flat fields (CSV columns), rounded for people."""
        nested = ("per_rank_ms", "rounds_ms", "eta_rounds", "trial_speedups", "sm_mhz",
                  "capped", "phase_ms", "measured_point", "sbo_trial_speedups")
        out = {k: v for k, v in asdict(self).items() if k not in nested}
        return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in out.items()}


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
           "comm": "comm", "both": "both", "sbo": "SBO"}


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
    DBO on, its split compute (GPU)), then the gate. Workloads die within a round, so the factory can
    free a model before building the next one."""
    on_gpu = factory.device.type == "cuda"
    rounds: list[Round] = []
    trial_speedups: list[float] = []
    phases: Optional[MeasuredPoint] = None
    sbo_note = ""
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
        rounds.append(Round(t_off, t_on, ceiling, was_split, split_reason, t_split, sbo))
    merged = Round.median(rounds)
    decision = (gate.decide(tokens_per_rank=tokens,
                            ceiling=None if merged.ceiling is None else merged.ceiling.ceiling,
                            trial_speedups=trial_speedups,
                            no_probe_reason=scope.gate_reason if not scope.measurable
                            else "probe skipped on CPU")
                if "dbo" in cfg.overlaps else None)
    sbo_rounds = [r.sbo for r in rounds if r.sbo is not None]
    choice = gate_point(gate, dbo=decision, dbo_trials=trial_speedups, sbo_rounds=sbo_rounds,
                        sbo_note=sbo_note, dbo_note="" if decision else DBO_SKIPPED,
                        prediction=prediction)
    point = make_point(cfg, backend=backend, tokens=tokens, world_size=factory.world_size,
                       t_off=merged.t_off, t_on=merged.t_on, ceiling=merged.ceiling,
                       split=merged.split, split_reason=merged.split_reason,
                       use_dbo=choice.mode == "dbo", gate_reason=choice.reason,
                       t_split=merged.t_split)
    add_rounds(point, rounds)
    point.trial_speedups = trial_speedups
    point.probe_note = scope.note
    attach_sbo(point, sbo_rounds, note=sbo_note, choice=choice)
    if phases is not None:
        attach_prediction(point, phases, calibration)
    return point


@dataclass(frozen=True)
class Round:
    """One round of a point: DBO off, the probe (None on CPU), SBO and DBO on (each None
    where not timed)."""

    t_off: Timing
    t_on: Optional[Timing]
    ceiling: Optional[Ceiling]
    split: bool
    split_reason: str
    t_split: Optional[Timing] = None
    sbo: Optional[SboRound] = None

    @staticmethod
    def median(rounds: list["Round"]) -> "Round":
        """Every timing folded over the rounds (per rank, the median of round medians)."""
        ceilings = [r.ceiling for r in rounds if r.ceiling is not None]
        splits = [r.t_split for r in rounds if r.t_split is not None]
        ons = [r.t_on for r in rounds if r.t_on is not None]
        return Round(median_of_rounds([r.t_off for r in rounds]),
                     median_of_rounds(ons) if len(ons) == len(rounds) else None,
                     median_ceiling(ceilings) if len(ceilings) == len(rounds) else None,
                     all(r.split for r in rounds), rounds[-1].split_reason,
                     median_of_rounds(splits) if len(splits) == len(rounds) else None)


def add_rounds(point: Point, rounds: list[Round]) -> None:
    """Record each round's step times (max over ranks) and eta, and eta's range."""
    point.rounds = len(rounds)
    point.rounds_ms = {"t_nodbo": [r.t_off.max_ms for r in rounds]}
    if all(r.t_on is not None for r in rounds):
        point.rounds_ms["t_dbo"] = [r.t_on.max_ms for r in rounds]  # type: ignore[union-attr]
    splits = [r.t_split for r in rounds if r.t_split is not None]
    if len(splits) == len(rounds):
        point.rounds_ms["t_split"] = [t.max_ms for t in splits]
    ceilings = [r.ceiling for r in rounds if r.ceiling is not None]
    if len(ceilings) == len(rounds):
        point.rounds_ms["t_both"] = [c.both.max_ms for c in ceilings]
    if len(ceilings) == len(rounds) and "t_dbo" in point.rounds_ms:
        etas = [efficiency(r.t_off.max_ms, r.t_on.max_ms, c.both.max_ms)[0]  # type: ignore[union-attr]
                for r, c in zip(rounds, ceilings)]
        point.eta_rounds = etas
        known = [e for e in etas if e is not None]
        if known:
            point.eta_min, point.eta_max = min(known), max(known)


def _maybe_trace(cfg: BenchConfig, factory: WorkloadFactory, step: Any, name: str) -> None:
    """With --trace: one step under torch.profiler on every rank (the step's collectives
    must match), rank 0's trace kept under <out>/traces/."""
    if not cfg.trace:
        return
    out = Path(cfg.out_dir) / "traces"
    capture(step, out, name=name, title=f"dbo bench {name}", keep=factory.rank == 0)


def make_point(cfg: BenchConfig, *, backend: str, tokens: int, world_size: int, t_off: Timing,
               t_on: Optional[Timing], ceiling: Optional[Ceiling], split: bool,
               split_reason: str, use_dbo: bool, gate_reason: str,
               t_split: Optional[Timing] = None) -> Point:
    """Derive one point's figures from its timings (see the module doc); `t_on` None
    where DBO was not timed. SBO's are set after (`dbo.cli.bench.sbo.attach_sbo`)."""
    total = tokens * world_size
    off_ms = t_off.max_ms
    on_ms = t_on.max_ms if t_on is not None else None
    gated_ms = on_ms if use_dbo and on_ms is not None else off_ms
    point = Point(
        regime=cfg.regime, mode=cfg.mode, preset=cfg.preset, backend=backend,
        tokens_per_rank=tokens, world_size=world_size,
        t_nodbo_ms=off_ms, t_nodbo_ms_rank0=t_off.rank0_ms,
        t_dbo_ms=on_ms, t_dbo_ms_rank0=t_on.rank0_ms if t_on is not None else None,
        tokens_per_s_nodbo=_rate(total, off_ms),
        tokens_per_s_dbo=_rate(total, on_ms) if on_ms is not None else None,
        speedup=off_ms / on_ms if on_ms is not None else None, dbo_split=split,
        dbo_split_reason=split_reason,
        gate="dbo" if use_dbo else "off", gate_reason=gate_reason, t_gated_ms=gated_ms,
        gated_speedup=off_ms / gated_ms, tokens_per_s_gated=_rate(total, gated_ms),
        eta_note=ETA_NO_PROBE, per_rank_ms={"t_nodbo": list(t_off.per_rank_ms)},
        host_nodbo_ms=t_off.host_max_ms,
        host_dbo_ms=t_on.host_max_ms if t_on is not None else None)
    if t_on is not None:
        point.per_rank_ms["t_dbo"] = list(t_on.per_rank_ms)
    point.best_overlap, point.best_speedup = best_overlap(point)
    if t_split is not None:
        point.t_split_ms, point.t_split_ms_rank0 = t_split.max_ms, t_split.rank0_ms
        point.per_rank_ms["t_split"] = list(t_split.per_rank_ms)
    if ceiling is not None:
        both_ms = ceiling.both.max_ms
        point.t_compute_ms = ceiling.compute.max_ms
        point.t_compute_ms_rank0 = ceiling.compute.rank0_ms
        point.t_comm_ms, point.t_comm_ms_rank0 = ceiling.comm.max_ms, ceiling.comm.rank0_ms
        point.t_both_ms, point.t_both_ms_rank0 = both_ms, ceiling.both.rank0_ms
        point.t_serial_ms = ceiling.serial_ms
        point.ceiling = ceiling.ceiling
        point.ceiling_vs_nodbo = off_ms / both_ms
        point.tokens_per_s_ceiling = _rate(total, both_ms)
        point.eta, point.eta_note = (efficiency(off_ms, on_ms, both_ms) if on_ms is not None
                                     else (None, f"DBO {DBO_SKIPPED}"))
        point.per_rank_ms.update(t_compute=list(ceiling.compute.per_rank_ms),
                                 t_comm=list(ceiling.comm.per_rank_ms),
                                 t_both=list(ceiling.both.per_rank_ms))
    return point


def efficiency(t_nodbo: float, t_dbo: float, t_both: float) -> tuple[Optional[float], str]:
    """eta = (T_noDBO - T_DBO) / (T_noDBO - T_both), or None and why."""
    headroom = t_nodbo - t_both
    if headroom <= 0:
        return None, ETA_NO_HEADROOM
    if headroom < ETA_MIN_HEADROOM * t_nodbo:
        return None, ETA_SMALL_HEADROOM
    eta = (t_nodbo - t_dbo) / headroom
    return eta, ETA_ABOVE_ONE if eta > 1 else ""


def _rate(tokens: int, ms: float) -> float:
    return tokens / (ms / 1e3) if ms > 0 else float("inf")


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
