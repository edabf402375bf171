"""Layers 1-2: DBO with joined experts in `dbo bench`. The gate among off / sbo / dbo /
joined from hand-made trial numbers, the joined columns and fields, its predicted time
whether or not the cost model predicts one (layer 1, in-process); on two gloo ranks, the
bench's joined step against the no-overlap step, its experts run once per layer, and a
sweep of joined alone whose ranks take the same choice (layer 2, marked distributed).
The layer- and decode-mode sweeps with joined are tests/tools/test_bench.py's and
test_bench_decode.py's end-to-end runs.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dbo.calibration import Calibration, MeasuredPoint
from dbo.cli.bench.config import EMULATED_REGIME, BenchConfig
from dbo.cli.bench.gating import GateDecision, GatePolicy
from dbo.cli.bench.joined import (JOINED_SKIPPED, JoinedRound, attach_joined, decide_joined,
                                  joined_missing)
from dbo.cli.bench.point import make_point
from dbo.cli.bench.sbo import DBO_SKIPPED, SboRound, attach_choice, attach_sbo, gate_point
from dbo.cli.bench.sweep import SweepResult
from dbo.cli.bench.timing import Timing
from tests.dist_utils import run_distributed
from tests.tools.test_bench_sbo import ungated_point

SHAPES = {"hidden_size": 8, "num_experts": 4, "experts_per_rank": 2, "top_k": 2,
          "intermediate_size": 8, "layers": 2, "dtype": "float32"}
GATE = GatePolicy(min_tokens_per_rank=512, min_gain=0.03)


def _split(trials: list[float], *, tokens: int = 1024, ceiling: float | None = None,
           name: str = "DBO") -> GateDecision:
    return GATE.decide(tokens_per_rank=tokens, ceiling=ceiling, trial_speedups=trials,
                       name=name)


# ----------------------------------------------------------------- layer 1: in-process
def test_the_split_rules_gate_joined_as_they_gate_dbo() -> None:
    small = _split([1.5], tokens=256, name="joined")
    assert not small.use_dbo and small.reason == "threshold: 256 tokens/rank < 512"
    low = _split([1.5], ceiling=1.02, name="joined")
    assert not low.use_dbo and low.reason.startswith("probe: measured ceiling 1.020x < 1.030x")
    slow = _split([1.2, 0.98], name="joined")
    assert not slow.use_dbo and slow.reason.startswith(
        "trial: joined 0.980x (worst of 2 trials) < 1.010x in a separate short run")
    ok = _split([1.2, 1.1], ceiling=1.3, name="joined")
    assert ok.use_dbo and ok.reason == ("1024 tokens/rank >= 512; measured ceiling 1.300x >= "
                                        "1.030x; trial joined 1.100x (worst of 2 trials) >= "
                                        "1.010x")
    with pytest.raises(ValueError, match="decide\\(name='sbo'\\): the split rules gate "
                                         "'DBO' or 'joined'"):
        _split([1.1], name="sbo")


def test_gate_chooses_joined_where_its_worst_trial_is_fastest_and_passes() -> None:
    dbo, joined = [1.10, 1.08], [1.30, 1.15]
    chosen = GATE.choose(dbo=_split(dbo), dbo_trials=dbo, sbo_trials=[1.05],
                         joined=_split(joined, name="joined"), joined_trials=joined)
    assert chosen.mode == "joined"
    assert chosen.reason.startswith("all 3 pass, joined's worst trial 1.150x > SBO's 1.050x, "
                                    "> DBO's 1.080x; SBO: trial SBO 1.050x")
    assert "; joined: 1024 tokens/rank >= 512; no ceiling probe; trial joined 1.150x" \
        in chosen.reason
    # The worst trial counts: one slow joined trial hands the point to DBO.
    slow = [1.30, 1.00]
    chosen = GATE.choose(dbo=_split(dbo), dbo_trials=dbo, sbo_trials=[0.9],
                         joined=_split(slow, name="joined"), joined_trials=slow)
    assert chosen.mode == "dbo" and "joined: trial: joined 1.000x (worst of 2" in chosen.reason


@pytest.mark.parametrize("tokens, ceiling, why", [
    (256, None, "joined: threshold: 256 tokens/rank < 512"),
    (1024, 1.01, "joined: probe: measured ceiling 1.010x < 1.030x"),
])
def test_joined_is_not_chosen_below_the_thresholds_or_a_low_ceiling(
        tokens: int, ceiling: float | None, why: str) -> None:
    fast = [1.5]  # its trials would win, but the split rules come first
    chosen = GATE.choose(dbo=None, dbo_missing=DBO_SKIPPED, sbo_trials=[1.02],
                         joined=_split(fast, tokens=tokens, ceiling=ceiling, name="joined"),
                         joined_trials=fast)
    assert chosen.mode == "sbo" and why in chosen.reason, chosen
    alone = GATE.choose(dbo=None, dbo_missing=DBO_SKIPPED, sbo_missing="not offered: x",
                        joined=_split(fast, tokens=tokens, ceiling=ceiling, name="joined"),
                        joined_trials=fast)
    assert alone.mode == "off" and alone.reason.endswith(why + (
        "" if ceiling is None else " (1 + min_gain): too little comm to hide")), alone


def test_ties_prefer_the_mode_that_splits_less() -> None:
    same = [1.05]
    tie = GATE.choose(dbo=_split(same), dbo_trials=same, sbo_trials=same,
                      joined=_split(same, name="joined"), joined_trials=same)
    assert tie.mode == "sbo" and tie.reason.startswith(
        "all 3 pass, SBO's worst trial 1.050x >= joined's 1.050x, >= DBO's 1.050x")
    tie = GATE.choose(dbo=_split(same), dbo_trials=same, sbo_trials=[0.9],
                      joined=_split(same, name="joined"), joined_trials=same)
    assert tie.mode == "joined" and tie.reason.startswith(
        "both pass, joined's worst trial 1.050x >= DBO's 1.050x")
    # A split mode that passed without a trial (none ran) loses to one that ran.
    untried = GATE.choose(dbo=_split(same), dbo_trials=same, sbo_missing="not offered: x",
                          joined=_split([], name="joined"), joined_trials=[])
    assert untried.mode == "dbo" and untried.reason.startswith(
        "both pass, DBO's worst trial 1.050x (joined ran no trial)")
    none = GATE.choose(dbo=_split([]), sbo_missing="not offered: x",
                       joined=_split([], name="joined"))
    assert none.mode == "joined" and none.reason.startswith(
        "both pass, none ran a trial: joined first in the tie order")


def test_a_gate_without_joined_leaves_it_out_and_a_skipped_one_says_why() -> None:
    # `dbo bench --hf` gates off / sbo / dbo only: no word on joined.
    chosen = GATE.choose(dbo=_split([1.02]), dbo_trials=[1.02], sbo_trials=[1.0])
    assert chosen.mode == "dbo" and "joined" not in chosen.reason
    skipped = GATE.choose(dbo=_split([1.02]), dbo_trials=[1.02], sbo_trials=[1.0],
                          joined_missing=JOINED_SKIPPED)
    assert skipped.mode == "dbo" and skipped.reason.endswith(f"; joined: {JOINED_SKIPPED}")
    assert joined_missing(BenchConfig()) == ""  # timed by default
    assert joined_missing(BenchConfig(overlaps=("dbo", "sbo"))) == JOINED_SKIPPED


def test_a_predicted_joined_is_taken_where_timed_else_the_point_stays_off() -> None:
    prediction = SimpleNamespace(chosen="joined", reason="joined: predicted +12.0%")
    timed = gate_point(GATE, dbo=None, dbo_trials=[], sbo_rounds=[], sbo_note="",
                       dbo_note=DBO_SKIPPED, joined=None, joined_note="",
                       prediction=prediction)
    assert (timed.mode, timed.reason) == ("joined", "prediction: joined: predicted +12.0%")
    skipped = gate_point(GATE, dbo=None, dbo_trials=[], sbo_rounds=[], sbo_note="",
                         dbo_note="", joined_note=JOINED_SKIPPED, prediction=prediction)
    assert skipped.mode == "off" and skipped.reason.endswith(f"but joined is {JOINED_SKIPPED}")


def _point(cfg: BenchConfig, *, joined_ms: tuple[float, float] | None,
           sbo_ms: float = 9.0, trials: tuple[float, ...] = (1.2,)):
    """A 10 ms point (DBO 10.4 ms, its trial 0.96x) with SBO at `sbo_ms` (trial 1.02x)
    and joined at `joined_ms` (rank 0, rank 1; its trials `trials`), gated."""
    point = ungated_point(cfg, tokens=1024)
    sbo = [SboRound(Timing((sbo_ms, sbo_ms), (1.5, 1.5)), 1.02)]
    joined = [] if joined_ms is None else [
        JoinedRound(Timing(joined_ms, (1.8, 1.9)), t, True, "split: 512 + 512")
        for t in trials]
    note = "" if joined_ms is not None else JOINED_SKIPPED
    decision = (decide_joined(GATE, tokens=1024, ceiling=None, rounds=joined,
                              no_probe_reason="no probe") if joined else None)
    choice = gate_point(GATE, dbo=_split([0.96]), dbo_trials=[0.96], sbo_rounds=sbo,
                        sbo_note="", dbo_note="", joined=decision,
                        joined_trials=[r.trial for r in joined], joined_note=note)
    attach_sbo(point, sbo, note="")
    attach_joined(point, joined, note=note)
    attach_choice(point, choice)
    return point


def test_joined_columns_fields_gate_and_best(tmp_path: Path) -> None:
    from dbo.cli.bench.report import final_line, format_table, write_outputs

    cfg = BenchConfig(regime=EMULATED_REGIME, tokens=(1024,), backends=("a2a_ll",),
                      out_dir=str(tmp_path), plot=False)
    point = _point(cfg, joined_ms=(8.0, 8.0))
    assert (point.t_joined_ms, point.t_joined_ms_rank0, point.host_joined_ms) == (8.0, 8.0, 1.9)
    assert point.speedup_joined == pytest.approx(1.25) and point.joined_split
    assert point.gate == "joined" and point.t_gated_ms == 8.0  # 1.2x beats SBO's 1.02x
    assert (point.best_overlap, point.best_speedup) == ("joined", pytest.approx(1.25))
    assert point.rounds_ms["t_joined"] == [8.0] and point.joined_trial_speedups == [1.2]
    result = SweepResult(cfg, 2, SHAPES, "measured", [point])
    table = format_table(result)
    columns = next(line for line in table.splitlines() if "T/rank" in line).split()
    assert columns[-11:] == ["SBO", "ms", "SBO", "x", "joined", "ms", "joined", "x", "gate",
                             "gated", "best"], columns
    row = next(line for line in table.splitlines() if line.split()[:2] == ["1024", "a2a_ll"])
    # SBO ms, SBO x, joined ms, joined x, gate, gated, best
    assert row.split()[-8:] == ["9.000/9.000", "1.111", "8.000/8.000", "1.250", "joined",
                                "1.250", "joined", "1.250"], row
    files = write_outputs(result)
    final = json.loads(final_line(result, files))
    doc = json.loads(Path(files["json"]).read_text())
    for p in (final["points"][0], doc["points"][0]):
        assert p["t_joined_ms"] == 8.0 and p["speedup_joined"] == 1.25 and p["gate"] == "joined"
        assert p["host_joined_ms"] == 1.9 and p["joined_note"] == "" and p["joined_split"]
        assert p["joined_trial_speedups"] == [1.2] and p["best_overlap"] == "joined"
    assert doc["summary"]["points_gated_joined"] == 1
    assert "t_joined_ms_rank0" in Path(files["csv"]).read_text().splitlines()[0]
    # The oracle's ties follow the gate's order: SBO before joined, joined before DBO.
    tie = _point(cfg, joined_ms=(8.0, 8.0), sbo_ms=8.0, trials=(0.9,))
    assert tie.gate == "sbo" and "joined: trial: joined 0.900x" in tie.gate_reason
    assert (tie.best_overlap, tie.best_speedup) == ("sbo", pytest.approx(1.25))


def test_a_sweep_without_joined_shows_dashes_and_says_why(tmp_path: Path) -> None:
    from dbo.cli.bench.report import format_table

    cfg = BenchConfig(regime=EMULATED_REGIME, tokens=(1024,), backends=("a2a_ll",),
                      out_dir=str(tmp_path), plot=False, overlaps=("dbo", "sbo"))
    point = _point(cfg, joined_ms=None)
    assert point.t_joined_ms is None and point.speedup_joined is None
    assert point.gate == "sbo" and point.best_overlap == "sbo"
    table = format_table(SweepResult(cfg, 2, SHAPES, "measured", [point]))
    row = next(line for line in table.splitlines() if line.split()[:2] == ["1024", "a2a_ll"])
    assert row.split()[-6:] == ["-", "-", "sbo", "1.111", "sbo", "1.111"], row
    assert f"[joined {JOINED_SKIPPED}]" in table


# none = 2+2+4+4 = 12 ms (tests/tools/test_bench_predicted.py).
COMM_HEAVY = MeasuredPoint(tokens=64, decode=True, layers=1, rows_per_expert=1e6,
                           attention=2.0, experts=2.0, dispatch=4.0, combine=4.0)


@pytest.mark.parametrize("predicts_joined", [True, False])
def test_the_predicted_joined_time_is_shown_where_the_cost_model_makes_one(
        predicts_joined: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    import dbo.cli.bench.predicted as predicted

    real = predicted.predict

    def with_or_without_joined(*args, **kwargs):  # whatever the cost model predicts now
        out = real(*args, **kwargs)
        times = {k: v for k, v in out.times_ms.items() if k != "joined"}
        return dataclasses.replace(out, times_ms={**times, **(
            {"joined": 7.5} if predicts_joined else {})})

    monkeypatch.setattr(predicted, "predict", with_or_without_joined)
    cfg = BenchConfig(tokens=(64,), backends=("a2a",))
    point = make_point(cfg, backend="a2a", tokens=64, world_size=2, t_off=Timing((10.0, 10.0)),
                       t_on=Timing((10.0, 10.0)), ceiling=None, split=True, split_reason="",
                       use_dbo=False, gate_reason="")
    attach_joined(point, [JoinedRound(Timing((6.0, 6.0)), None, True, "")], note="")
    predicted.attach_prediction(point, COMM_HEAVY, Calibration())
    assert point.measured_point.measured_ms["joined"] == 6.0
    cells = predicted.prediction_lines(SweepResult(cfg, 2, {}, "", [point]))[-1].split()
    if predicts_joined:
        assert point.t_joined_pred_ms == 7.5 and point.pred_err_joined == pytest.approx(0.25)
        assert cells[8:10] == ["7.500", "+25.0%"], cells
    else:
        assert point.t_joined_pred_ms is None and point.pred_err_joined is None
        assert cells[8:10] == ["-", "-"], cells
    assert cells[4] == f"{point.t_dbo_pred_ms:.3f}"  # the others where they were


# --------------------------------------------------------- layer 2: two gloo processes
def _joined_pieces(rank: int, world_size: int, out_dir: str) -> dict:
    import torch.distributed as dist

    from dbo.cli.bench.sweep import run_sweep
    from dbo.cli.bench.workload import WorkloadFactory
    from moe.modular_kernel import ModularKernel

    rows: list[int] = []  # rows of each experts call
    run = ModularKernel._run_experts

    def counted(self, x_RH, *args, **kwargs):
        rows.append(x_RH.shape[0])
        return run(self, x_RH, *args, **kwargs)

    ModularKernel._run_experts = counted
    try:
        group, cpu = dist.group.WORLD, torch.device("cpu")
        out: dict = {}
        factory = WorkloadFactory(BenchConfig(layers=2), group=group, device=cpu)
        for backend in ("a2a", "a2a_ll"):
            off = factory.get(tokens=10, backend=backend, dbo=False)
            expected = off.step()
            del off
            rows.clear()
            joined = factory.get(tokens=10, backend=backend, dbo=True, joined=True)
            got = joined.step()
            out[backend] = ((got - expected).abs().max().item(), joined.was_split, len(rows),
                            joined.eager_runner.config.joined_experts)
        cfg = BenchConfig(mode="decode", tokens=(4,), context=8, backends=("a2a_ll",),
                          layers=2, iters=1, warmup=1, rounds=2, out_dir=out_dir,
                          plot=False, progress=False, overlaps=("joined",))
        out["point"] = run_sweep(cfg, group=group, device=cpu).points[0]
        return out
    finally:
        ModularKernel._run_experts = run


@pytest.mark.distributed
def test_joined_step_equals_no_overlap_and_every_rank_gates_alike(tmp_path: Path) -> None:
    results = run_distributed(2, _joined_pieces, str(tmp_path))
    for rank, out in enumerate(results):
        for backend in ("a2a", "a2a_ll"):
            error, split, expert_calls, joined = out[backend]
            # fp32, the experts over both ubatches' rows at once: within rounding (1e-5,
            # as tests/moe/test_joined_experts.py).
            assert error <= 1e-5, (rank, backend, error)
            # Split, and one experts call per MoE layer (2), not one per ubatch and layer.
            assert split and joined and expert_calls == 2, (rank, backend, out[backend])
    points = [out["point"] for out in results]
    for point in points:  # joined alone: no DBO, no SBO
        assert point.t_dbo_ms is None and point.t_sbo_ms is None and point.t_joined_ms > 0
        assert point.joined_split and len(point.joined_trial_speedups) == 2
        assert point.gate in ("off", "joined") and point.best_overlap in ("off", "joined")
    # Every rank takes the same choice, from the same (gathered) trial speedups.
    assert points[0].joined_trial_speedups == points[1].joined_trial_speedups
    assert (points[0].gate, points[0].gate_reason) == (points[1].gate, points[1].gate_reason)
