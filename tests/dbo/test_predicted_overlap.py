"""Layer 1 (CPU): the runner's choice from a calibration's measured phase times
(`dbo.predicted_overlap`, `DBORunner(..., calibration=)`): hand-computed predictions on
synthetic points, the reason line, interpolation between points, no trial steps."""
from __future__ import annotations

import dataclasses
import logging
from typing import Optional

import pytest
import torch
from torch import nn

from dbo import DBOConfig, DBORunner
from dbo.calibration import Calibration, MeasuredPoint
from dbo.predicted_overlap import OverlapPredictor, covering_point, point_inputs
from dbo.split import SplitPlan
from dbo.yield_points import dbo_enabled, dbo_joined_experts, dbo_single_batch_overlap

# Defaults: comm_sm_share f = 0.18, overlap_clock 1, memory 3000 GB/s; rows_per_expert
# far above the efficiency curve's last point, so a half-size GEMM is as efficient (g = 1).
ROWS = 1e6


def point(tokens: int, **times: float) -> MeasuredPoint:
    return MeasuredPoint(tokens=tokens, decode=True, layers=1, rows_per_expert=ROWS,
                         backend="a2a", **times)


# A: comm-heavy. none = 2+2+4+4 = 12. DBO: a2 = x2 = 1, d2 = c2 = 2, ov(1, 2) = max(2, 1 +
# 0.18*2) = 2, layer = 4*2 = 8, fill/drain = 1 + 2 - 2 = 1: 9 (+33.3%). SBO (one combine
# chunk, no own-rows pass): 2 + ov(0, 4) + 2 + 4 = 12 (+0.0%: nothing under the combine).
# Joined: ov(a2, d2) + d2 + x + ov(0, c2) + ov(a2, c2) = 2 + 2 + 2 + 2 + 2 = 10, fill/drain
# a2 + ov(0, c2) - ov(a2, c2) = 1: 11.
COMM_HEAVY = dict(attention=2.0, experts=2.0, dispatch=4.0, combine=4.0)
# B: weight-bound experts (W_e = 6e9 B / 3000 GB/s = 2 ms = x): splitting reads them twice.
# none = 1+2+2 + ov(2, 1) = 5 + (2 + .18) = 7.18 (shared experts under the combine). DBO: a2 = .5, s2 = 1, x2 = max(1, 2) = 2, y2 = 3, d2 = 1, c2 = .5;
# layer = ov(.5,1) + ov(3,1) + ov(3,.5) + ov(.5,.5) = 1 + 3.18 + 3.09 + .59 = 7.86, fill/drain
# .5 + tail - .59 = 0, the last ubatch's shared experts (v2 = s2 = 1) under the last combine:
# tail = ov(2,.5) + ov(1,.5) - ov(3,.5) = .09: 7.86 (-8.7%). SBO: 1 + ov(2, 2) + max(2, W_e = 2) + 1 =
# 1 + 2.36 + 2 + 1 = 6.36 (+12.9%: the shared experts under the dispatch). Joined: ov(.5, 1)
# + 1 + x + ov(1, .5) + ov(1.5, .5) = 1 + 1 + 2 + 1.09 + 1.59 = 6.68, fill/drain
# .5 + 1.09 - 1.59 = 0: 6.68 (+7.5%, the weights read once, but SBO is faster still).
WEIGHT_BOUND = dict(attention=1.0, shared=2.0, experts=2.0, dispatch=2.0, combine=1.0,
                    expert_weight_bytes=6e9)
# C: no comm: every mode takes 2 ms, no gain.
NO_COMM = dict(attention=1.0, experts=1.0, dispatch=0.0, combine=0.0)


def calibration() -> Calibration:
    return Calibration(points=(point(4, **COMM_HEAVY), point(16, **WEIGHT_BOUND),
                               point(32, **NO_COMM)))


def test_hand_computed_predictions_and_reasons():
    predictor = OverlapPredictor(calibration())
    a = predictor.predict(tokens=4, decode=True)
    assert a.times_ms == pytest.approx({"none": 12.0, "dbo": 9.0, "sbo": 12.0,
                                         "joined": 11.0})
    assert a.chosen == "dbo"
    assert a.reason == ("dbo: predicted +33.3% over no overlap (dbo +33.3%, sbo +0.0%; "
                        "comm is 67% of the unsplit GPU time)")
    b = predictor.predict(tokens=16, decode=True)
    assert b.times_ms == pytest.approx({"none": 7.18, "dbo": 7.86, "sbo": 6.36,
                                         "joined": 6.68})
    assert b.chosen == "sbo" and b.reason.startswith("sbo: predicted +12.9%")
    c = predictor.predict(tokens=32, decode=True)
    assert c.times_ms == pytest.approx({"none": 2.0, "dbo": 2.0, "sbo": 2.0,
                                         "joined": 2.0})
    assert c.chosen == "none" and c.reason.endswith("; no comm to hide)"), c.reason
    # Not covered: another phase, or outside the measured range.
    assert predictor.predict(tokens=4, decode=False) is None
    assert predictor.predict(tokens=2, decode=True) is None
    assert predictor.predict(tokens=64, decode=True) is None


