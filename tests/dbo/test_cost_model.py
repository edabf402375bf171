"""Layer 1 (CPU, no torch): the cost model (`dbo.cost_model`) on synthetic phase times
with hand-computed answers, the choice and its reasons, and `dbo.calibration` (its
interpolation, JSON round trip, bad values refused)."""
from __future__ import annotations

import dataclasses
import json
import random

import pytest

from dbo.calibration import Calibration, CommRegime
from dbo.cost_model import PhaseTimes, StepShape, predict

# g = 1 (flat efficiency), no SM share, no clock drop: only the term under test moves.
FLAT = Calibration(gemm_efficiency=((1.0, 1.0),), comm_sm_share=0.0, memory_gbs=1000.0)


def shape(layers: int = 1, **kw: object) -> StepShape:
    return StepShape(layers=layers, tokens=64, rows_per_expert=64.0, **kw)


def test_none_is_serial_but_runs_the_shared_experts_under_the_combine():
    # Per layer a=2, s=0.5, x=2, d=1, c=1: the shared experts hide under the combine
    # (queued between its send and its receive): 2 + 2 + 1 + max(1, 0.5) = 6 per layer.
    p = predict(PhaseTimes(attention=4, shared=1, experts=4, dispatch=2, combine=2),
                shape(2), FLAT)
    assert p.times_ms["none"] == pytest.approx(12.0)
    # Shared longer than the combine, comm holding half the SMs: ov(3, 2) = max(2, 3 + 1).
    longer = predict(PhaseTimes(attention=1, shared=3, experts=1, dispatch=1, combine=2),
                     shape(), Calibration(gemm_efficiency=((1.0, 1.0),), comm_sm_share=0.5))
    assert longer.times_ms["none"] == pytest.approx(1 + 1 + 1 + 4)


def test_a_graphed_none_step_is_the_sum_of_its_phases():
    # The DBO-off step has no comm stream: its collectives block the compute stream, so
    # the shared experts wait for the combine. Graphed there are no launch gaps for the
    # host to fill during a collective: per layer 2 + 0.5 + 2 + 1 + 1 = 6.5, plus the
    # host's 0.1 ms before the replay (eager: 6 per layer, above).
    times = PhaseTimes(attention=4, shared=1, experts=4, dispatch=2, combine=2)
    p = predict(times, shape(2, host_ms=0.1, cuda_graph=True), FLAT)
    assert p.times_ms["none"] == pytest.approx(13.1)


def test_comm_fully_hidden_when_compute_exceeds_comm():
    # Per layer a=2, x=2, d=1, c=1; per ubatch 1, 1, 0.5, 0.5: every comm hides under
    # compute, so DBO = all compute (8) + the last combine (0.5, the drain).
    p = predict(PhaseTimes(attention=4, experts=4, dispatch=2, combine=2), shape(2), FLAT)
    assert p.times_ms["dbo"] == pytest.approx(8.5)
    assert p.dbo_costs_ms["fill_drain"] == pytest.approx(0.5)
    assert p.chosen == "dbo"


def test_the_last_ubatchs_shared_experts_and_own_rows_hide_the_final_combine():
    # Per ubatch a2=2, s2=0.5, x2=2, d2=c2=1: compute 9 hides every comm but the step's
    # last combine, under which the last ubatch's shared experts run (v2 = 0.5: 0.5 of
    # it exposed), and its own rows too where the combine splits (v2 = 0.5 + 0.5 * 2).
    times = PhaseTimes(attention=4, shared=1, experts=4, dispatch=2, combine=2)
    shared_only = predict(times, shape(), FLAT)
    assert shared_only.times_ms["dbo"] == pytest.approx(9.5)
    assert shared_only.dbo_costs_ms["fill_drain"] == pytest.approx(0.5)
    split = predict(times, shape(own_row_share=0.5), FLAT)
    assert split.times_ms["dbo"] == pytest.approx(9.0)
    assert split.dbo_costs_ms["fill_drain"] == pytest.approx(0.0)


