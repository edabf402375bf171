"""The choice of a step's mode: two ubatches (DBO; "joined" where `DBOConfig.joined_experts`
joins their experts), single-batch overlap (SBO) or none, behind one interface that a
runner consults once per step.

    policy = ModePolicy(predictor)                  # one per runner; predictor may be None
    wish = policy.wish(config, cut, recut)          # before the vote: this rank's Wish
    plan = policy.settle(config, wish, voted, sbo_blocker)   # after it: from voted data

Two sources decide, in this order:
- the calibration's prediction (`dbo.predicted_overlap`), with a calibration and
  `DBOConfig(overlap="auto")` (not for a callable split), where it covers the shape:
  before the vote this rank wishes to split (thresholds aside) where DBO is predicted
  fastest at its own shape, else not; after it an unsplit step takes SBO or none as
  predicted at the group's shape (its largest token count, and decode only where every
  rank's step is: voted), so every rank takes the same mode. No trial steps: the
  reason says "predicted ...", logged once per shape.
- else the thresholds (`dbo.split.balance`) and `DBOConfig.overlap` (`dbo.overlap`):
  `restrict_split` before the vote, `choose_overlap` after it.

The prediction is consulted once, at this rank's shape, in `wish`; `settle` derives the
mode from the voted plan and carries that prediction over where the group's shape is
this rank's own. Where the vote says the group's shape differs (ranks with other token
counts, or a prefill step beside decode steps), the mode must follow the group's shape
on every rank, so it is predicted there (the predictor keeps one prediction per shape).
Every input of `settle` is voted or agreed: the split, the group's figures, the config,
the calibration's digest and the model's SBO blocker (`dbo.step_vote`).
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Callable, Optional

from dbo.config import DBOConfig
from dbo.cost_model import Prediction
from dbo.overlap import choose_overlap, restrict_split
from dbo.predicted_overlap import OverlapPredictor
from dbo.split import CallSplit, SplitPlan

__all__ = ["ModePolicy", "Wish", "choose_predicted", "group_is_decode"]

logger = logging.getLogger("dbo.runner")  # the runner's log, as before the policy had one

# A step's shape as the predictor sees it: (tokens per rank, decode).
Shape = tuple[int, bool]


@dataclass(frozen=True)
class Wish:
    """This rank's side of a step before the vote: the plan it votes with and, when
    split, the ubatches' inputs (`cut`), and the prediction it was consulted for."""

    cut: CallSplit
    """`cut.plan` is the wish the vote carries."""
    shape: Optional[Shape] = None
    """The shape the prediction was consulted at; None where it was not."""
    prediction: Optional[Prediction] = None
    """The prediction at `shape`; None where not covered (or not consulted)."""

    @property
    def plan(self) -> SplitPlan:
        return self.cut.plan


