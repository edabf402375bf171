"""The gate of `dbo bench --hf` prefill points (`dbo.cli.bench.hf_sweep`): per point no
overlap, SBO, DBO or DBO with joined experts, chosen as the layer bench chooses
(`dbo.cli.bench.gating`).

    gate = prefill_gate(cfg)      # --gate-min-tokens, --min-gain
    attach_gate(point, gate, ceiling=None, no_probe_reason="probe skipped on CPU",
                dbo_trials=[1.04, 0.99], sbo_trials=[1.02, 1.03],
                joined_trials=[1.05, 1.06], perf=True)
    point.gate, point.gate_reason, point.t_gated_ms, point.gated_speedup

Each round of a point times, apart from its reported steps, a short SBO step, a short
DBO-on step and a short joined step (`HFBenchConfig.gate_trial_iters` steps each, after
the same warmup) against that round's DBO-off time: their speedups are the point's
`sbo_trial_speedups`, `trial_speedups` and `joined_trial_speedups`. DBO passes its three
rules (`GatePolicy.decide`): the point's tokens per rank, the probe's ceiling where the
probe ran (GPU, a backend made of torch.distributed collectives; elsewhere the rule is
skipped and the reason says why), and the worst DBO trial; joined (a split step too)
passes the same rules with its own trials. SBO passes on its worst trial alone (it
splits nothing). The gate takes, of the modes that pass, the one with the fastest worst
trial (SBO, then joined, then DBO on a tie), else no overlap (`GatePolicy.choose`), as
the layer bench does. Nothing here looks at the reported times (an oracle picking the
fastest would prove nothing); the gated time is the chosen mode's reported time: T_DBO,
T_SBO, T_joined or T_noDBO.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

from dbo.cli.bench.gating import GateChoice, GatePolicy
from dbo.cli.bench.hf_config import HFBenchConfig

__all__ = ["attach_gate", "prefill_gate"]


def prefill_gate(cfg: HFBenchConfig) -> GatePolicy:
    """The gate of `cfg`'s prefill points: the layer bench's rules and thresholds."""
    return GatePolicy(min_tokens_per_rank=cfg.gate_min_tokens, min_gain=cfg.min_gain)


def attach_gate(point: Any, gate: GatePolicy, *, ceiling: Optional[float],
                no_probe_reason: str, dbo_trials: Sequence[float],
                sbo_trials: Sequence[float], joined_trials: Sequence[float] = (),
                perf: bool) -> GateChoice:
    """Gate `point` (an `hf_sweep.HFPoint` with its SBO and joined fields set:
    `attach_sbo`, `hf_joined.attach_joined`) and set `gate`, `gate_reason`, `t_gated_ms`,
    `gated_speedup` (T_noDBO / T_gated, None in a functional run: `perf` False) and the
    trial lists. `ceiling`: the probe's, None where it did not run (`no_probe_reason` says
    why); a point without an SBO step (`sbo_note`) cannot gate to SBO, whatever its
    trials; a point without a joined time is gated among off / sbo / dbo only."""
    rules = dict(tokens_per_rank=point.tokens_per_rank, ceiling=ceiling,
                 no_probe_reason=no_probe_reason)
    decision = gate.decide(trial_speedups=dbo_trials, **rules)
    joined = (gate.decide(trial_speedups=joined_trials, name="joined", **rules)
              if point.t_joined_ms is not None else None)
    choice = gate.choose(dbo=decision, dbo_trials=dbo_trials, sbo_trials=sbo_trials,
                         sbo_missing=point.sbo_note, joined=joined,
                         joined_trials=joined_trials)
    gated_ms = {"off": point.t_nodbo_ms, "sbo": point.t_sbo_ms, "dbo": point.t_dbo_ms,
                "joined": point.t_joined_ms}[choice.mode]
    assert gated_ms is not None, f"the gate chose {choice.mode}, which was not timed"
    point.gate, point.gate_reason = choice.mode, choice.reason
    point.t_gated_ms = gated_ms
    point.gated_speedup = point.t_nodbo_ms / gated_ms if perf else None
    point.trial_speedups, point.sbo_trial_speedups = list(dbo_trials), list(sbo_trials)
    point.joined_trial_speedups = list(joined_trials)
    return choice
