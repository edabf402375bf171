"""Layers 1-2: single-batch overlap (SBO) in `dbo bench`. The three-way gate from
hand-made trial numbers, the SBO columns and fields, a backend that offers no SBO, and
`--overlaps` errors (layer 1, in-process); on two gloo ranks, an SBO step of the bench
against the no-overlap step, and sweeps that leave out DBO or SBO (layer 2, marked
distributed).
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from dbo.cli.bench import main
from dbo.cli.bench.config import EMULATED_REGIME, BenchConfig
from dbo.cli.bench.gating import GateDecision, GatePolicy
from dbo.cli.bench.joined import JOINED_SKIPPED
from dbo.cli.bench.sbo import (DBO_SKIPPED, SBO_SKIPPED, SboRound, attach_choice, attach_sbo,
                               gate_point, sbo_missing)
from dbo.cli.bench.point import make_point
from dbo.cli.bench.sweep import SweepResult
from dbo.cli.bench.timing import Timing
from tests.dist_utils import run_distributed

SHAPES = {"hidden_size": 8, "num_experts": 4, "experts_per_rank": 2, "top_k": 2,
          "intermediate_size": 8, "layers": 2, "dtype": "float32"}
GATE = GatePolicy(min_tokens_per_rank=512, min_gain=0.03)
DBO_PASSES = GateDecision(True, "1024 tokens/rank >= 512; trial DBO 1.050x >= 1.010x")
DBO_FAILS = GateDecision(False, "threshold: 256 tokens/rank < 512")


# ----------------------------------------------------------------- layer 1: in-process
def test_gate_chooses_among_off_sbo_and_dbo_from_the_worst_trials() -> None:
    # SBO needs no split: its trials pass it where DBO's thresholds keep DBO off.
    sbo = GATE.choose(dbo=DBO_FAILS, sbo_trials=[1.08, 1.12])
    assert sbo.mode == "sbo"
    assert sbo.reason == ("SBO: trial SBO 1.080x (worst of 2 trials) >= 1.010x (no split: "
                          "thresholds and probe do not apply); DBO: threshold: 256 "
                          "tokens/rank < 512")
    # The worst trial decides, as for DBO: one slow trial keeps SBO off.
    off = GATE.choose(dbo=DBO_FAILS, sbo_trials=[1.20, 1.00])
    assert off.mode == "off" and off.reason.startswith("SBO: trial SBO 1.000x (worst of 2")
    assert "DBO: threshold" in off.reason
    # Both pass: the faster worst trial wins, SBO on a tie (it splits nothing).
    dbo = GATE.choose(dbo=DBO_PASSES, dbo_trials=[1.10, 1.12], sbo_trials=[1.05, 1.30])
    assert dbo.mode == "dbo" and dbo.reason.startswith(
        "both pass, DBO's worst trial 1.100x > SBO's 1.050x; SBO: trial SBO 1.050x")
    tie = GATE.choose(dbo=DBO_PASSES, dbo_trials=[1.05], sbo_trials=[1.05])
    assert tie.mode == "sbo" and tie.reason.startswith(
        "both pass, SBO's worst trial 1.050x >= DBO's 1.050x")
    only_dbo = GATE.choose(dbo=DBO_PASSES, dbo_trials=[1.05], sbo_trials=[0.97])
    assert only_dbo.mode == "dbo" and "trial SBO 0.970x < 1.010x" in only_dbo.reason
    # Not timed: the reason says why, and that mode cannot be chosen.
    blocked = GATE.choose(dbo=DBO_PASSES, dbo_trials=[1.05], sbo_missing="not offered: x")
    assert blocked.mode == "dbo" and blocked.reason.startswith("SBO: not offered: x; DBO: ")
    no_dbo = GATE.choose(dbo=None, dbo_missing=DBO_SKIPPED, sbo_trials=[0.99])
    assert no_dbo.mode == "off" and no_dbo.reason.endswith(f"DBO: {DBO_SKIPPED}")


def test_a_predicted_mode_that_was_not_timed_leaves_the_point_off() -> None:
    prediction = SimpleNamespace(chosen="sbo", reason="SBO 1.07x, DBO 0.96x")
    chosen = gate_point(GATE, dbo=DBO_FAILS, dbo_trials=[], sbo_rounds=[], sbo_note="",
                        dbo_note="", prediction=prediction)
    assert (chosen.mode, chosen.reason) == ("sbo", "prediction: SBO 1.07x, DBO 0.96x")
    skipped = gate_point(GATE, dbo=DBO_FAILS, dbo_trials=[], sbo_rounds=[],
                         sbo_note=SBO_SKIPPED, dbo_note="", prediction=prediction)
    assert skipped.mode == "off" and skipped.reason.endswith(f"but sbo is {SBO_SKIPPED}")
    none = gate_point(GATE, dbo=DBO_FAILS, dbo_trials=[], sbo_rounds=[], sbo_note="",
                      dbo_note="", prediction=SimpleNamespace(chosen="none", reason="r"))
    assert none.mode == "off"


def ungated_point(cfg: BenchConfig, *, tokens: int):
    """A point of 2 ranks, a2a_ll: no DBO 10 ms, DBO 10.2 / 10.4 ms (rank 0 / 1), host 1
    and 2 ms, no probe; DBO gated off."""
    return make_point(cfg, backend="a2a_ll", tokens=tokens, world_size=2,
                      t_off=Timing((10.0, 10.0), (1.0, 1.0)),
                      t_on=Timing((10.2, 10.4), (2.0, 2.0)), ceiling=None, split=True,
                      split_reason="", use_dbo=False, gate_reason="")


def _point(cfg: BenchConfig, *, t_sbo: float | None, note: str = "",
           trials: tuple[float, ...] = (1.3,)):
    point = ungated_point(cfg, tokens=256)
    rounds = [] if t_sbo is None else [SboRound(Timing((t_sbo, t_sbo), (1.5, 1.5)), t)
                                       for t in trials]
    choice = gate_point(GATE, dbo=DBO_FAILS, dbo_trials=[0.96], sbo_rounds=rounds,
                        sbo_note=note, dbo_note="")
    attach_sbo(point, rounds, note=note)
    attach_choice(point, choice)
    return point


def test_sbo_columns_fields_and_best_of_three(tmp_path: Path) -> None:
    from dbo.cli.bench.report import final_line, format_table, write_outputs

    cfg = BenchConfig(regime=EMULATED_REGIME, tokens=(256,), backends=("a2a_ll",),
                      out_dir=str(tmp_path), plot=False)
    point = _point(cfg, t_sbo=8.0)
    assert point.t_sbo_ms == 8.0 and point.speedup_sbo == pytest.approx(1.25)
    assert point.gate == "sbo" and point.t_gated_ms == 8.0
    assert point.gated_speedup == pytest.approx(1.25)  # the chosen mode's speedup
    assert (point.best_overlap, point.best_speedup) == ("sbo", pytest.approx(1.25))
    assert point.rounds_ms["t_sbo"] == [8.0] and point.sbo_trial_speedups == [1.3]
    result = SweepResult(cfg, 2, SHAPES, "measured", [point])
    table = format_table(result)
    columns = next(line for line in table.splitlines() if "T/rank" in line).split()
    row = next(line for line in table.splitlines() if line.split()[:2] == ["256", "a2a_ll"])
    assert columns[-11:] == ["SBO", "ms", "SBO", "x", "joined", "ms", "joined", "x", "gate",
                             "gated", "best"], columns
    # SBO ms, SBO x, joined ms and x (not timed here), gate, gated, best
    assert row.split()[-8:] == ["8.000/8.000", "1.250", "-", "-", "sbo", "1.250", "sbo",
                                "1.250"], row
    files = write_outputs(result)
    final = json.loads(final_line(result, files))
    doc = json.loads(Path(files["json"]).read_text())
    for p in (final["points"][0], doc["points"][0]):
        assert p["t_sbo_ms"] == 8.0 and p["speedup_sbo"] == 1.25 and p["gate"] == "sbo"
        assert p["best_overlap"] == "sbo" and p["best_speedup"] == 1.25
        assert p["sbo_trial_speedups"] == [1.3]
    assert doc["summary"]["best"] == [{"backend": "a2a_ll", "tokens_per_rank": 256,
                                       "best_overlap": "sbo", "best_speedup": 1.25}]
    assert doc["summary"]["points_gated_sbo"] == 1
    assert "t_sbo_ms" in Path(files["csv"]).read_text().splitlines()[0]


class _NoSbo(nn.Module):
    def dbo_sbo_blocker(self) -> str:
        return "backend 'x' has nothing to overlap"


def test_a_backend_without_sbo_shows_dashes_and_says_why(tmp_path: Path) -> None:
    from dbo.cli.bench.report import format_table

    cfg = BenchConfig(regime=EMULATED_REGIME, tokens=(256,), backends=("a2a_ll",),
                      out_dir=str(tmp_path), plot=False)
    note = sbo_missing(cfg, nn.Sequential(_NoSbo()))
    assert note == "not offered: backend 'x' has nothing to overlap"
    assert sbo_missing(BenchConfig(overlaps=("dbo",)), nn.Sequential(_NoSbo())) == SBO_SKIPPED
    point = _point(cfg, t_sbo=None, note=note)
    assert point.t_sbo_ms is None and point.speedup_sbo is None and point.gate == "off"
    assert point.gate_reason.startswith(f"SBO: {note}; DBO: threshold")
    table = format_table(SweepResult(cfg, 2, SHAPES, "measured", [point]))
    row = next(line for line in table.splitlines() if line.split()[:2] == ["256", "a2a_ll"])
    assert row.split()[-8:] == ["-", "-", "-", "-", "off", "1.000", "off", "1.000"], row
    assert f"[SBO {note}]" in table


@pytest.mark.parametrize("argv, message", [
    (["--overlaps", "dbo,xbo"], "unknown overlap 'xbo': use any of dbo, sbo, joined"),
    (["--overlaps", "none"], "unknown overlap 'none': use any of dbo, sbo, joined "
                             "(--overlaps dbo,sbo,joined; no overlap is always timed)"),
    (["--overlaps", "joined,dbo,joined"],
     "overlaps=('joined', 'dbo', 'joined') repeats a name: list each once"),
    (["--overlaps", "sbo,sbo"], "overlaps=('sbo', 'sbo') repeats a name: list each once"),
    (["--overlaps", ","], "overlaps=(): give at least one of dbo, sbo, joined"),
])
def test_bad_overlaps_exit_with_the_fix(argv: list[str], message: str, tmp_path: Path,
                                        capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--device", "cpu", "--out", str(tmp_path), *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("argv, message", [
    (["--combine-groups", "2", "--combine-chunks", "2"],
     "combine_chunks=2 and combine_groups=2: an SBO step chunks its combine by rows or by "
     "expert group, not both"),
    # The tiny preset's 8 experts over the 2 ranks: 4 each.
    (["--combine-groups", "8"], "combine_groups=8 exceeds the 4 experts each rank holds"),
    (["--combine-groups", "-1"], "combine_groups=-1 must be an int >= 1"),
])
def test_bad_combine_groups_exit_with_the_fix(argv: list[str], message: str, tmp_path: Path,
                                              capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--device", "cpu", "--backends", "a2a_ll", "--out", str(tmp_path), *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


# --------------------------------------------------------- layer 2: two gloo processes
def _sbo_pieces(rank: int, world_size: int, out_dir: str) -> dict:
    import torch.distributed as dist

    from dbo.cli.bench.sweep import run_sweep
    from dbo.cli.bench.workload import WorkloadFactory

    group, cpu = dist.group.WORLD, torch.device("cpu")
    out: dict = {}
    # The bench's SBO step computes what its no-overlap step does, on both backend kinds
    # (a2a_ll: the SBO step runs on the DBO-off model, capacity T).
    factory = WorkloadFactory(BenchConfig(layers=2), group=group, device=cpu)
    for backend in ("a2a", "a2a_ll"):
        off = factory.get(tokens=10, backend=backend, dbo=False)
        sbo = factory.get(tokens=10, backend=backend, dbo=False, sbo=True)
        expected, got = off.step(), sbo.step()
        out[backend] = ((got - expected).abs().max().item(), sbo.model is off.model,
                        sbo.runner.last_decision.overlap, sbo.was_split)
    # Sweeps that leave out one overlap.
    for overlaps in (("sbo",), ("dbo",)):
        cfg = BenchConfig(mode="decode", tokens=(4,), context=8, backends=("a2a_ll",),
                          layers=2, iters=1, warmup=1, rounds=1, out_dir=out_dir,
                          plot=False, progress=False, overlaps=overlaps)
        out[overlaps] = run_sweep(cfg, group=group, device=cpu).points[0]
    return out


@pytest.mark.distributed
def test_sbo_step_equals_no_overlap_and_overlaps_leave_one_out(tmp_path: Path) -> None:
    from dbo.cli.bench.report import format_table

    results = run_distributed(2, _sbo_pieces, str(tmp_path))
    for rank, out in enumerate(results):
        for backend in ("a2a", "a2a_ll"):
            error, same_model, overlap, split = out[backend]
            assert error <= 1e-5, (rank, backend, error)
            assert same_model and overlap == "sbo" and not split, (rank, backend)
    no_dbo, no_sbo = results[0][("sbo",)], results[0][("dbo",)]
    assert no_dbo.t_dbo_ms is None and no_dbo.speedup is None and no_dbo.t_sbo_ms > 0
    assert no_dbo.trial_speedups == [] and len(no_dbo.sbo_trial_speedups) == 1
    assert no_dbo.gate in ("off", "sbo") and no_dbo.gate_reason.endswith(
        f"DBO: {DBO_SKIPPED}; joined: {JOINED_SKIPPED}")
    assert no_dbo.t_joined_ms is None and no_dbo.joined_note == JOINED_SKIPPED
    assert "t_dbo" not in no_dbo.per_rank_ms and no_dbo.best_overlap in ("off", "sbo")
    assert no_sbo.t_sbo_ms is None and no_sbo.sbo_note == SBO_SKIPPED and no_sbo.t_dbo_ms > 0
    assert no_sbo.gate in ("off", "dbo") and no_sbo.gate_reason.startswith(f"SBO: {SBO_SKIPPED}")
    cfg = BenchConfig(tokens=(4,), backends=("a2a_ll",), out_dir=str(tmp_path))
    table = format_table(SweepResult(cfg, 2, SHAPES, "skipped", [no_dbo, no_sbo]))
    assert "gate decisions:" in table  # a table without DBO or SBO times still renders


def _grouped_sweep(rank: int, world_size: int, out_dir: str) -> dict:
    import torch.distributed as dist

    from dbo.cli.bench.sweep import run_sweep
    from dbo.cli.bench.workload import WorkloadFactory
    from moe.backends.a2a_ll import AllToAllLLBackend

    grouped_calls: list[int] = []
    original = AllToAllLLBackend.finalize_grouped_async

    def counted(self, *args, **kwargs):  # the SBO step takes the grouped combine
        grouped_calls.append(kwargs["num_groups"])
        return original(self, *args, **kwargs)

    AllToAllLLBackend.finalize_grouped_async = counted
    try:
        group, cpu = dist.group.WORLD, torch.device("cpu")
        factory = WorkloadFactory(BenchConfig(layers=2, backends=("a2a_ll",), combine_groups=2),
                                  group=group, device=cpu)
        off = factory.get(tokens=10, backend="a2a_ll", dbo=False)
        expected = off.step()
        calls_off = len(grouped_calls)
        sbo = factory.get(tokens=10, backend="a2a_ll", dbo=False, sbo=True)
        got = sbo.step()
        out = {"error": (got - expected).abs().max().item(), "calls_off": calls_off,
               "calls_sbo": list(grouped_calls[calls_off:]),
               "overlap": sbo.runner.last_decision.overlap}
        cfg = BenchConfig(mode="decode", tokens=(4,), context=8, backends=("a2a_ll",),
                          layers=2, iters=1, warmup=1, rounds=1, out_dir=out_dir, plot=False,
                          progress=False, combine_groups=2)
        result = run_sweep(cfg, group=group, device=cpu)
        out["point"] = result.points[0]
        out["result"] = result if rank == 0 else None
        return out
    finally:
        AllToAllLLBackend.finalize_grouped_async = original


@pytest.mark.distributed
def test_a_grouped_sbo_sweep_measures_and_predicts_the_groups(tmp_path: Path) -> None:
    from dbo.calibration import Calibration
    from dbo.cli.bench.report import format_table, write_outputs
    from dbo.cost_model import predict
    from dbo.predicted_overlap import point_inputs

    results = run_distributed(2, _grouped_sweep, str(tmp_path))
    for rank, out in enumerate(results):
        # fp32, each group's partial summed at the source: within rounding (1e-5, as the
        # ungrouped SBO step above and tests/moe/test_combine_groups.py).
        assert out["error"] <= 1e-5, (rank, out["error"])
        assert out["calls_off"] == 0 and out["overlap"] == "sbo", (rank, out)
        assert out["calls_sbo"] == [2, 2], (rank, out)  # 2 MoE layers, 2 groups each
    point = results[0]["point"]
    measured = point.measured_point
    assert (measured.sbo_groups, measured.sbo_chunks) == (2, 1)
    # The point's SBO prediction is the cost model's grouped term on its measured phases
    # (the same inputs, so equal but for the order of float operations).
    cal = Calibration()
    split = dict(split_compute=point.t_split_ms) if point.t_split_ms else {}
    inputs = point_inputs(dataclasses.replace(measured, **split), cal)
    assert point.t_sbo_pred_ms == pytest.approx(predict(*inputs, cal,
                                                        sbo_groups=2).times_ms["sbo"])
    result = results[0]["result"]
    files = write_outputs(result)  # the calibration file keeps the point's groups
    assert Calibration.load(files["calibration"]).points[0].sbo_groups == 2
    assert json.loads(Path(files["json"]).read_text())["config"]["combine_groups"] == 2
    table = format_table(result)
    assert "a2a_ll: the experts in 2 expert groups over every row, each group's combine " \
           "under the next group's experts" in table
