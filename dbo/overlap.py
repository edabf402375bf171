"""Which overlap a step runs: none, single-batch overlap (SBO) or two ubatches (DBO).

    plan = restrict_split(plan, config)                 # before the vote
    plan = choose_overlap(plan, config, sbo_blocker)    # after it: plan.overlap, plan.reason

The thresholds' side of the mode policy (`dbo.mode_policy`, which consults the
calibration's prediction first where it has one).

`DBOConfig.overlap` is the policy:
- "dbo": split where the thresholds say so (`dbo.split`), else no overlap (the default).
- "auto": split where the thresholds say so, else single-batch overlap where the model
  offers it: one ubatch under the scheduler, so nothing yields but the collectives run on
  the comm stream while the compute stream queues what does not need their results
  (`moe.modular_kernel`: the shared experts under the dispatch, the own rows under a
  split combine). Splitting reads the expert weights twice and launches every kernel
  twice; below the thresholds SBO hides some communication without either cost.
- "sbo": never split; single-batch overlap where the model offers it.
- "none": never split, no overlap.

The model offers SBO unless one of its modules' `dbo_sbo_blocker()` hooks gives a reason
(or none has the hook: then nothing would overlap; `dbo.model_hooks`). Every rank takes
the same mode with no collective of its own: it follows from the voted split and from
the configuration,
whose fields (the policy, each layer's backend, the model's SBO blocker) the vote's
fingerprint already covers (`dbo.step_vote`).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

from dbo.config import DBOConfig
from dbo.model_hooks import NO_SBO_HOOK, ModelHooks
from dbo.split import SplitPlan

__all__ = ["NO_SBO_HOOK", "choose_overlap", "collect_sbo_blocker", "restrict_split"]


def collect_sbo_blocker(model: Any) -> Optional[str]:
    """Why `model` cannot run a single-batch-overlap step (the first module's reason, or
    that none has the hook), or None when it can (`ModelHooks.sbo_blocker`)."""
    return ModelHooks.of(model).sbo_blocker


def restrict_split(plan: SplitPlan, config: DBOConfig) -> SplitPlan:
    """This rank's plan before the vote, unsplit where the policy never splits."""
    if not plan.split or config.overlap in ("dbo", "auto"):
        return plan
    return dataclasses.replace(
        plan, split=False, ubatches=(), num_tokens=(plan.total_tokens,),
        reason=f"DBOConfig.overlap={config.overlap!r} never splits (the thresholds "
               f"would have: {plan.reason})")


def choose_overlap(plan: SplitPlan, config: DBOConfig, sbo_blocker: Optional[str]
                   ) -> SplitPlan:
    """The voted plan with its mode (`SplitPlan.overlap`) and, when not split, why SBO
    was or was not taken (appended to its reason)."""
    if plan.split:
        return dataclasses.replace(plan, overlap="joined" if config.joined_experts else "dbo")
    if config.overlap in ("dbo", "none"):
        return dataclasses.replace(plan, overlap="none")
    if sbo_blocker is not None:
        return dataclasses.replace(plan, overlap="none",
                                   reason=f"{plan.reason}; no single-batch overlap: "
                                          f"{sbo_blocker}")
    return dataclasses.replace(plan, overlap="sbo",
                               reason=f"{plan.reason}: single-batch overlap")