def test_comm_bound_step_pays_the_first_attention():
    # a2 = y2 = 0.5 under d2 = c2 = 2: DBO = all comm (8) + ubatch 0's first attention.
    p = predict(PhaseTimes(attention=1, experts=1, dispatch=4, combine=4), shape(), FLAT)
    assert p.times_ms["dbo"] == pytest.approx(8.5)
    assert p.times_ms["none"] == pytest.approx(10.0)
    assert p.dbo_costs_ms["fill_drain"] == pytest.approx(0.5)


def test_first_dispatch_exposed_adds_it_to_the_fill():
    times = PhaseTimes(attention=4, experts=4, dispatch=2, combine=2)
    hidden = predict(times, shape(), FLAT).times_ms["dbo"]
    exposed = predict(times, shape(first_dispatch_exposed=True), FLAT).times_ms["dbo"]
    assert exposed - hidden == pytest.approx(1.0)  # a2 + d2 - ov(a2, d2) = 2 + 1 - 2


def test_weights_read_twice_makes_dbo_lose_at_tiny_batches():
    # Experts weight-bound: 2e9 bytes at 1000 GB/s = 2 ms = the whole expert time. Each
    # ubatch reads them again: x2 = max(1, 2) = 2, DBO = 0.1 + 2 + 2 + 0.1 + 0.05.
    times = PhaseTimes(attention=0.2, experts=2.0, dispatch=0.1, combine=0.1)
    bound = predict(times, shape(expert_weight_bytes=2e9), FLAT)
    assert bound.times_ms["dbo"] == pytest.approx(4.25)
    assert bound.dbo_costs_ms["weights_read_twice"] == pytest.approx(2.0)
    assert bound.times_ms["dbo"] > bound.times_ms["none"] and bound.chosen != "dbo"
    free = predict(times, shape(), FLAT)  # the same step, weights not counted
    assert free.times_ms["dbo"] == pytest.approx(2.25) and free.chosen == "dbo"


def test_half_size_gemm_efficiency():
    # eff(100) = 1.0, eff(50) = 0.5: each half runs at half the rate, g = 2.
    cal = Calibration(gemm_efficiency=((50.0, 0.5), (100.0, 1.0)), comm_sm_share=0.0)
    p = predict(PhaseTimes(attention=0, experts=4, dispatch=0, combine=0),
                StepShape(layers=1, tokens=64, rows_per_expert=100.0), cal)
    assert p.dbo_costs_ms["half_gemm"] == pytest.approx(4.0)
    assert p.times_ms["dbo"] == pytest.approx(8.0)


def test_comm_sm_share_and_clock_slow_overlapped_compute():
    times = PhaseTimes(attention=0, experts=4, dispatch=4, combine=0)
    # y2 = 2 under d2 = 2: ov = max(2, 2 + f * 2).
    share = predict(times, shape(), Calibration(gemm_efficiency=((1.0, 1.0),), comm_sm_share=0.5))
    assert share.times_ms["dbo"] == pytest.approx(7.0)
    assert share.dbo_costs_ms["comm_sm_share"] == pytest.approx(1.0)
    clock = predict(times, shape(), Calibration(gemm_efficiency=((1.0, 1.0),), comm_sm_share=0.0,
                                                overlap_clock=0.5))
    assert clock.times_ms["dbo"] == pytest.approx(10.0)  # 2 + 4 + 4: compute at half clock
    assert clock.dbo_costs_ms["clock"] == pytest.approx(4.0)


def test_latency_is_paid_per_ubatch():
    p = predict(PhaseTimes(attention=0, experts=0, dispatch=2, combine=2, comm_latency=1),
                shape(), FLAT)
    assert p.times_ms["dbo"] == pytest.approx(6.0)  # four collectives of 1 + 1 / 2
    assert p.chosen == "none"


