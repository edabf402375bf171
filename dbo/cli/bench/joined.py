"""DBO with joined experts in the sweep: its timing in each round, its gate decision and
its fields on a point.

    note = joined_missing(cfg)                  # "" where this point times it
    r = measure_joined(factory, cfg, backend="a2a_ll", tokens=256, t_off=t_off,
                       timing=timing, span=span, trial=True)          # once per round
    decision = decide_joined(gate, tokens=256, ceiling=None, rounds=[r, ...],
                             no_probe_reason="probe skipped on CPU")   # the split rules
    attach_joined(point, [r, ...], note=note)   # t_joined_ms, speedup_joined, ...

A joined step is the DBO-on model (the same model, capacity and split as DBO on) called
through a runner with `DBOConfig(..., joined_experts=True)`: each MoE layer's experts run
once over both ubatches' dispatched rows (`dbo.meet`), so each expert's weights are read
once per step, while attention, dispatch and combine still overlap across the ubatches.
Under --cuda-graph it runs through a `GraphedRunner` as DBO does: the vote, then the
replay of the captured split step. Each round times it right after DBO on, with its own
gate trial first (a separate short timing against that round's DBO-off time). It splits
the step as DBO does, so the split rules gate it as they gate DBO (`dbo.cli.bench.gating`:
the thresholds, the probe's ceiling, then its own worst trial). `--overlaps` without
"joined" leaves it out; the point then says so (`joined_note`) and shows "-".
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

from dbo.cli.bench.config import BenchConfig
from dbo.cli.bench.gating import GateDecision, GatePolicy
from dbo.cli.bench.timing import SpanFn, Timing, set_mode_times, timed_with_trial
from dbo.cli.bench.workload import WorkloadFactory

JOINED_SKIPPED = "not timed (--overlaps without joined)"


@dataclass(frozen=True)
class JoinedRound:
    """One round's joined timing, its gate trial speedup (None where no trial ran) and
    whether the timed steps were split (why, or why not)."""

    timing: Timing
    trial: Optional[float]
    split: bool
    split_reason: str


def joined_missing(cfg: BenchConfig) -> str:
    """Why this sweep times no joined step, or "" where it does."""
    return "" if "joined" in cfg.overlaps else JOINED_SKIPPED


def measure_joined(factory: WorkloadFactory, cfg: BenchConfig, *, backend: str, tokens: int,
                   t_off: Timing, timing: dict[str, Any], span: SpanFn, trial: bool
                   ) -> JoinedRound:
    """One round's joined trial (where `trial`) and timing (every rank together)."""
    joined = factory.get(tokens=tokens, backend=backend, dbo=True, joined=True)
    # The trial: the slowest rank's times on both sides, the same on every rank, so every
    # rank's gate takes the same choice.
    t_joined, speedup = timed_with_trial(joined.step, t_off=t_off, timing=timing, trial=trial,
                                         trial_iters=cfg.gate_trial_iters,
                                         span=span("joined"))
    runner = joined.eager_runner
    assert runner is not None and runner.config.joined_experts, runner
    return JoinedRound(t_joined, speedup, joined.was_split, joined.split_reason)


def decide_joined(gate: GatePolicy, *, tokens: int, ceiling: Optional[float],
                  rounds: Sequence[JoinedRound], no_probe_reason: str) -> GateDecision:
    """The split rules' decision for the joined step (`GatePolicy.decide`, as for DBO):
    the thresholds, the probe's `ceiling` (None where it did not run), its worst trial."""
    return gate.decide(tokens_per_rank=tokens, ceiling=ceiling,
                       trial_speedups=joined_trials(rounds), no_probe_reason=no_probe_reason,
                       name="joined")


def joined_trials(rounds: Sequence[JoinedRound]) -> list[float]:
    """The trial speedups of the rounds that ran one."""
    return [r.trial for r in rounds if r.trial is not None]


def attach_joined(point: Any, rounds: Sequence[JoinedRound], *, note: str) -> None:
    """Set the joined fields of `point` (`dbo.cli.bench.point.Point`) from its rounds
    (none where `note` says why)."""
    point.joined_note = note
    if not rounds:
        return
    set_mode_times(point, "joined", [r.timing for r in rounds],
                   total_tokens=point.tokens_per_rank * point.world_size)
    point.joined_split = all(r.split for r in rounds)
    point.joined_split_reason = rounds[-1].split_reason
    point.joined_trial_speedups = joined_trials(rounds)