class ModePolicy:
    """A runner's choice of mode (module doc). `predictor`: the calibration's, or None
    (then only the thresholds decide)."""

    def __init__(self, predictor: Optional[OverlapPredictor] = None) -> None:
        self.predictor = predictor
        self._explained: set[Shape] = set()  # shapes whose choice was logged

    def predicts(self, config: DBOConfig) -> bool:
        """Whether the prediction decides where it covers the shape."""
        return (self.predictor is not None and config.overlap == "auto"
                and not callable(config.split))

    def wish(self, config: DBOConfig, cut: CallSplit, recut: Callable[[], CallSplit]
             ) -> Wish:
        """This rank's wish from `cut` (the split mode's cut under the thresholds);
        `recut()`: the cut as if both thresholds were 0, asked only where DBO is
        predicted fastest but the thresholds did not split."""
        if self.predicts(config):
            assert self.predictor is not None
            shape = (cut.plan.total_tokens, cut.plan.is_decode)
            prediction = self.predictor.predict(tokens=shape[0], decode=shape[1])
            if prediction is not None:
                return Wish(_predicted_cut(cut, prediction, recut), shape, prediction)
            cut = self._restricted(cut, config)
            return Wish(cut, shape, None)
        return Wish(self._restricted(cut, config))

    def settle(self, config: DBOConfig, wish: Wish, voted: SplitPlan,
               sbo_blocker: Optional[str]) -> SplitPlan:
        """The voted plan (`dbo.vote.plan_after_vote` of `wish.plan`) with the step's
        mode and its reason: the same on every rank, from voted and agreed data only."""
        if not config.enabled:
            return voted
        if self.predicts(config):
            assert self.predictor is not None
            shape = (voted.group_max_tokens if voted.group_max_tokens is not None
                     else voted.total_tokens, group_is_decode(voted))
            prediction = (wish.prediction if shape == wish.shape else
                          self.predictor.predict(tokens=shape[0], decode=shape[1]))
            if prediction is not None:
                chosen = choose_predicted(voted, prediction, self.predictor.margin,
                                          sbo_blocker, joined=config.joined_experts)
                self._explain(voted, chosen)
                return chosen
        return choose_overlap(voted, config, sbo_blocker)

    def _restricted(self, cut: CallSplit, config: DBOConfig) -> CallSplit:
        restricted = restrict_split(cut.plan, config)
        return cut if restricted is cut.plan else CallSplit(plan=restricted)

    def _explain(self, plan: SplitPlan, chosen: SplitPlan) -> None:
        """Log the predicted choice once per shape."""
        shape = (plan.group_max_tokens or plan.total_tokens, group_is_decode(plan))
        if shape not in self._explained:
            self._explained.add(shape)
            logger.info("dbo: %d %s tokens/rank run %s: %s", shape[0],
                        "decode" if shape[1] else "prefill", chosen.overlap, chosen.reason)


def _predicted_cut(cut: CallSplit, prediction: Prediction,
                   recut: Callable[[], CallSplit]) -> CallSplit:
    """This rank's wish where the calibration covers its shape: split (thresholds aside)
    where DBO is predicted fastest, else unsplit."""
    plan = cut.plan
    why = f"predicted {prediction.reason}"
    if prediction.chosen not in ("dbo", "joined"):
        return CallSplit(plan=dataclasses.replace(
            plan, split=False, ubatches=(), num_tokens=(plan.total_tokens,), reason=why))
    if not plan.split:  # below a threshold, perhaps: the prediction overrides it
        cut = recut()
        plan = cut.plan
    if not plan.split:  # e.g. one request that may not be cut
        return CallSplit(plan=dataclasses.replace(plan, reason=f"{why}, but {plan.reason}"))
    return dataclasses.replace(cut, plan=dataclasses.replace(plan, reason=f"{why} ({plan.reason})"))


def group_is_decode(plan: SplitPlan) -> bool:
    """Whether the group's step is decode-shaped: every rank's, as the vote found
    (`SplitPlan.group_decode`), so every rank predicts the same shape; this rank's own
    where no vote ran."""
    return plan.group_decode if plan.group_decode is not None else plan.is_decode


def choose_predicted(plan: SplitPlan, prediction: Prediction, margin: float,
                     sbo_blocker: Optional[str], *, joined: bool = False) -> SplitPlan:
    """The voted `plan` with the mode `prediction` (at the group's shape) gives. Split:
    DBO, its experts joined where `joined` (`DBOConfig.joined_experts`). Unsplit:
    single-batch overlap where it is predicted to win by `margin` and the model offers it
    (`sbo_blocker` None), else none, predicted at the group's largest token count
    (`plan.group_max_tokens`, the same on every rank)."""
    tokens = plan.group_max_tokens if plan.group_max_tokens is not None else plan.total_tokens
    if plan.split:
        return dataclasses.replace(plan, overlap="joined" if joined else "dbo")
    reason = plan.reason
    if not (reason.startswith("predicted") and tokens == plan.total_tokens):
        reason = f"{reason}; at the group's {tokens} tokens/rank predicted {prediction.reason}"
    sbo_gain = prediction.gain("sbo")
    if sbo_gain < margin:
        return dataclasses.replace(plan, overlap="none", reason=(
            f"{reason}; no overlap (sbo predicted {sbo_gain:+.1%})"))
    if sbo_blocker is not None:
        return dataclasses.replace(plan, overlap="none", reason=(
            f"{reason}; no single-batch overlap: {sbo_blocker}"))
    return dataclasses.replace(plan, overlap="sbo", reason=f"{reason}: single-batch overlap")
