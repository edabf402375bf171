"""The gate: per point, no overlap, single-batch overlap (SBO) or DBO, and why.

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

SBO splits nothing: no ubatch shrinks, no weight is read twice, no kernel launched twice,
so the thresholds and the probe's ceiling (made for the split) do not gate it; only its
own trials do, as rule 3 for DBO: the worst of them at least `min_trial_speedup`.
`choose` takes whichever of the two passes; where both pass, the one whose worst trial
is faster (SBO on a tie: it splits nothing), else no overlap.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence


@dataclass(frozen=True)
class GateDecision:
    """Whether the gated policy runs this point with DBO, and why."""

    use_dbo: bool
    reason: str

    @property
    def choice(self) -> str:
        return "dbo" if self.use_dbo else "off"


@dataclass(frozen=True)
class GateChoice:
    """The gated mode of one point, "off", "sbo" or "dbo", and why."""

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
               no_probe_reason: str = "no ceiling probe") -> GateDecision:
        """The gated choice for one step; `ceiling` None when the probe did not run,
        `trial_speedups` empty when no trial ran (the worst one counts)."""
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
            return GateDecision(False, f"trial: DBO {worst:.3f}x{of_trials} < "
                                       f"{self.min_trial_speedup:.3f}x in a separate short "
                                       f"run: splitting costs more (host launches, smaller "
                                       f"GEMMs) than the overlap gains")
        passed = [f"{tokens_per_rank} tokens/rank >= {self.min_tokens_per_rank}"]
        passed.append(no_probe_reason if ceiling is None
                      else f"measured ceiling {ceiling:.3f}x >= {floor:.3f}x")
        if worst is not None:
            passed.append(f"trial DBO {worst:.3f}x{of_trials} >= "
                          f"{self.min_trial_speedup:.3f}x")
        return GateDecision(True, "; ".join(passed))

    def choose(self, *, dbo: Optional[GateDecision], dbo_trials: Sequence[float] = (),
               sbo_trials: Sequence[float] = (), dbo_missing: str = "",
               sbo_missing: str = "") -> GateChoice:
        """The point's mode among off / sbo / dbo (module doc). `dbo`: the DBO rules'
        decision (`decide`), None where DBO was not timed (`dbo_missing` says why);
        `sbo_missing`: why SBO was not timed ("" where it was, with `sbo_trials`)."""
        sbo_ok, sbo_reason = self._sbo_verdict(sbo_trials, sbo_missing)
        dbo_ok = dbo is not None and dbo.use_dbo
        dbo_reason = dbo.reason if dbo is not None else dbo_missing
        why = f"SBO: {sbo_reason}; DBO: {dbo_reason}"
        if sbo_ok and dbo_ok:
            worst_sbo, worst_dbo = min(sbo_trials), min(dbo_trials, default=None)
            if worst_dbo is not None and worst_dbo > worst_sbo:
                return GateChoice("dbo", f"both pass, DBO's worst trial {worst_dbo:.3f}x > "
                                         f"SBO's {worst_sbo:.3f}x; {why}")
            versus = (" (DBO ran no trial)" if worst_dbo is None
                      else f" >= DBO's {worst_dbo:.3f}x")
            return GateChoice("sbo", f"both pass, SBO's worst trial {worst_sbo:.3f}x"
                                     f"{versus}; {why}")
        if sbo_ok:
            return GateChoice("sbo", why)
        if dbo_ok:
            return GateChoice("dbo", why)
        return GateChoice("off", why)

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
