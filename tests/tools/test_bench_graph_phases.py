"""Layer 1 (CPU): `dbo bench --cuda-graph` brings a point's eagerly timed phases to graph
replays before predicting (`dbo.cli.bench.phases.to_graph_mode`): synthetic numbers of
the decode point measured at 64 requests per rank on 2x H200 (graphed no overlap 3.20 ms,
DBO 5.20 ms; the probe's graphed compute alone 2.77 ms, comm alone 0.44 ms; the eager
phases summed to 5.59 ms), hand-computed predictions."""
from __future__ import annotations

import dataclasses

import pytest

from dbo.calibration import Calibration, MeasuredPoint
from dbo.cli.bench.config import EMULATED_REGIME, NVLINK_REGIME, BenchConfig
from dbo.cli.bench.phases import to_graph_mode
from dbo.cli.bench.point import make_point
from dbo.cli.bench.predicted import attach_prediction, bench_shape, prediction_lines
from dbo.cli.bench.sweep import SweepResult
from dbo.cli.bench.timing import Timing

# Graphed per-phase split (all 4 layers): attention 1.0, shared 0.27, experts 1.5 (sum
# 2.77, compute alone) and dispatch = combine = 0.22 (sum 0.44, comm alone). Eagerly the
# compute phases were K = 4.59 / 2.77 times longer and each collective half 0.5 ms:
# 4.59 + 1.0 = 5.59 ms.
K = 4.59 / 2.77
EAGER = MeasuredPoint(tokens=64, decode=True, layers=4, rows_per_expert=1e6, backend="a2a_ll",
                      attention=1.0 * K, shared=0.27 * K, experts=1.5 * K, dispatch=0.5,
                      combine=0.5)
# No comm SM share, so that ov(u, m) = max(u, m); rows far above the efficiency curve: g = 1.
CAL = Calibration(comm_sm_share=0.0)


def _point(measured: MeasuredPoint):
    cfg = BenchConfig(mode="decode", tokens=(64,), backends=("a2a_ll",))
    point = make_point(cfg, backend="a2a_ll", tokens=64, world_size=2,
                       t_off=Timing((3.20, 3.20)), t_on=Timing((5.20, 5.20)), ceiling=None,
                       split=True, split_reason="", use_dbo=False, gate_reason="")
    attach_prediction(point, measured, CAL)
    return point


def test_eager_phases_scaled_to_the_graphed_compute_and_comm_alone():
    graphed = to_graph_mode(EAGER, compute_ms=2.77, comm_ms=0.44)
    assert graphed.cuda_graph and not EAGER.cuda_graph
    assert graphed.compute_scale == pytest.approx(2.77 / 4.59)
    assert graphed.comm_scale == pytest.approx(0.44)
    for name, ms in dict(attention=1.0, shared=0.27, experts=1.5, dispatch=0.22,
                         combine=0.22).items():
        assert getattr(graphed, name) == pytest.approx(ms), name
    # A group that measured nothing keeps its times.
    quiet = to_graph_mode(MeasuredPoint(tokens=8, decode=True, layers=1, attention=1.0,
                                        experts=1.0, dispatch=0.0, combine=0.0),
                          compute_ms=1.0, comm_ms=0.3)
    assert quiet.comm_scale == 1.0 and quiet.dispatch == 0.0 and quiet.compute_scale == 0.5


def test_graphed_point_predicted_from_graphed_phases():
    eager = _point(EAGER)
    # Eager phases: none = 2.5K + 0.5 + max(0.27K, 0.5) = 5.1426 ms (the shared experts
    # under the combine), +60.7% over the graphed 3.20. DBO per layer: a2 = K/8, y2 = 1.77K/8, d2 = c2 = 0.0625; layer = 2 a2 + 2 y2 =
    # 5.54K/8; 4 layers = 2.77K = 4.59, fill/drain = c2 less the last ubatch's shared
    # experts under it (s2 = 0.27K/8 = 0.0559): 4.59 + 0.0625 - 0.0559 = 4.5966 ms.
    assert eager.t_nodbo_pred_ms == pytest.approx(2.5 * K + 1.0)
    assert eager.pred_err_nodbo == pytest.approx((2.5 * K + 1.0) / 3.20 - 1)
    assert eager.t_dbo_pred_ms == pytest.approx(4.59 + 0.0625 - 0.27 * K / 8)
    graphed = _point(to_graph_mode(EAGER, compute_ms=2.77, comm_ms=0.44))
    # Graphed: none = the sum of the phases, 2.77 + 0.44 = 3.21 ms (+0.3%: a graphed
    # DBO-off step overlaps nothing). DBO per layer: a2 = 0.125, y2 =
    # 0.22125, d2 = c2 = 0.0275; layer = 0.6925, 4 layers 2.77, fill/drain 0: the last
    # combine hides under the last ubatch's shared experts (s2 = 0.03375): 2.77.
    assert graphed.t_nodbo_pred_ms == pytest.approx(3.21)
    assert graphed.pred_err_nodbo == pytest.approx(3.21 / 3.20 - 1)
    assert graphed.t_dbo_pred_ms == pytest.approx(2.77)
    assert graphed.pred_err_dbo == pytest.approx(2.77 / 5.20 - 1)
    assert graphed.measured_point.compute_scale == pytest.approx(2.77 / 4.59)
    cfg = BenchConfig(mode="decode", tokens=(64,), backends=("a2a_ll",))
    lines = prediction_lines(SweepResult(config=cfg, world_size=2, shapes={}, probe="",
                                             points=[graphed]))
    assert "(eager x0.603 compute, x0.44 comm)" in lines[-1]


def test_scales_round_trip_and_bad_scale_refused():
    graphed = to_graph_mode(EAGER, compute_ms=2.77, comm_ms=0.44)
    cal = Calibration(points=(graphed,))
    assert Calibration.from_json(cal.to_json()) == cal
    with pytest.raises(ValueError, match="compute_scale"):
        MeasuredPoint(tokens=8, decode=True, layers=1, attention=1.0, experts=1.0,
                      dispatch=0.0, combine=0.0, compute_scale=0.0)


def test_bench_points_record_the_shape_dbo_plan_needs():
    cfg = BenchConfig(mode="decode", tokens=(64,), backends=("a2a_ll",), context=128)
    point = bench_shape(EAGER, cfg, num_experts=16, world_size=2)
    assert (point.preset, point.mode, point.num_experts, point.world_size, point.context) \
        == (cfg.preset, "decode", 16, 2, 128)
    assert point.regime == ""  # CPU gloo: no link of the calibration's
    nvlink = dataclasses.replace(cfg, regime=NVLINK_REGIME)
    assert bench_shape(EAGER, nvlink, num_experts=16, world_size=2).regime == "nvlink"
    emulated = dataclasses.replace(cfg, regime=EMULATED_REGIME, mode="layer")
    layer = bench_shape(EAGER, emulated, num_experts=16, world_size=2)
    assert (layer.regime, layer.context) == ("scale_out", 0)
