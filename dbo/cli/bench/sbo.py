"""Single-batch overlap (SBO) in the sweep: its timing in each round, its fields on a
point, and the point's gate among off / sbo / dbo / joined.

    note = sbo_missing(cfg, off.model)          # "" where this point times SBO
    r = measure_sbo(factory, cfg, backend="a2a_ll", tokens=256, t_off=t_off,
                    timing=timing, span=span, trial=True)          # once per round
    choice = gate_point(gate, dbo=decision, dbo_trials=[...], sbo_rounds=[r, ...],
                        sbo_note=note, dbo_note="", joined=joined_decision,
                        joined_trials=[...], joined_note="", prediction=None)
    attach_sbo(point, [r, ...], note=note)      # t_sbo_ms, speedup_sbo, ...
    attach_choice(point, choice)                # gate, gated time, best (oracle)

An SBO step is the DBO-off model called through a runner with `DBOConfig(overlap="sbo")`
(`dbo.overlap`): never split, its dispatch and combine on the comm stream with the
shared experts queued under the dispatch and each layer's own rows under its combine.
Under --cuda-graph it runs through a `GraphedRunner` as DBO does: the vote, then the
replay of the captured unsplit SBO step. Each round times it right after DBO off, with its
own gate trial first (as for DBO: a separate short timing against that round's DBO-off
time). A model whose layers offer no SBO (`dbo_sbo_blocker`) gets no SBO timing; the
point says why (`sbo_note`) and shows "-".
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

from dbo import collect_sbo_blocker
from dbo.cli.bench.config import BenchConfig
from dbo.cli.bench.gating import GateChoice, GateDecision, GatePolicy
from dbo.cli.bench.timing import SpanFn, Timing, rate, set_mode_times, timed_with_trial
from dbo.cli.bench.workload import WorkloadFactory

SBO_SKIPPED = "not timed (--overlaps without sbo)"
DBO_SKIPPED = "not timed (--overlaps without dbo)"
#: The cost model's name of each gated mode (`Prediction.chosen`) -> the bench's.
GATE_MODES = {"none": "off", "sbo": "sbo", "dbo": "dbo", "joined": "joined"}


@dataclass(frozen=True)
class SboRound:
    """One round's SBO timing and its gate trial speedup (None where no trial ran)."""

    timing: Timing
    trial: Optional[float]


def sbo_missing(cfg: BenchConfig, model: Any) -> str:
    """Why this point times no SBO step, or "" where it does."""
    if "sbo" not in cfg.overlaps:
        return SBO_SKIPPED
    blocker = collect_sbo_blocker(model)
    return "" if blocker is None else f"not offered: {blocker}"


def measure_sbo(factory: WorkloadFactory, cfg: BenchConfig, *, backend: str, tokens: int,
                t_off: Timing, timing: dict[str, Any], span: SpanFn, trial: bool
                ) -> SboRound:
    """One round's SBO trial (where `trial`) and timing (every rank together)."""
    sbo = factory.get(tokens=tokens, backend=backend, dbo=False, sbo=True)
    t_sbo, speedup = timed_with_trial(sbo.step, t_off=t_off, timing=timing, trial=trial,
                                      trial_iters=cfg.gate_trial_iters, span=span("sbo"))
    decision = sbo.runner.last_decision if sbo.runner is not None else None
    assert decision is not None and decision.overlap == "sbo", decision
    return SboRound(t_sbo, speedup)


def gate_point(gate: GatePolicy, *, dbo: Optional[GateDecision], dbo_trials: Sequence[float],
               sbo_rounds: Sequence[SboRound], sbo_note: str, dbo_note: str,
               joined: Optional[GateDecision] = None, joined_trials: Sequence[float] = (),
               joined_note: str = "", prediction: Any = None) -> GateChoice:
    """The point's gated mode: from the trials (`GatePolicy.choose`), or from the cost
    model's `prediction` (`dbo.cost_model.Prediction`) where a calibration covers the
    point; a predicted mode that was not timed here leaves the point off. `joined`,
    `joined_trials`, `joined_note`: DBO with joined experts, as `dbo`'s
    (`dbo.cli.bench.joined`)."""
    if prediction is not None:
        mode = GATE_MODES[prediction.chosen]
        missing = {"sbo": sbo_note, "dbo": dbo_note, "joined": joined_note}.get(mode, "")
        if missing:
            return GateChoice("off", f"prediction: {prediction.reason}; but {mode} is "
                                     f"{missing}")
        return GateChoice(mode, f"prediction: {prediction.reason}")
    trials = [r.trial for r in sbo_rounds if r.trial is not None]
    return gate.choose(dbo=dbo, dbo_trials=dbo_trials, sbo_trials=trials,
                       dbo_missing=dbo_note, sbo_missing=sbo_note, joined=joined,
                       joined_trials=joined_trials, joined_missing=joined_note)


def attach_sbo(point: Any, rounds: Sequence[SboRound], *, note: str) -> None:
    """Set the SBO fields of `point` (`dbo.cli.bench.point.Point`) from its rounds (none
    where `note` says why)."""
    point.sbo_note = note
    if rounds:
        set_mode_times(point, "sbo", [r.timing for r in rounds],
                       total_tokens=point.tokens_per_rank * point.world_size)
        point.sbo_trial_speedups = [r.trial for r in rounds if r.trial is not None]


def attach_choice(point: Any, choice: GateChoice) -> None:
    """Set the gate of `point` from `choice`, its gated time, and the best of its reported
    times (its SBO and joined fields set first: `attach_sbo`, `attach_joined`)."""
    gated_ms = {"off": point.t_nodbo_ms, "sbo": point.t_sbo_ms, "dbo": point.t_dbo_ms,
                "joined": point.t_joined_ms}[choice.mode]
    assert gated_ms is not None, f"the gate chose {choice.mode}, which was not timed"
    point.gate, point.gate_reason = choice.mode, choice.reason
    point.t_gated_ms, point.gated_speedup = gated_ms, point.t_nodbo_ms / gated_ms
    point.tokens_per_s_gated = _rate(point, gated_ms)
    point.best_overlap, point.best_speedup = best_overlap(point)


def best_overlap(point: Any) -> tuple[str, float]:
    """The fastest of the point's reported times, off / sbo / joined / dbo (the first on
    a tie: the gate's tie order, `gating.TIE_ORDER`), and its speedup over no overlap: an
    oracle of the reported steps, shown beside the gate's choice (which never looks at
    them)."""
    speedups = {"off": 1.0, "sbo": point.speedup_sbo, "joined": point.speedup_joined,
                "dbo": point.speedup}
    timed = {mode: s for mode, s in speedups.items() if s is not None}
    mode = max(timed, key=lambda m: timed[m])
    return mode, timed[mode]


def _rate(point: Any, ms: float) -> float:
    return rate(point.tokens_per_rank * point.world_size, ms)