def test_sbo_hides_shared_under_dispatch_and_combine_under_chunks():
    # a + ov(s, d) + x/n + (n - 1) ov(x/n, c/n) + c/n = 4 + 2 + 1 + 3 + 0.5.
    p = predict(PhaseTimes(attention=4, shared=1, experts=4, dispatch=2, combine=2), shape(),
                FLAT, sbo_chunks=4)
    assert p.times_ms["sbo"] == pytest.approx(10.5)


def test_sbo_passes_each_read_the_expert_weights_and_own_rows_go_last():
    # As moe.modular_kernel runs SBO: the other ranks' rows (1 - o = 0.5 of them) in 2
    # chunks, then the own rows under the last chunk's combine. The measured combine is
    # the other ranks' rows alone (the own rows never cross the link): c_n = 2 / 2 = 1.
    times = PhaseTimes(attention=1, experts=2, dispatch=1, combine=2)
    # No weight floor: 1 + ov(0, 1) + 0.5 + ov(0.5, 1) + ov(1, 1) = 1 + 1 + .5 + 1 + 1.
    light = predict(times, shape(own_row_share=0.5), FLAT, sbo_chunks=2)
    assert light.times_ms["sbo"] == pytest.approx(4.5)
    # Weight-bound (W_e = 1e9 B at 1000 GB/s = 1 ms): each of the three passes reads the
    # weights, 1 ms however few its rows: 1 + 1 + 1 + ov(1, 1) + ov(1, 1) = 5.
    heavy = predict(times, shape(own_row_share=0.5, expert_weight_bytes=1e9), FLAT,
                    sbo_chunks=2)
    assert heavy.times_ms["sbo"] == pytest.approx(5.0)
    assert heavy.times_ms["none"] == pytest.approx(6.0)  # 1 + 2 + 1 + ov(0, 2)
    with pytest.raises(ValueError, match="own_row_share"):
        shape(own_row_share=1.0)


def test_sbo_passes_run_at_the_gemm_efficiency_of_their_rows():
    # 64 rows per expert at efficiency 0.8, a pass over half of them (32 rows) at 0.4:
    # each half pass takes 0.5 * 2 * 0.8 / 0.4 = 2 ms, not 1. No own rows, 2 chunks:
    # 1 + ov(0, 1) + 2 + ov(2, 1) + c_n = 1 + 1 + 2 + 2 + 1 = 7 (flat curve: 5).
    times = PhaseTimes(attention=1, experts=2, dispatch=1, combine=2)
    steep = Calibration(gemm_efficiency=((32.0, 0.4), (64.0, 0.8)), comm_sm_share=0.0,
                        memory_gbs=1000.0)
    assert predict(times, shape(), FLAT, sbo_chunks=2).times_ms["sbo"] == pytest.approx(5.0)
    assert predict(times, shape(), steep, sbo_chunks=2).times_ms["sbo"] == pytest.approx(7.0)
    # One pass over all the rows keeps the unsplit step's efficiency: 1 + 1 + 2 + 2 = 6.
    assert predict(times, shape(), steep).times_ms["sbo"] == pytest.approx(6.0)


def test_sbo_passes_take_the_split_probes_expert_rate_above_the_persistent_rows():
    # The unsplit step's GEMMs ran the persistent kernel (rows >= persistent_min_rows);
    # SBO's passes, like DBO's ubatches, never do. The probe measured the DBO step's
    # compute at 6 ms: less the attention halves (2 * 0.5) that leaves 2.5 ms of experts
    # per ubatch, which each half pass now takes: 1 + ov(0, 1) + 2.5 + ov(2.5, 0.5) = 7.
    # By the curve (flat): 1 + 1 + 1 + ov(1, 0.5) = 4.
    times = PhaseTimes(attention=1, experts=2, dispatch=1, combine=0.5)
    low = dataclasses.replace(FLAT, persistent_min_rows=64.0)
    measured = dict(own_row_share=0.5, split_compute_ms=6.0, host_dbo_ms=1.0)
    assert predict(times, shape(**measured), low).times_ms["sbo"] == pytest.approx(7.0)
    # Fewer rows than the persistent kernel's: the curve.
    assert predict(times, shape(**measured), FLAT).times_ms["sbo"] == pytest.approx(4.0)
    # The split compute is the host's, not the GPU's: the DBO step's host time unknown
    # (a backend that waits on the device while it issues) or at 90% of it or more.
    for host_dbo_ms in (0.0, 5.4):
        p = predict(times, shape(**{**measured, "host_dbo_ms": host_dbo_ms}), low)
        assert p.times_ms["sbo"] == pytest.approx(4.0), host_dbo_ms


