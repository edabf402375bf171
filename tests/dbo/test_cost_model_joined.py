"""The cost model's joined mode (DBO with `DBOConfig.joined_experts`), by hand-computed
cases: where the experts are weight-bound it beats DBO, which reads the weights twice;
where the comm is heavy and the experts are not weight-bound, DBO beats it; the choice is
made only among the modes the runner offers (`predict`'s `joined`)."""
from __future__ import annotations

import pytest

from dbo import Calibration
from dbo.cost_model import PhaseTimes, StepShape, predict

# One GEMM efficiency at every size (g = 1), no SM share, no clock drop; 1000 GB/s, so
# 1e9 bytes of weights take 1 ms to read.
FLAT = Calibration(gemm_efficiency=((1.0, 1.0),), comm_sm_share=0.0, memory_gbs=1000.0)


def shape(**kw: object) -> StepShape:
    return StepShape(layers=1, tokens=64, rows_per_expert=64.0, **kw)


def test_weight_bound_experts_joined_beats_dbo_and_no_overlap():
    # a = 1, x = 4, d = c = 1, the experts' weights take 4 ms to read (W_e = 4).
    # none (eager): a + x + d + ov(s = 0, c) = 1 + 4 + 1 + 1 = 7.
    # dbo: a2 = 0.5, x2 = max(x / 2, W_e) = 4 (each ubatch reads every weight), y2 = 4,
    #   d2 = c2 = 0.5: layer 0.5 + 4 + 4 + 0.5 = 9, fill/drain 0.5 + 0.5 - 0.5 = 0.5: 9.5.
    # joined: layer ov(a2, d2) + d2 + x + ov(0, c2) + ov(a2, c2) (x as the unsplit step
    # measured it: its weights were read once there too)
    #   = 0.5 + 0.5 + 4 + 0.5 + 0.5 = 6, fill/drain 0.5 + 0.5 - 0.5 = 0.5: 6.5.
    times = PhaseTimes(attention=1, experts=4, dispatch=1, combine=1)
    bound = shape(expert_weight_bytes=4e9)
    p = predict(times, bound, FLAT, joined=True)
    assert p.times_ms["none"] == pytest.approx(7.0)
    assert p.times_ms["dbo"] == pytest.approx(9.5)
    assert p.times_ms["joined"] == pytest.approx(6.5)
    assert p.chosen == "joined"
    assert p.reason.startswith("joined: predicted +7.7% over no overlap")
    # Not offered (the runner splits with each ubatch's own experts): DBO loses 26% and
    # SBO (1 + 1 + 4 + 1 = 7) gains nothing, so no overlap.
    plain = predict(times, bound, FLAT)
    assert plain.times_ms == p.times_ms  # every mode predicted either way
    assert plain.chosen == "none"


def test_comm_heavy_unbound_experts_dbo_beats_joined():
    # a = x = d = c = 4, no weight bound: dbo a2 = x2 = d2 = c2 = 2: layer 8, fill/drain
    # 2 + 2 - 2 = 2: 10. joined: 2 + 2 + 4 + 2 + 2 = 12, fill/drain 2: 14. none 16.
    times = PhaseTimes(attention=4, experts=4, dispatch=4, combine=4)
    p = predict(times, shape(), FLAT)
    assert (p.times_ms["dbo"], p.times_ms["joined"], p.times_ms["none"]) == pytest.approx(
        (10.0, 14.0, 16.0))
    assert p.chosen == "dbo"
    # Offered joined, the runner takes it where it still beats no overlap (+14%).
    assert predict(times, shape(), FLAT, joined=True).chosen == "joined"


def test_joined_shared_experts_hide_under_the_combines():
    # s = 1 (s2 = 0.5): S's shared experts under S's combine, F's with S's next
    # attention under F's: a = x = d = c = 2 -> a2 = d2 = c2 = 1:
    # layer ov(1, 1) + 1 + 2 + ov(0.5, 1) + ov(1.5, 1) = 1 + 1 + 2 + 1 + 1.5 = 6.5,
    # fill/drain a2 + ov(s2, c2) - ov(a2 + s2, c2) = 1 + 1 - 1.5 = 0.5: 7.
    times = PhaseTimes(attention=2, experts=2, dispatch=2, combine=2, shared=1)
    assert predict(times, shape(), FLAT).times_ms["joined"] == pytest.approx(7.0)


def test_two_layers_pay_the_fill_and_drain_once():
    times = PhaseTimes(attention=2, experts=8, dispatch=2, combine=2)
    one = predict(times, shape(), FLAT).times_ms["joined"]
    # per layer a2 = d2 = c2 = 0.5 (L = 2), x = 4: 0.5 + 0.5 + 4 + 0.5 + 0.5 = 6 twice,
    # fill/drain 0.5 + 0.5 - 0.5 = 0.5: 12.5 (one layer: 1 + 1 + 8 + 1 + 1 + 1 = 13).
    two = predict(times, StepShape(layers=2, tokens=64, rows_per_expert=64.0), FLAT)
    assert (one, two.times_ms["joined"]) == pytest.approx((13.0, 12.5))


def test_joined_must_be_a_bool():
    with pytest.raises(ValueError, match="joined=1: must be True or False"):
        predict(PhaseTimes(attention=1, experts=1, dispatch=1, combine=1), shape(), FLAT,
                joined=1)  # type: ignore[arg-type]


def test_the_joined_step_s_own_host_time_replaces_the_dbo_step_s():
    # Graphed, a = x = d = c = 1: GPU joined 3.5 (test_cost_model's graph case); the
    # host time before the replay adds: the DBO step's 0.7 where the joined one was not
    # measured, else its own 0.4.
    times = PhaseTimes(attention=1, experts=1, dispatch=1, combine=1)
    graphed = dict(host_ms=0.1, host_dbo_ms=0.7, cuda_graph=True)
    assert predict(times, shape(**graphed), FLAT).times_ms["joined"] == pytest.approx(4.2)
    measured = predict(times, shape(**graphed, host_joined_ms=0.4), FLAT)
    assert measured.times_ms["joined"] == pytest.approx(3.9)
    assert measured.times_ms["dbo"] == pytest.approx(3.2)  # DBO keeps its own
