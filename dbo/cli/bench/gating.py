"""The gate: per point, no overlap, single-batch overlap (SBO), DBO or DBO with joined
experts, and why.

    gate = GatePolicy(min_tokens_per_rank=512, min_gain=0.03)
    decision = gate.decide(tokens_per_rank=1024, ceiling=1.21)      # the DBO rules
    decision.use_dbo, decision.reason
    choice = gate.choose(dbo=decision, dbo_trials=[1.05], sbo_trials=[1.08])
    choice.mode, choice.reason                                       # "sbo", why

Three rules, in order, decided *before* looking at the reported DBO-on time (an oracle
that picked the faster of the two reported times would prove nothing):

1. thresholds: below `min_tokens_per_rank` the ubatches are too small for their GEMMs
   to stay efficient and the per-step overheads (split vote, greenlet switches, a second
   set of launches) dominate;
2. the probe: where the measured ceiling T_serial / T_both is below 1 + `min_gain`,
   there is too little communication to hide for the split to pay for itself.

3. the trials: a separate, short timing of the DBO step (its own steps, not the ones
   reported) against the DBO-off time, one per round; where the worst of them is below
   `min_trial_speedup` DBO stays off. This catches what the GPU-side probe cannot see:
   a host-bound step, where launching two ubatches' kernels from Python takes longer
   than the GPU work they overlap (measured: 1024 tokens/rank at DeepSeek-V3 shapes on
   2x H200). Host-bound steps also vary most from run to run: on 4x H200 one 3-step
   trial saw a2a at 1024 tokens 1.070x faster with DBO, while the reported rounds
   measured it 0.959x (BENCHMARKS.md section 3). Hence the worst trial, not
   one. A serving system would run the same trials per batch-size bucket at start-up.

Without a probe (CPU) the probe rule is skipped, and the reason says so.

DBO with joined experts (`DBOConfig(joined_experts=True)`: each MoE layer's experts run
once over both ubatches' rows) splits the step as DBO does, so the same three rules gate
it (`decide(name="joined")`), with its own trials.

SBO splits nothing: no ubatch shrinks, no weight is read twice, no kernel launched twice,
so the thresholds and the probe's ceiling (made for the split) do not gate it; only its
own trials do, as rule 3 for DBO: the worst of them at least `min_trial_speedup`.
`choose` takes, among the modes that pass, the one whose worst trial is fastest, else no
overlap. On a tie it takes the one that changes the unsplit step least: SBO (no split),
then joined (split, but each expert's weights still read once and its GEMMs as large as
unsplit), then DBO (split, the experts run twice on half the rows). Every rank computes
the same choice: each trial speedup is the slowest rank's time against the slowest
rank's (`timing.Timing.max_ms`, gathered from all ranks), the same numbers everywhere.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

#: Each split mode's costs that a failed trial names (`GatePolicy.decide`'s `name`).
SPLIT_COSTS = {"DBO": "host launches, smaller GEMMs",
               "joined": "host launches, smaller attention GEMMs, experts no longer under "
                         "the other ubatch's transfers"}
#: The gated modes on a tie of their worst trials, first preferred (module doc).
TIE_ORDER = ("sbo", "joined", "dbo")
_LABELS = {"sbo": "SBO", "dbo": "DBO", "joined": "joined"}


@dataclass(frozen=True)
class GateDecision:
    """Whether the gated policy runs this point with a split mode (DBO, or DBO with joined
    experts: `GatePolicy.decide`'s `name`), and why."""

    use_dbo: bool
    reason: str

    @property
    def choice(self) -> str:
        return "dbo" if self.use_dbo else "off"


@dataclass(frozen=True)
class GateChoice:
    """The gated mode of one point, "off", "sbo", "dbo" or "joined", and why."""

    mode: str
    reason: str


@dataclass(frozen=True, kw_only=True)
class GatePolicy:
    """Thresholds and the minimum measured ceiling gain for running a step with DBO."""

    min_tokens_per_rank: int
    """Steps with fewer tokens per rank run without DBO."""
    min_gain: float
    """Steps whose measured ceiling is below 1 + min_gain run without DBO."""
    min_trial_speedup: float = 1.01
    """Steps whose worst trial DBO speedup is below this run without DBO."""

    def __post_init__(self) -> None:
        if self.min_tokens_per_rank < 0:
            raise ValueError(f"GatePolicy.min_tokens_per_rank={self.min_tokens_per_rank}: "
                             f"must be >= 0")
        if self.min_gain < 0:
            raise ValueError(f"GatePolicy.min_gain={self.min_gain}: must be >= 0 (0.03 = 3%)")

    def decide(self, *, tokens_per_rank: int, ceiling: Optional[float],
               trial_speedups: Sequence[float] = (),
               no_probe_reason: str = "no ceiling probe", name: str = "DBO") -> GateDecision:
        """The gated choice for one step; `ceiling` None when the probe did not run,
        `trial_speedups` empty when no trial ran (the worst one counts). `name`: the split
        mode whose trials these are, "DBO" or "joined" (the same rules gate both)."""
        if name not in SPLIT_COSTS:
            raise ValueError(f"GatePolicy.decide(name={name!r}): the split rules gate "
                             f"{' or '.join(map(repr, SPLIT_COSTS))}")
        floor = 1.0 + self.min_gain
        worst = min(trial_speedups, default=None)
        of_trials = (f" (worst of {len(trial_speedups)} trials)" if len(trial_speedups) > 1
                     else "")
        if tokens_per_rank < self.min_tokens_per_rank:
            return GateDecision(False, f"threshold: {tokens_per_rank} tokens/rank < "
                                       f"{self.min_tokens_per_rank}")
        if ceiling is not None and ceiling < floor:
            return GateDecision(False, f"probe: measured ceiling {ceiling:.3f}x < "
                                       f"{floor:.3f}x (1 + min_gain): too little comm to hide")
        if worst is not None and worst < self.min_trial_speedup:
            return GateDecision(False, f"trial: {name} {worst:.3f}x{of_trials} < "
                                       f"{self.min_trial_speedup:.3f}x in a separate short "
                                       f"run: splitting costs more ({SPLIT_COSTS[name]}) "
                                       f"than the overlap gains")
        passed = [f"{tokens_per_rank} tokens/rank >= {self.min_tokens_per_rank}"]
        passed.append(no_probe_reason if ceiling is None
                      else f"measured ceiling {ceiling:.3f}x >= {floor:.3f}x")
        if worst is not None:
            passed.append(f"trial {name} {worst:.3f}x{of_trials} >= "
                          f"{self.min_trial_speedup:.3f}x")
        return GateDecision(True, "; ".join(passed))

    def choose(self, *, dbo: Optional[GateDecision], dbo_trials: Sequence[float] = (),
               sbo_trials: Sequence[float] = (), dbo_missing: str = "",
               sbo_missing: str = "", joined: Optional[GateDecision] = None,
               joined_trials: Sequence[float] = (), joined_missing: str = "") -> GateChoice:
        """The point's mode among off / sbo / dbo / joined (module doc). `dbo`, `joined`:
        the split rules' decisions (`decide`), None where that mode was not timed
        (`dbo_missing`, `joined_missing` say why; `joined` None with no
        `joined_missing`: joined is not gated here at all, and the reason leaves it out);
        `sbo_missing`: why SBO was not timed ("" where it was, with `sbo_trials`)."""
        sbo_ok, sbo_reason = self._sbo_verdict(sbo_trials, sbo_missing)
        verdicts = {"sbo": (sbo_ok, sbo_reason, min(sbo_trials, default=None)),
                    "dbo": _split_verdict(dbo, dbo_trials, dbo_missing)}
        if joined is not None or joined_missing:
            verdicts["joined"] = _split_verdict(joined, joined_trials, joined_missing)
        why = "; ".join(f"{_LABELS[mode]}: {reason}"
                        for mode, (_, reason, _) in verdicts.items())
        passing = [(mode, verdicts[mode][2]) for mode in TIE_ORDER
                   if mode in verdicts and verdicts[mode][0]]
        if not passing:
            return GateChoice("off", why)
        if len(passing) == 1:
            return GateChoice(passing[0][0], why)
        return GateChoice(*_fastest(passing, why))

    def _sbo_verdict(self, trials: Sequence[float], missing: str) -> tuple[bool, str]:
        """Whether SBO passes its one rule, and why."""
        if missing:
            return False, missing
        if not trials:
            return False, "no SBO trial ran"
        worst = min(trials)
        of_trials = f" (worst of {len(trials)} trials)" if len(trials) > 1 else ""
        if worst < self.min_trial_speedup:
            return False, (f"trial SBO {worst:.3f}x{of_trials} < {self.min_trial_speedup:.3f}x "
                           f"in a separate short run: reordering the step (shared experts "
                           f"under the dispatch, expert work under the combine) hides less "
                           f"than it costs")
        return True, (f"trial SBO {worst:.3f}x{of_trials} >= {self.min_trial_speedup:.3f}x "
                      f"(no split: thresholds and probe do not apply)")


def _split_verdict(decision: Optional[GateDecision], trials: Sequence[float],
                   missing: str) -> tuple[bool, str, Optional[float]]:
    """A split mode's (passes, why, worst trial or None)."""
    if decision is None:
        return False, missing, None
    return decision.use_dbo, decision.reason, min(trials, default=None)


def _fastest(passing: list[tuple[str, Optional[float]]], why: str) -> tuple[str, str]:
    """Among several passing (mode, worst trial) in `TIE_ORDER`, the fastest worst trial
    (a mode without a trial last; the first on a tie), and why."""
    mode, worst = max(passing, key=lambda p: -math.inf if p[1] is None else p[1])
    count = "both" if len(passing) == 2 else f"all {len(passing)}"
    if worst is None:
        return mode, (f"{count} pass, none ran a trial: {_LABELS[mode]} first in the tie "
                      f"order (SBO, joined, DBO); {why}")
    versus = []
    for other, other_worst in passing:
        if other == mode:
            continue
        if other_worst is None:
            versus.append(f" ({_LABELS[other]} ran no trial)")
        else:
            versus.append(f" {'>' if worst > other_worst else '>='} {_LABELS[other]}'s "
                          f"{other_worst:.3f}x")
    return mode, (f"{count} pass, {_LABELS[mode]}'s worst trial {worst:.3f}x"
                  f"{','.join(versus)}; {why}")
