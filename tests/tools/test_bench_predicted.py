"""Layers 1-2: `dbo bench`'s cost-model side. In process (layer 1): the dispatch/combine
split of a recording, the decode test, a point's predicted columns on hand-computed
phase times. Two gloo ranks (layer 2, marked distributed): the bench writes
calibration.json, a second run gated on it runs no trial step, `dbo plan` reads it."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dbo.calibration import Calibration, MeasuredPoint
from dbo.cli.bench.ceiling import CommRecording
from dbo.cli.bench.config import BenchConfig
from dbo.cli.bench.phases import split_recording, step_is_decode
from dbo.cli.bench.point import make_point
from dbo.cli.bench.predicted import attach_prediction, prediction_lines
from dbo.cli.bench.sweep import SweepResult
from dbo.cli.bench.timing import Timing
from dbo.cli.bench.workload import Workload
from tests.dist_utils import run_distributed
from tests.tools.fd_output import printed

def test_each_layers_last_collective_is_its_combine():
    recording = CommRecording(segments=[["vote"], ["count", "data", "back"], ["gather", "rs"]])
    dispatch, combine = split_recording(recording)
    assert dispatch.segments == [["vote"], ["count", "data"], ["gather"]]
    assert combine.segments == [[], ["back"], ["rs"]]


def test_decode_as_the_runner_plans_it():
    x = torch.zeros(4, 8)
    work = lambda **kw: Workload(model=torch.nn.Identity(), args=(x,), kwargs=kw,  # noqa: E731
                                 num_tokens=4, runner=None)
    assert step_is_decode(work(), "tokens")
    assert step_is_decode(work(seq_lens=[1, 1, 1, 1]), "requests")
    assert not step_is_decode(work(seq_lens=[3, 1]), "requests")
    assert not step_is_decode(work(), "batch") and step_is_decode(
        Workload(model=torch.nn.Identity(), args=(torch.zeros(4, 1),), kwargs={},
                 num_tokens=4, runner=None), "batch")


# none = 2+2+4+4 = 12 ms, DBO 9 ms (tests/dbo/test_predicted_overlap.py: COMM_HEAVY).
COMM_HEAVY = MeasuredPoint(tokens=64, decode=True, layers=1, rows_per_expert=1e6,
                           attention=2.0, experts=2.0, dispatch=4.0, combine=4.0)
CFG = BenchConfig(tokens=(64,), backends=("a2a",))


def _point():
    """A measured 10 ms point with DBO on and off, to attach predictions to."""
    return make_point(CFG, backend="a2a", tokens=64, world_size=2, t_off=Timing((10.0, 10.0)),
                      t_on=Timing((10.0, 10.0)), ceiling=None, split=True, split_reason="",
                      use_dbo=False, gate_reason="")


def test_point_gets_predicted_times_and_errors():
    point = _point()
    attach_prediction(point, COMM_HEAVY, Calibration())
    assert point.t_nodbo_pred_ms == pytest.approx(12.0) and point.t_dbo_pred_ms == pytest.approx(9.0)
    assert point.pred_err_nodbo == pytest.approx(0.2) and point.pred_err_dbo == pytest.approx(-0.1)
    assert point.speedup_pred == pytest.approx(12 / 9) and point.pred_choice == "dbo"
    assert point.measured_point.measured_ms == {"none": 10.0, "dbo": 10.0}
    assert {"t_dbo_pred_ms", "pred_err_dbo", "speedup_pred"} <= set(point.row())
    lines = prediction_lines(SweepResult(CFG, 2, {}, "", [point]))
    # SBO not timed here: its prediction (2 + ov(0, 4) + 2 + 4 = 12 ms), no error; then
    # joined's prediction and error (tests/tools/test_bench_joined.py), then pred x.
    cells = lines[-1].split()
    assert cells[:8] == ["64", "a2a", "12.000", "+20.0%", "9.000", "-10.0%", "12.000", "-"]
    assert cells[9:11] == ["-", "1.333"]  # joined not timed: no error


def test_a_timed_sbo_step_gets_its_prediction_and_error_in_the_table():
    point = _point()
    point.t_sbo_ms = 15.0  # predicted 12 ms (above): -20%
    attach_prediction(point, COMM_HEAVY, Calibration())
    assert point.t_sbo_pred_ms == pytest.approx(12.0)
    assert point.pred_err_sbo == pytest.approx(-0.2)
    assert point.measured_point.measured_ms["sbo"] == 15.0
    line = prediction_lines(SweepResult(CFG, 2, {}, "", [point]))[-1].split()
    assert line[6:8] == ["12.000", "-20.0%"]


def test_the_probes_split_compute_feeds_the_dbo_prediction():
    # COMM_HEAVY's DBO: a2 = x2 = 1, d2 = c2 = 2: 9 ms. A measured split compute of 6 ms
    # (against the modelled 2 * (1 + 1) = 4) scales a2 and x2 to 1.5; with f = 0.18,
    # ov(1.5, 2) = max(2, 1.5 + 0.36) = 2, so the layer is 4 * 2 = 8 ms and the fill/drain
    # 1.5 + 2 - 2 = 1.5 ms: 9.5 ms.
    point = _point()
    point.t_split_ms = 6.0
    attach_prediction(point, COMM_HEAVY, Calibration())
    assert point.t_dbo_pred_ms == pytest.approx(9.5)
    assert point.measured_point.split_compute == 6.0


BENCH_ARGS = ("--device", "cpu", "--tokens", "16,64", "--backends", "a2a", "--iters", "1",
              "--warmup", "1", "--layers", "2", "--rounds", "1", "--no-progress")
PREDICTED = "predicted (cost model on each point's measured phase times"


def _bench(out: Path, *extra: str) -> dict:
    """`dbo bench` on two gloo ranks through main() in this process (the ranks it spawns
    import torch, this process has): its final JSON line."""
    from dbo.cli.bench import main

    with pytest.MonkeyPatch.context() as env, printed() as output:
        for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "NCCL_P2P_DISABLE"):
            env.delenv(name, raising=False)  # not under torchrun: it spawns its ranks
        code = main([*BENCH_ARGS, "--out", str(out), *extra])
    assert code == 0, output.err[-3000:]
    assert PREDICTED in output.out
    return json.loads(output.out.strip().splitlines()[-1])


def _sweep(rank: int, world_size: int, argv: list[str]) -> dict | None:
    """What a `dbo bench argv` rank sweeps and (rank 0) reports, on ranks that
    tests.dist_utils starts (the command's own launch: `_bench`): its final JSON line."""
    import torch.distributed as dist

    from dbo.cli.bench import report
    from dbo.cli.bench.launch import build_parser, config_from_args
    from dbo.cli.bench.sweep import run_sweep

    cfg = config_from_args(build_parser().parse_args(argv), {})
    result = run_sweep(cfg, group=dist.group.WORLD, device=torch.device("cpu"))
    if rank:
        return None
    assert PREDICTED in report.format_table(result)
    return json.loads(report.final_line(result, report.write_outputs(result)))


@pytest.fixture(scope="module")
def first_bench(tmp_path_factory) -> dict:
    """One uncalibrated bench of a2a and a2a_ll (one launch for both tests below)."""
    return _bench(tmp_path_factory.mktemp("bench") / "a", "--backends", "a2a,a2a_ll")


@pytest.mark.distributed
def test_bench_writes_the_calibration_a_second_run_and_plan_use(first_bench, tmp_path, capsys):
    first = first_bench
    path = first["files"]["calibration"]
    cal = Calibration.load(path)
    assert cal.device.startswith("cpu") and cal.torch_version == torch.__version__
    assert cal.date[:2] == "20" and cal.date.endswith("+00:00")
    assert [(p.backend, p.tokens, p.decode, p.layers) for p in cal.points] == [
        ("a2a", 16, True, 2), ("a2a", 64, True, 2), ("a2a_ll", 16, True, 2),
        ("a2a_ll", 64, True, 2)]
    assert len(first["points"]) == len(cal.points)
    for p, row in zip(cal.points, first["points"]):
        assert (row["backend"], row["tokens_per_rank"]) == (p.backend, p.tokens)
        assert min(p.attention, p.experts, p.shared, p.dispatch, p.combine) > 0, p
        assert p.expert_weight_bytes > 0 and p.rows_per_expert == p.tokens * 2 * 2 / 8
        assert p.measured_ms["none"] == pytest.approx(row["t_nodbo_ms"], rel=1e-3)
        assert row["t_nodbo_pred_ms"] > 0 and row["t_dbo_pred_ms"] > 0
        assert row["pred_choice"] in ("none", "dbo", "sbo") and row["pred_err_dbo"] is not None
        assert len(row["trial_speedups"]) == 1  # no calibration: the gate's trial ran

    # a2a only, its points covered: the sweep of such a run (one set of ranks less).
    second = run_distributed(2, _sweep, [*BENCH_ARGS, "--out", str(tmp_path / "b"),
                                         "--calibration", path])[0]
    assert [row["backend"] for row in second["points"]] == ["a2a", "a2a"]
    for row in second["points"]:
        assert row["trial_speedups"] == [], row  # covered: no trial step
        assert row["gate_reason"].startswith("prediction: "), row
        assert (row["gate"] == "dbo") == row["gate_reason"].startswith("prediction: dbo:")

    from dbo import cli
    assert cli.main(["plan", "--calibration", path, "--sweep", "16,64"]) == 0
    out = capsys.readouterr().out
    assert f"calibration: {path} (written by dbo bench on cpu" in out
    assert "4 measured points" in json.loads(out.strip().splitlines()[-1])["calibration"]


@pytest.mark.distributed
def test_bench_records_each_modes_host_time_for_an_issue_only_backend(first_bench):
    # a2a_ll never waits on the device: its host times are issue times, the floors of
    # the no-overlap, DBO and SBO predictions (`dbo.cost_model`).
    points = Calibration.load(first_bench["files"]["calibration"]).points
    rows = [row for row in first_bench["points"] if row["backend"] == "a2a_ll"]
    point = next(p for p in points if p.backend == "a2a_ll" and p.tokens == 16)
    row = next(row for row in rows if row["tokens_per_rank"] == 16)
    assert point.host_ms == pytest.approx(row["host_nodbo_ms"], rel=1e-3)
    assert point.host_dbo_ms == pytest.approx(row["host_dbo_ms"], rel=1e-3)
    assert point.host_sbo_ms == pytest.approx(row["host_sbo_ms"], rel=1e-3)
    assert min(point.host_ms, point.host_dbo_ms, point.host_sbo_ms) > 0
