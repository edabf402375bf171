"""One sweep point of `dbo bench`: its measured and derived figures (`Point`), how they
are derived from the timings (`make_point`, `efficiency`), and its rounds (`Round`,
`add_rounds`). The sweep (`dbo.cli.bench.sweep`) measures; this is arithmetic only.

    point = make_point(cfg, backend="a2a", tokens=4096, world_size=2, t_off=..., t_on=...,
                       ceiling=..., split=True, split_reason="...", use_dbo=True,
                       gate_reason="...")
    point.speedup, point.eta, point.row()

Definitions (also in every JSON output):
    tokens/s      = tokens per rank * world size / step time
    speedup       = T_noDBO / T_DBO
    speedup_sbo   = T_noDBO / T_SBO
    speedup_joined = T_noDBO / T_joined            (DBO with joined experts)
    T_serial      = T_compute + T_comm             (both measured alone)
    ceiling       = T_serial / T_both
    T_split       = the DBO step with its collectives replaced by their results: its
                    compute alone, split in ubatches (GPU)
    eta           = (T_noDBO - T_DBO) / (T_noDBO - T_both); None when T_noDBO - T_both
                    is under 1% of T_noDBO (no headroom, or less than the timing noise);
                    above 1 where DBO's schedule beat the probe's interleaving (a note
                    says so)
    gated time    = the time of the mode the gate chose: T_DBO, T_SBO, T_joined or T_noDBO
    best          = the fastest of the reported times (an oracle, beside the gate)
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from dbo import MeasuredPoint
from dbo.cli.bench.ceiling import Ceiling, median_ceiling
from dbo.cli.bench.config import BenchConfig
from dbo.cli.bench.predicted import PREDICTION_NOTE
from dbo.cli.bench.joined import JoinedRound
from dbo.cli.bench.sbo import DBO_SKIPPED, SboRound, best_overlap
from dbo.cli.bench.timing import Timing, median_of_rounds, rate

DEFINITIONS = {
    "tokens_per_s": "tokens per rank * world size / step time",
    "step_time": ("per rank, the median over rounds of the median over iters of its steps; "
                  "the max over ranks unless *_rank0"),
    "speedup": "T_noDBO / T_DBO",
    "speedup_sbo": ("T_noDBO / T_SBO: single-batch overlap, the step unsplit through "
                    "DBOConfig(overlap='sbo'); null where not timed (sbo_note says why)"),
    "speedup_joined": ("T_noDBO / T_joined: DBO with joined experts, the DBO step through "
                       "DBOConfig(joined_experts=True), each MoE layer's experts run once "
                       "over both ubatches' rows (each expert's weights read once per step); "
                       "null where not timed"),
    "joined_note": "why the joined step was not timed (t_joined_ms null), or empty",
    "joined_split": ("whether every timed joined step was split (joined_split_reason: the "
                     "runner's reason)"),
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
                                  "not waiting for the device), median, slowest rank; "
                                  "host_sbo_ms, host_joined_ms the same for SBO, joined"),
    "gated": ("the time of the gate's mode (gate: off, sbo, dbo or joined); gated_speedup "
              "= T_noDBO / gated"),
    "best_overlap/best_speedup": ("the fastest of the reported off / sbo / joined / dbo "
                                  "times (the first on a tie) and its T_noDBO / T; an "
                                  "oracle beside the gate's choice"),
    "pred": PREDICTION_NOTE,
    "probe_note": ("why the probe, the split compute and the phase times did not measure "
                   "this point (their fields are null), or empty"),
    "sm_mhz/capped": ("rank 0's median SM clock and power-capped samples (k/n) while each "
                      "timing ran: nodbo, dbo, split, the probe's compute, comm, both, "
                      "sbo and joined"),
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
    # "nodbo", "dbo", "split", "sbo", "joined", the probe's "compute", "comm", "both" (GPU, where
    # readable).
    sm_mhz: dict[str, float] = field(default_factory=dict)
    capped: dict[str, str] = field(default_factory=dict)
    # The cost model's prediction from this point's measured phase times (`predicted`).
    t_nodbo_pred_ms: Optional[float] = None
    t_dbo_pred_ms: Optional[float] = None
    t_sbo_pred_ms: Optional[float] = None
    t_joined_pred_ms: Optional[float] = None  # where the cost model predicts "joined"
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
    # DBO with joined experts (`dbo.cli.bench.joined`): None where not timed, `joined_note`
    # why.
    t_joined_ms: Optional[float] = None
    t_joined_ms_rank0: Optional[float] = None
    host_joined_ms: Optional[float] = None
    tokens_per_s_joined: Optional[float] = None
    speedup_joined: Optional[float] = None
    joined_note: str = ""
    joined_split: bool = False
    joined_split_reason: str = ""
    joined_trial_speedups: list[float] = field(default_factory=list)
    pred_err_joined: Optional[float] = None
    best_overlap: str = "off"
    best_speedup: float = 1.0

    def row(self) -> dict[str, Any]:
        """The flat fields (CSV columns), rounded for people."""
        nested = ("per_rank_ms", "rounds_ms", "eta_rounds", "trial_speedups", "sm_mhz",
                  "capped", "phase_ms", "measured_point", "sbo_trial_speedups",
                  "joined_trial_speedups")
        out = {k: v for k, v in asdict(self).items() if k not in nested}
        return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in out.items()}


@dataclass(frozen=True)
class Round:
    """One round of a point: DBO off, the probe (None on CPU), SBO, DBO on and joined
    (each None where not timed)."""

    t_off: Timing
    t_on: Optional[Timing]
    ceiling: Optional[Ceiling]
    split: bool
    split_reason: str
    t_split: Optional[Timing] = None
    sbo: Optional[SboRound] = None
    joined: Optional[JoinedRound] = None

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


def make_point(cfg: BenchConfig, *, backend: str, tokens: int, world_size: int, t_off: Timing,
               t_on: Optional[Timing], ceiling: Optional[Ceiling], split: bool,
               split_reason: str, use_dbo: bool, gate_reason: str,
               t_split: Optional[Timing] = None) -> Point:
    """Derive one point's figures from its timings (see the module doc); `t_on` None
    where DBO was not timed. SBO's and joined's are set after
    (`dbo.cli.bench.sbo.attach_sbo`, `dbo.cli.bench.joined.attach_joined`)."""
    total = tokens * world_size
    off_ms = t_off.max_ms
    on_ms = t_on.max_ms if t_on is not None else None
    gated_ms = on_ms if use_dbo and on_ms is not None else off_ms
    point = Point(
        regime=cfg.regime, mode=cfg.mode, preset=cfg.preset, backend=backend,
        tokens_per_rank=tokens, world_size=world_size,
        t_nodbo_ms=off_ms, t_nodbo_ms_rank0=t_off.rank0_ms,
        t_dbo_ms=on_ms, t_dbo_ms_rank0=t_on.rank0_ms if t_on is not None else None,
        tokens_per_s_nodbo=rate(total, off_ms),
        tokens_per_s_dbo=rate(total, on_ms) if on_ms is not None else None,
        speedup=off_ms / on_ms if on_ms is not None else None, dbo_split=split,
        dbo_split_reason=split_reason,
        gate="dbo" if use_dbo else "off", gate_reason=gate_reason, t_gated_ms=gated_ms,
        gated_speedup=off_ms / gated_ms, tokens_per_s_gated=rate(total, gated_ms),
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
        point.tokens_per_s_ceiling = rate(total, both_ms)
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