def test_a_points_expert_groups_reach_the_prediction():
    # B measured with a 2-group SBO combine (a2a_ll: each group's combine carries all the
    # rows, c_g = c = 1): 1 + ov(2, 2) + x_g + ov(x_g, 1) + 1 with x_g = max(2 / 2, 2 / 2)
    # = 1, ov(1, 1) = max(1, 1 + .18) = 1.18: 1 + 2.36 + 1 + 1.18 + 1 = 6.54; 7.18 / 6.54
    # - 1 = +9.8%, still SBO. DBO and none do not move (7.86, 7.18 above).
    grouped = Calibration(points=(point(16, sbo_groups=2, **WEIGHT_BOUND),))
    b = OverlapPredictor(grouped).predict(tokens=16, decode=True)
    assert b.times_ms == pytest.approx({"none": 7.18, "dbo": 7.86, "sbo": 6.54,
                                         "joined": 6.68})
    assert b.chosen == "sbo" and b.reason.startswith("sbo: predicted +9.8%"), b.reason
    # The predictor's own form overrides the point's: one group, the single pass (6.36).
    one = OverlapPredictor(grouped, sbo_groups=1).predict(tokens=16, decode=True)
    assert one.times_ms["sbo"] == pytest.approx(6.36)
    # ... and groups given to the predictor replace a point's row chunks (else refused
    # as both at once). A, comm-heavy, in 2 groups: 2 + ov(0, 4) + 1 + ov(1, 4) + 4 = 15
    # (-20.0%): DBO's 9 stays the choice.
    chunked = Calibration(points=(point(4, sbo_chunks=2, **COMM_HEAVY),))
    a = OverlapPredictor(chunked, sbo_groups=2).predict(tokens=4, decode=True)
    assert a.times_ms["sbo"] == pytest.approx(15.0) and a.chosen == "dbo"
    assert "sbo -20.0%" in a.reason, a.reason
    with pytest.raises(ValueError, match=r"sbo_chunks=2, sbo_groups=2\): SBO chunks its "
                                         r"combine by rows or by expert group, not both"):
        OverlapPredictor(grouped, sbo_chunks=2, sbo_groups=2)
    with pytest.raises(ValueError, match=r"OverlapPredictor\(sbo_groups=0\): must be None"):
        OverlapPredictor(grouped, sbo_groups=0)


def test_points_between_are_interpolated_linearly_in_tokens():
    mid = covering_point(calibration(), tokens=24, decode=True)
    assert mid.attention == pytest.approx(1.0) and mid.shared == pytest.approx(1.0)
    assert mid.experts == pytest.approx(1.5) and mid.dispatch == pytest.approx(1.0)
    assert mid.expert_weight_bytes == pytest.approx(3e9) and mid.tokens == 24
    assert mid.label == "interpolated between 16 and 32" and mid.measured_ms == {}
    cal = calibration()
    assert covering_point(cal, tokens=16, decode=True) is cal.points[1]


def test_a_runner_takes_one_point_per_shape():
    two = Calibration(points=(point(4, **COMM_HEAVY),
                              MeasuredPoint(tokens=4, decode=True, layers=1, backend="naive",
                                            **COMM_HEAVY)))
    with pytest.raises(ValueError, match=r"several points at 4 decode tokens \(backends "
                                         r"\['a2a', 'naive'\]\).*select\(backend=...\)"):
        DBORunner(nn.Identity(), DBOConfig(overlap="auto"), calibration=two)
    assert len(two.select(backend="naive").points) == 1
    with pytest.raises(ValueError, match="overlap='dbo'.*set overlap='auto'"):
        DBORunner(nn.Identity(), DBOConfig(), calibration=calibration())


