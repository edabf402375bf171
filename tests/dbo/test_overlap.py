"""Layer 1 (CPU): the runner's choice among no overlap, single-batch overlap (SBO) and
two ubatches (DBO), `DBOConfig.overlap`, and the one-line reason it gives."""
from __future__ import annotations

from typing import Optional

import pytest
import torch
from torch import nn

from dbo import DBOConfig, DBORunner
from dbo.overlap import NO_SBO_HOOK, choose_overlap, collect_sbo_blocker, restrict_split
from dbo.split import SplitPlan
from dbo.yield_points import dbo_enabled, dbo_single_batch_overlap


class Layer(nn.Module):
    """Doubles its input; records the step kind it ran in; offers SBO unless `blocker`."""

    def __init__(self, blocker: Optional[str] = None) -> None:
        super().__init__()
        self.blocker = blocker
        self.seen: list[tuple[bool, bool]] = []

    def dbo_sbo_blocker(self) -> Optional[str]:
        return self.blocker

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append((dbo_enabled(), dbo_single_batch_overlap()))
        return x * 2


def step(overlap: str, tokens: int, model: nn.Module) -> tuple[SplitPlan, torch.Tensor]:
    """One runner step of `tokens` rows: its decision, and the output over the input."""
    runner = DBORunner(model, DBOConfig(overlap=overlap, min_decode_tokens=8))
    x = torch.arange(1, tokens + 1, dtype=torch.float32)[:, None]
    out = runner(x)
    return runner.last_decision, out / x


@pytest.mark.parametrize("overlap, tokens, mode, seen, reason", [
    ("auto", 4, "sbo", [(True, True)], "< min_decode_tokens=8"),
    ("auto", 16, "dbo", [(True, False)] * 2, "halved 16"),
    ("dbo", 4, "none", [(False, False)], "< min_decode_tokens=8"),
    ("dbo", 16, "dbo", [(True, False)] * 2, "halved 16"),
    ("sbo", 16, "sbo", [(True, True)], "DBOConfig.overlap='sbo' never splits"),
    ("sbo", 4, "sbo", [(True, True)], "single-batch overlap"),
    ("none", 16, "none", [(False, False)], "DBOConfig.overlap='none' never splits"),
])
def test_runner_runs_the_chosen_mode_and_says_why(overlap, tokens, mode, seen, reason):
    layer = Layer()
    plan, gain = step(overlap, tokens, nn.Sequential(layer))
    assert torch.equal(gain, torch.full_like(gain, 2.0))
    assert plan.overlap == mode and plan.split == (mode == "dbo")
    assert layer.seen == seen
    assert reason in plan.reason and "\n" not in plan.reason, plan.reason
    if mode == "sbo":
        assert plan.reason.endswith(": single-batch overlap"), plan.reason


def test_sbo_needs_every_module_to_offer_it():
    blocked = Layer(blocker="backend 'local' on one rank has nothing to overlap")
    layer = Layer()
    plan, _ = step("auto", 4, nn.Sequential(layer, blocked))
    assert plan.overlap == "none" and layer.seen == [(False, False)]
    assert plan.reason.endswith("; no single-batch overlap: backend 'local' on one rank has "
                                "nothing to overlap"), plan.reason
    plan, _ = step("sbo", 4, nn.Sequential(nn.Identity()))  # no module has the hook
    assert plan.overlap == "none" and plan.reason.endswith(NO_SBO_HOOK), plan.reason


def test_choice_follows_the_voted_split_only():
    """A vetoed split (a peer did not want it) falls back to SBO under "auto": the mode is
    a function of what every rank agreed, so no rank needs another collective."""
    config = DBOConfig(overlap="auto")
    vetoed = SplitPlan(split=False, vetoed=True, num_tokens=(64,), reason="peer rank vetoed")
    assert choose_overlap(vetoed, config, None).overlap == "sbo"
    assert choose_overlap(vetoed, config, "blocked").overlap == "none"
    split = SplitPlan(split=True, num_tokens=(32, 32), reason="halved")
    assert choose_overlap(split, config, "blocked").overlap == "dbo"
    assert restrict_split(split, config) is split
    for never in ("sbo", "none"):
        unsplit = restrict_split(split, DBOConfig(overlap=never))
        assert not unsplit.split and unsplit.num_tokens == (64,)


def test_collect_sbo_blocker_takes_the_first_reason():
    assert collect_sbo_blocker(nn.Sequential(Layer(), Layer())) is None
    assert collect_sbo_blocker(nn.Sequential(Layer(), Layer("a"), Layer("b"))) == "a"
    assert collect_sbo_blocker(lambda x: x) == NO_SBO_HOOK


def test_overlap_policy_is_checked():
    with pytest.raises(ValueError, match="DBOConfig.overlap='both'.*'dbo', 'auto', 'sbo', 'none'"):
        DBOConfig(overlap="both")


def test_overlap_policy_is_part_of_the_agreement():
    fields = DBORunner(Layer(), DBOConfig(overlap="sbo")).agreement_fields()
    assert fields["DBOConfig.overlap"] == "sbo"