def test_measured_dbo_and_sbo_host_times_are_their_floors():
    # GPU: none 4, DBO 2.5, SBO 1 + ov(0, 1) + 1 + 1 = 4 (test below). The unsplit step
    # was issued in 1 ms; the DBO step in 7 (the vote, the scheduler, twice the Python:
    # more than 2 * 1), the SBO step in 4.5.
    times = PhaseTimes(attention=1, experts=1, dispatch=1, combine=1)
    guessed = predict(times, shape(host_ms=1.0), FLAT)
    assert guessed.times_ms["dbo"] == pytest.approx(2.5)  # 2 * 1 < 2.5 on the GPU
    assert guessed.times_ms["sbo"] == pytest.approx(4.0)
    measured = predict(times, shape(host_ms=1.0, host_dbo_ms=7.0, host_sbo_ms=4.5), FLAT)
    assert measured.times_ms["dbo"] == pytest.approx(7.0)
    assert measured.times_ms["sbo"] == pytest.approx(4.5)
    assert measured.times_ms["none"] == pytest.approx(4.0) and measured.chosen == "none"
    assert measured.dbo_costs_ms["launches"] == pytest.approx(4.5)
    with pytest.raises(ValueError, match="host_dbo_ms"):
        shape(host_dbo_ms=-1.0)


def test_under_cuda_graphs_the_host_time_adds_to_the_gpu_time():
    # A replay's host time (the runner's vote) is spent before the GPU has the step's
    # work: GPU none 4, DBO 2.5, SBO 4 (above), joined 3.5 (a2 = d2 = c2 = 0.5: 0.5 + 0.5
    # + 1 + 0.5 + 0.5 per layer, + 0.5 + 0.5 - 0.5 fill/drain) plus 0.1, 0.7, 0.6, 0.7 ms.
    times = PhaseTimes(attention=1, experts=1, dispatch=1, combine=1)
    p = predict(times, shape(host_ms=0.1, host_dbo_ms=0.7, host_sbo_ms=0.6, cuda_graph=True),
                FLAT)
    assert p.times_ms == pytest.approx({"none": 4.1, "dbo": 3.2, "sbo": 4.6, "joined": 4.2})
    assert p.dbo_costs_ms["launches"] == pytest.approx(0.7)
    with pytest.raises(ValueError, match="cuda_graph"):
        shape(cuda_graph=1)


def test_a_measured_split_compute_replaces_the_modelled_one():
    # No comm: the DBO step is its two ubatches' compute. Modelled 2 * (a/2 + x/2) = 4 ms;
    # measured 6 ms: a2 and x2 scaled by 1.5 each, 4 * 1.5 = 6 ms.
    times = PhaseTimes(attention=2, experts=2, dispatch=0, combine=0)
    assert predict(times, shape(), FLAT).times_ms["dbo"] == pytest.approx(4.0)
    measured = predict(times, shape(split_compute_ms=6.0), FLAT)
    assert measured.times_ms["dbo"] == pytest.approx(6.0)
    assert measured.times_ms["none"] == pytest.approx(4.0)  # the unsplit step unchanged