class Layer(nn.Module):
    """Doubles its input; records each call's step kind (one entry per model call)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[bool, bool]] = []

    def dbo_sbo_blocker(self) -> Optional[str]:
        return None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append((dbo_enabled(), dbo_single_batch_overlap()))
        return x * 2


@pytest.mark.parametrize("tokens, mode, calls, reason", [
    # 4 < min_decode_tokens=8, yet DBO is predicted to win by 33%: split.
    (4, "dbo", [(True, False)] * 2, "predicted dbo: predicted +33.3% over no overlap"),
    # Above the threshold, but splitting would read the expert weights twice: SBO.
    (16, "sbo", [(True, True)], "predicted sbo: predicted +12.9%"),
    (32, "none", [(False, False)], "predicted none: best overlap"),
    # Not covered: the thresholds decide, as without a calibration.
    (64, "dbo", [(True, False)] * 2, "halved 64 independent tokens"),
])
def test_runner_runs_the_predicted_mode_without_trial_steps(tokens, mode, calls, reason,
                                                           caplog):
    layer = Layer()
    runner = DBORunner(layer, DBOConfig(overlap="auto", min_decode_tokens=8),
                       calibration=calibration())
    x = torch.arange(1, tokens + 1, dtype=torch.float32)[:, None]
    with caplog.at_level(logging.INFO, logger="dbo.runner"):
        for _ in range(3):
            assert torch.equal(runner(x), 2 * x)
    plan: SplitPlan = runner.last_decision
    assert plan.overlap == mode and plan.split == (mode == "dbo")
    assert plan.reason.startswith(reason) and "\n" not in plan.reason, plan.reason
    # Three steps, three steps' model calls: no trial step ran, the first step included.
    assert layer.calls == calls * 3
    logged = [r.getMessage() for r in caplog.records if r.name == "dbo.runner"]
    if reason.startswith("predicted"):
        assert logged == [f"dbo: {tokens} decode tokens/rank run {mode}: {plan.reason}"]
    else:
        assert logged == []


class JoinedLayer(Layer):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append(dbo_joined_experts())
        return x * 2


@pytest.mark.parametrize("calibrated", [False, True])
def test_a_runner_whose_experts_join_runs_its_split_steps_joined(calibrated):
    # Calibrated: at 4 tokens the joined step is predicted 11 ms against 12 (A above,
    # +9.1%), the split mode offered: split and joined. Without a calibration the
    # thresholds split and the config joins.
    layer = JoinedLayer()
    config = DBOConfig(overlap="auto" if calibrated else "dbo", min_decode_tokens=2,
                       joined_experts=True)
    runner = DBORunner(layer, config, calibration=calibration() if calibrated else None)
    x = torch.arange(1.0, 5.0)[:, None]
    assert torch.equal(runner(x), 2 * x)
    plan: SplitPlan = runner.last_decision
    assert plan.split and plan.overlap == "joined", plan
    assert layer.calls == [True, True]  # both ubatches ran in a joined step
    if calibrated:
        assert plan.reason.startswith("predicted joined: predicted +9.1%"), plan.reason


class RequestLayer(Layer):
    """`Layer` over requests (`seq_lens=`), so a step is decode- or prefill-shaped."""

    def forward(self, x: torch.Tensor, *, seq_lens: list[int]) -> torch.Tensor:
        return super().forward(x)


def _mixed_shapes_worker(rank: int, world_size: int) -> tuple[bool, str, str]:
    """Rank 0 runs 16 decode tokens (16 requests of 1), rank 1 16 prefill tokens (2 of 8).
    The calibration predicts SBO for decode and no overlap for prefill at 16 tokens."""
    import torch.distributed as dist

    cal = Calibration(points=(
        point(16, **WEIGHT_BOUND),
        MeasuredPoint(tokens=16, decode=False, layers=1, rows_per_expert=ROWS, backend="a2a",
                      **NO_COMM)))
    runner = DBORunner(RequestLayer(), DBOConfig(split="requests", overlap="auto"),
                       group=dist.group.WORLD, calibration=cal)
    seq_lens = [1] * 16 if rank == 0 else [8, 8]
    x = torch.ones(16, 1)
    runner(x, seq_lens=seq_lens)
    plan = runner.last_decision
    return plan.is_decode, plan.overlap, plan.reason


@pytest.mark.distributed
def test_ranks_with_decode_and_prefill_steps_predict_the_same_mode():
    """The overlap mode must be the same on every rank (a chunked SBO combine issues other
    collectives than no overlap): the vote tells every rank whether the group's step is
    decode (`Tally.all_decode`), and each predicts at that shape, not at its own."""
    from tests.dist_utils import run_distributed

    (decode0, mode0, reason0), (decode1, mode1, reason1) = run_distributed(
        2, _mixed_shapes_worker)
    assert (decode0, decode1) == (True, False)
    assert mode0 == mode1 == "none", (reason0, reason1)


def test_point_inputs_carry_the_host_floor_and_the_backends_sm_share():
    measured = MeasuredPoint(tokens=512, decode=False, layers=4, attention=1.0, experts=1.0,
                             dispatch=1.0, combine=1.0, backend="a2a_ll", regime="scale_out",
                             host_ms=3.0)
    times, shape = point_inputs(measured, Calibration(comm_sm_share=0.18))
    assert shape.host_ms == 3.0 and shape.comm_sm_share == pytest.approx(4 / 132)
    assert point_inputs(measured)[1].comm_sm_share is None  # no calibration: its default
    mid = covering_point(Calibration(points=(measured, dataclasses.replace(
        measured, tokens=1024, host_ms=5.0))), tokens=768, decode=False)
    assert mid.host_ms == pytest.approx(4.0)


def test_point_inputs_carry_each_modes_host_time_and_the_graph_mode():
    measured = MeasuredPoint(tokens=512, decode=True, layers=4, attention=1.0, experts=1.0,
                             dispatch=1.0, combine=1.0, host_ms=0.1, host_dbo_ms=0.7,
                             host_sbo_ms=0.6, cuda_graph=True)
    shape = point_inputs(measured)[1]
    assert (shape.host_ms, shape.host_dbo_ms, shape.host_sbo_ms) == (0.1, 0.7, 0.6)
    assert shape.cuda_graph
    mid = covering_point(Calibration(points=(measured, dataclasses.replace(
        measured, tokens=1024, host_dbo_ms=0.9, host_sbo_ms=1.0))), tokens=768, decode=True)
    assert (mid.host_dbo_ms, mid.host_sbo_ms) == pytest.approx((0.8, 0.8))
