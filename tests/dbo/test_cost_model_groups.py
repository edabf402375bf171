"""Layer 1 (CPU, no torch): the cost model's single-batch overlap by expert group
(`predict(sbo_groups=G)`, `A2ALLOptions.combine_groups`) on synthetic phase times with
hand-computed answers: one group's experts over every row with 1/G of the weights, each
group's combine under the next group's experts, the last exposed; and the choice that
follows."""
from __future__ import annotations

import pytest

from dbo.calibration import Calibration
from dbo.cost_model import PhaseTimes, StepShape, predict

# g = 1 (flat efficiency), no SM share, no clock drop, 1000 GB/s: 1e9 weight bytes per
# layer read in 1 ms. Only the term under test moves.
FLAT = Calibration(gemm_efficiency=((1.0, 1.0),), comm_sm_share=0.0, memory_gbs=1000.0)


def shape(layers: int = 1, **kw: object) -> StepShape:
    return StepShape(layers=layers, tokens=64, rows_per_expert=64.0, **kw)


# Per layer a = 1, s = 0, x = 2, d = 1, c = 2, and the expert weights W_e = 2 ms: a
# weight-bound step (its measured experts are the weight read).
WEIGHT_BOUND = PhaseTimes(attention=1, experts=2, dispatch=1, combine=2)
WEIGHTS = dict(expert_weight_bytes=2e9)


def test_groups_hide_the_combine_under_the_next_groups_experts():
    # a = 4, s = 1, x = 4, d = 2, c = 2 per layer; no weights.
    times = PhaseTimes(attention=4, shared=1, experts=4, dispatch=2, combine=2)
    # Each group's combine carries all the rows (a2a_ll), c_g = c = 2. G = 2: x_g = 2,
    # a + ov(s, d) + x_g + ov(x_g, c_g) + c_g = 4 + 2 + 2 + 2 + 2 = 12.
    assert predict(times, shape(), FLAT, sbo_groups=2).times_ms["sbo"] == pytest.approx(12.0)
    # G = 4: x_g = 1 under c_g = 2 three times: 4 + 2 + 1 + 3 * 2 + 2 = 15.
    assert predict(times, shape(), FLAT, sbo_groups=4).times_ms["sbo"] == pytest.approx(15.0)
    # Expert-major (each group carries 1/G): c_g = 2 / 4 = 0.5, 4 + 2 + 1 + 3 * 1 + 0.5 =
    # 10.5, the row chunks' time with n = 4 (flat curve, no own rows, no weights).
    major = predict(times, shape(), FLAT, sbo_groups=4, group_carries_all=False)
    assert major.times_ms["sbo"] == pytest.approx(10.5)
    assert predict(times, shape(), FLAT, sbo_chunks=4).times_ms["sbo"] == pytest.approx(10.5)
    # 2 layers of the same per-layer times: twice each.
    times2 = PhaseTimes(attention=8, shared=2, experts=8, dispatch=4, combine=4)
    assert predict(times2, shape(2), FLAT, sbo_groups=2).times_ms["sbo"] == pytest.approx(24.0)


def test_each_group_reads_its_share_of_the_weights_once():
    # Row chunks each read all the weights their rows need (all of them at decode):
    # n = 2: x_n = max(2 / 2, 2) = 2, c_n = 1: 1 + ov(0, 1) + 2 + ov(2, 1) + 1 = 7.
    assert predict(WEIGHT_BOUND, shape(**WEIGHTS), FLAT,
                   sbo_chunks=2).times_ms["sbo"] == pytest.approx(7.0)
    # Groups read 1/G of them each: x_g = max(2 / 2, 2 / 2) = 1. Expert-major, c_g = 1:
    # 1 + 1 + 1 + ov(1, 1) + 1 = 5.
    major = predict(WEIGHT_BOUND, shape(**WEIGHTS), FLAT, sbo_groups=2,
                    group_carries_all=False)
    assert major.times_ms["sbo"] == pytest.approx(5.0)
    # Carrying all the rows, c_g = 2: 1 + 1 + 1 + ov(1, 2) + 2 = 7.
    assert predict(WEIGHT_BOUND, shape(**WEIGHTS), FLAT,
                   sbo_groups=2).times_ms["sbo"] == pytest.approx(7.0)
    # G = 4, expert-major: x_g = 0.5, c_g = 0.5: 1 + 1 + 0.5 + 3 * 0.5 + 0.5 = 4.5.
    assert predict(WEIGHT_BOUND, shape(**WEIGHTS), FLAT, sbo_groups=4,
                   group_carries_all=False).times_ms["sbo"] == pytest.approx(4.5)


def test_the_groups_latency_is_paid_per_group():
    # comm_latency 0.4: lam = 0.4. Expert-major, G = 2: c_g = (2 - 0.4) / 2 + 0.4 = 1.2;
    # 1 + ov(0, 1) + 1 + ov(1, 1.2) + 1.2 = 1 + 1 + 1 + 1.2 + 1.2 = 5.4.
    times = PhaseTimes(attention=1, experts=2, dispatch=1, combine=2, comm_latency=0.4)
    p = predict(times, shape(**WEIGHTS), FLAT, sbo_groups=2, group_carries_all=False)
    assert p.times_ms["sbo"] == pytest.approx(5.4)