def test_host_bound_step_doubles_its_launches_and_stays_unsplit():
    cal = Calibration(gemm_efficiency=((1.0, 1.0),), launch_us=100.0)
    p = predict(PhaseTimes(attention=0.1, experts=0.1, dispatch=0.1, combine=0.1),
                shape(kernels_per_layer=10), cal)
    assert p.times_ms["none"] == pytest.approx(1.0)
    assert p.times_ms["dbo"] == pytest.approx(2.0)
    assert p.dbo_costs_ms["launches"] > 0
    assert p.chosen == "none" and "host-bound" in p.reason


def test_measured_host_time_is_a_floor_and_dbo_issues_it_twice():
    # GPU: none = 1 + 1 + 1 + max(1, 0) = 4; DBO = 4 * ov(.5, .5) + (.5 + .5 - .5) = 2.5.
    # The unsplit step's host took 3 ms to issue: DBO runs every layer's Python once per
    # ubatch, so its host needs 6 ms > 2.5 on the GPU; none keeps its GPU time (3 < 4).
    times = PhaseTimes(attention=1, experts=1, dispatch=1, combine=1)
    free = predict(times, shape(), FLAT)
    assert free.times_ms["none"] == pytest.approx(4.0)
    assert free.times_ms["dbo"] == pytest.approx(2.5) and free.chosen == "dbo"
    bound = predict(times, shape(host_ms=3.0), FLAT)
    assert bound.times_ms["none"] == pytest.approx(4.0)
    assert bound.times_ms["dbo"] == pytest.approx(6.0)
    assert bound.dbo_costs_ms["launches"] == pytest.approx(3.5)
    assert bound.chosen != "dbo"
    # Above the unsplit GPU time it is that step's floor too, and SBO's.
    slow = predict(times, shape(host_ms=5.0), FLAT)
    assert slow.times_ms["none"] == pytest.approx(5.0) and slow.times_ms["sbo"] >= 5.0
    assert slow.chosen == "none" and "host-bound" in slow.reason


def test_step_comm_sm_share_overrides_the_calibration():
    # y2 = 2 under d2 = 2: ov = max(2, 2 + f * 2); f = 0.5 from the step, not FLAT's 0.
    times = PhaseTimes(attention=0, experts=4, dispatch=4, combine=0)
    assert predict(times, shape(), FLAT).times_ms["dbo"] == pytest.approx(6.0)
    assert predict(times, shape(comm_sm_share=0.5), FLAT).times_ms["dbo"] == pytest.approx(7.0)
    with pytest.raises(ValueError, match="comm_sm_share"):
        shape(comm_sm_share=1.0)
    with pytest.raises(ValueError, match="host_ms"):
        shape(host_ms=-1.0)


def test_comm_sm_share_per_backend_and_link():
    cal = Calibration(comm_sm_share=0.18)
    # NCCL's all-to-all: 4 of 132 SMs scale-out emulated, 32 over NVLink.
    assert cal.comm_sm_share_for("a2a_ll", "scale_out") == pytest.approx(4 / 132)
    assert cal.comm_sm_share_for("a2a", "nvlink") == pytest.approx(32 / 132)
    assert cal.comm_sm_share_for("deepep_ht", "nvlink") == 0.18  # not listed: the default
    assert cal.comm_sm_share_for("a2a", "") == 0.18


def test_choice_respects_the_margin_and_says_why():
    times = PhaseTimes(attention=10, experts=10, dispatch=0.1, combine=0.1)
    p = predict(times, shape(), FLAT)  # dbo +0.75%: below 1%
    assert p.gain("dbo") == pytest.approx(20.2 / 20.05 - 1)
    assert p.chosen == "none"
    assert "below the 1% margin" in p.reason and "\n" not in p.reason
    assert predict(times, shape(), FLAT, margin=0.005).chosen == "dbo"


