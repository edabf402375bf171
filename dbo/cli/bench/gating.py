"""The DBO gate: keep DBO off where it would lose, and say why.

    gate = GatePolicy(min_tokens_per_rank=512, min_gain=0.03)
    decision = gate.decide(tokens_per_rank=1024, ceiling=1.21)
    decision.use_dbo, decision.reason

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