def test_the_own_rows_are_inside_the_groups():
    # With row chunks the own rows (o = 0.5) take a pass of their own after the chunks;
    # the groups run every row, so o changes nothing: 5, as without own rows (above).
    p = predict(WEIGHT_BOUND, shape(own_row_share=0.5, **WEIGHTS), FLAT, sbo_groups=2,
                group_carries_all=False)
    assert p.times_ms["sbo"] == pytest.approx(5.0)
    # The chunked step does move with o: 1 + 1 + x_n + ov(x_n, c_n) + ov(x_o, c_n) with
    # x_n = x_o = 2 (weights), c_n = 1: 1 + 1 + 2 + 2 + 2 = 8 (7 without own rows).
    chunks = predict(WEIGHT_BOUND, shape(own_row_share=0.5, **WEIGHTS), FLAT, sbo_chunks=2)
    assert chunks.times_ms["sbo"] == pytest.approx(8.0)


def test_each_group_after_the_first_adds_its_launches():
    # 1 ms a launch, 2 launches a layer: host(k + G - 1) = 2 + 3 = 5 ms for G = 4, above
    # the GPU's 4.5 (above): the step takes the host's 5. A measured SBO issue time of
    # 6 ms is the floor instead; under CUDA graphs it adds: 4.5 + max(5, 6) = 10.5.
    cal = Calibration(gemm_efficiency=((1.0, 1.0),), comm_sm_share=0.0, memory_gbs=1000.0,
                      launch_us=1000.0)
    kw = dict(sbo_groups=4, group_carries_all=False)
    eager = predict(WEIGHT_BOUND, shape(kernels_per_layer=2, **WEIGHTS), cal, **kw)
    assert eager.times_ms["sbo"] == pytest.approx(5.0)
    floor = predict(WEIGHT_BOUND, shape(kernels_per_layer=2, host_sbo_ms=6.0, **WEIGHTS), cal,
                    **kw)
    assert floor.times_ms["sbo"] == pytest.approx(6.0)
    graphed = predict(WEIGHT_BOUND, shape(kernels_per_layer=2, host_sbo_ms=6.0,
                                          cuda_graph=True, **WEIGHTS), cal, **kw)
    assert graphed.times_ms["sbo"] == pytest.approx(10.5)


def test_one_group_is_the_single_pass_sbo():
    # G = 1, n = 1: one pass, max(x, W_e) = 2, and its combine exposed: 1 + 1 + 2 + 2 = 6.
    assert predict(WEIGHT_BOUND, shape(**WEIGHTS), FLAT,
                   sbo_groups=1).times_ms["sbo"] == pytest.approx(6.0)


def test_the_choice_follows_the_grouped_term():
    # none: 1 + 2 + 1 + ov(0, 2) = 6. DBO: a2 = 0.5, x2 = max(2 / 2, 2) = 2 (weights read
    # twice), d2 = 0.5, c2 = 1: ov(.5, .5) + ov(2, .5) + ov(2, 1) + ov(.5, 1) = 5.5 plus
    # fill/drain a2 + ov(0, 1) - ov(.5, 1) = 0.5: 6 (+0.0%).
    expert_major = predict(WEIGHT_BOUND, shape(**WEIGHTS), FLAT, sbo_groups=2,
                           group_carries_all=False)
    assert expert_major.times_ms["dbo"] == pytest.approx(6.0)
    # Expert-major groups: 5 (above), 6 / 5 - 1 = +20%: SBO runs.
    assert expert_major.chosen == "sbo"
    assert expert_major.reason.startswith("sbo: predicted +20.0% over no overlap")
    # Carrying all the rows: 7 (above), -14.3%; row chunks likewise 7: the best overlap
    # is DBO at +0.0%, below the 1% margin, so none.
    for kw in (dict(sbo_groups=2), dict(sbo_chunks=2)):
        p = predict(WEIGHT_BOUND, shape(**WEIGHTS), FLAT, **kw)
        assert p.chosen == "none", kw
        assert p.reason.startswith("none: best overlap dbo predicts +0.0%"), p.reason
        assert "sbo -14.3%" in p.reason, p.reason


@pytest.mark.parametrize("kw, words", [
    (dict(sbo_groups=0), "sbo_groups=0: must be an int >= 1"),
    (dict(sbo_groups=2.0), "sbo_groups=2.0: must be an int >= 1"),
    (dict(sbo_groups=True), "sbo_groups=True: must be an int >= 1"),
    (dict(sbo_chunks=2, sbo_groups=2), "sbo_chunks=2 and sbo_groups=2: .* not both"),
    (dict(sbo_groups=2, group_carries_all=1), "group_carries_all=1: must be True or False"),
])
def test_bad_group_inputs_raise(kw, words):
    with pytest.raises(ValueError, match=words):
        predict(WEIGHT_BOUND, shape(), FLAT, **kw)