def test_never_an_overlap_mode_below_the_margin():
    rng = random.Random(0)
    cal = Calibration()
    for _ in range(300):
        times = PhaseTimes(**{k: rng.uniform(0, 5) for k in
                              ("attention", "experts", "dispatch", "combine", "shared")})
        s = StepShape(layers=rng.randint(1, 8), tokens=64, rows_per_expert=rng.uniform(1, 4096),
                      expert_weight_bytes=rng.uniform(0, 1e10))
        joined = rng.random() < 0.5  # the split mode offered: "joined" or "dbo"
        offered = ("joined" if joined else "dbo", "sbo")
        p = predict(times, s, cal, margin=0.03, joined=joined)
        if p.chosen == "none":
            assert max(p.gain(m) for m in offered) < 0.03
        else:
            assert p.chosen in offered
            assert p.gain(p.chosen) >= 0.03
            assert p.times_ms[p.chosen] == min(p.times_ms[m] for m in ("none", *offered))


@pytest.mark.parametrize("bad", [
    lambda: PhaseTimes(attention=-1, experts=0, dispatch=0, combine=0),
    lambda: PhaseTimes(attention=float("nan"), experts=0, dispatch=0, combine=0),
    lambda: StepShape(layers=0, tokens=1, rows_per_expert=1.0),
    lambda: StepShape(layers=1, tokens=1, rows_per_expert=0.0),
    lambda: predict(PhaseTimes(attention=1, experts=1, dispatch=1, combine=1), shape(), FLAT,
                    margin=1.5),
    lambda: predict(PhaseTimes(attention=1, experts=1, dispatch=1, combine=1), shape(), FLAT,
                    sbo_chunks=0),
])
def test_bad_inputs_raise(bad):
    with pytest.raises(ValueError):
        bad()


def test_efficiency_interpolates_log_linearly_and_clamps():
    cal = Calibration(gemm_efficiency=((10.0, 0.2), (1000.0, 0.8)))
    assert cal.efficiency(100.0) == pytest.approx(0.5)
    assert cal.efficiency(1.0) == 0.2 and cal.efficiency(1e6) == 0.8


def test_calibration_json_round_trip(tmp_path):
    cal = Calibration(memory_gbs=4800.0, regimes={"ib": CommRegime(bandwidth_gbs=45, latency_us=12)})
    cal.save(tmp_path / "cal.json")
    assert Calibration.load(tmp_path / "cal.json") == cal
    data = json.loads((tmp_path / "cal.json").read_text())
    assert data["regimes"]["ib"] == {"bandwidth_gbs": 45, "latency_us": 12}


@pytest.mark.parametrize("change, words", [
    ({"gemm_efficiency": [[10, 0.5], [5, 0.6]]}, "strictly increasing"),
    ({"gemm_efficiency": [[10, 1.5]]}, "(0, 1]"),
    ({"memory_gbs": 0}, "memory_gbs"),
    ({"comm_sm_share": 1.0}, "comm_sm_share"),
    ({"overlap_clock": 1.2}, "overlap_clock"),
    ({"persistent_min_rows": 0}, "persistent_min_rows"),
    ({"comm_sm_shares": {"a2a/nvlink": 1.5}}, "comm_sm_shares"),
    ({"regimes": {"ib": {"bandwidth_gbs": -1, "latency_us": 1}}}, "bandwidth_gbs"),
    ({"regimes": {"ib": {"bandwidth": 1}}}, "regimes"),
    ({"tflops": 1}, "unknown keys"),
])
def test_calibration_bad_values_refused(tmp_path, change, words):
    data = {**Calibration().to_json(), **change}
    (tmp_path / "cal.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="cal.json") as exc:
        Calibration.load(tmp_path / "cal.json")
    assert words in str(exc.value)


def test_calibration_not_json_refused(tmp_path):
    (tmp_path / "cal.json").write_text("{not json")
    with pytest.raises(ValueError, match="cal.json"):
        Calibration.load(tmp_path / "cal.json")
    with pytest.raises(ValueError, match="known"):
        Calibration().regime("ib")
