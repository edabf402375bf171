"""Layers 1-2: `dbo bench` on CPU. Argument errors, the gate, the derived figures and the
plot in-process (layer 1); the command line end to end on two gloo ranks it spawns
itself, model mode and the ceiling probe's recording / replay / local routing on two
gloo ranks (layer 2, marked distributed). The probe's two-stream timing is GPU only.
"""
from __future__ import annotations

import csv
import json
import os
from pathlib import Path

import pytest
import torch

from dbo.cli.bench import main
from dbo.cli.bench.config import (
    CPU_REGIME,
    EMULATED_REGIME,
    NVLINK_REGIME,
    BenchConfig,
    regime_label,
)
from dbo.cli.bench.gating import GatePolicy
from dbo.cli.bench.joined import JoinedRound, attach_joined
from dbo.cli.bench.launch import build_parser, config_from_args
from dbo.cli.bench.report import eta_rounds_cell
from dbo.cli.bench.ceiling import Ceiling
from dbo.cli.bench.point import (
    ETA_ABOVE_ONE,
    ETA_NO_HEADROOM,
    ETA_SMALL_HEADROOM,
    Round,
    add_rounds,
    efficiency,
    make_point,
)
from dbo.cli.bench.sweep import PROBE_SKIPPED_CPU, SweepResult
from dbo.cli.bench.timing import Timing, median_of_rounds
from tests.dist_utils import run_distributed

FINAL_KEYS = {"bench", "regime", "mode", "preset", "world_size", "device", "shapes", "probe",
              "summary", "points", "files"}
POINT_KEYS = {"backend", "tokens_per_rank", "t_nodbo_ms", "t_dbo_ms", "speedup",
              "tokens_per_s_nodbo", "tokens_per_s_dbo", "t_compute_ms", "t_comm_ms",
              "t_both_ms", "t_split_ms", "ceiling", "eta", "dbo_split", "gate",
              "gate_reason", "gated_speedup"}


# ----------------------------------------------------------------- layer 1: in-process
@pytest.mark.parametrize("argv, message", [
    (["--mode", "bogus"], "argument --mode: invalid choice: 'bogus'"),
    (["--backends", "a2a,deepep"], "unknown backend 'deepep'"),
    (["--preset", "gpt-5"], "argument --preset: invalid choice: 'gpt-5'"),
    (["--experts", "nope"], "argument --experts: invalid choice: 'nope'"),
    (["--tokens", "16,0"], "tokens must be positive ints, got 0"),
    (["--tokens", "-4"], "tokens must be positive ints, got -4"),
    (["--tokens", "16,abc"], "expected integers"),
    (["--num-experts", "8", "--experts-per-rank", "4"], "not allowed with argument"),
    (["--mode", "model", "--tokens", "2", "--requests", "4"], "requests=4 per rank exceeds"),
    (["--iters", "0"], "iters=0 must be an int >= 1"),
    (["--rounds", "0"], "rounds=0 must be an int >= 1"),
    (["--world-size", "0"], "--world-size=0"),
    (["--world-size", "3"], "8 routed experts do not split over 3 ranks"),
    (["--num-experts", "5"], "5 routed experts do not split over 2 ranks"),
    (["--out", "FILE"], "that is an existing file"),
    (["--backends", "a2a_ll,symm_mem,deepep_ll"],
     "--backends a2a_ll,symm_mem,deepep_ll: symm_mem cannot run in one process with "
     "deepep_ll"),
    pytest.param(["--device", "cuda"], "CUDA is not available",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="has CUDA")),
])
def test_bad_arguments_exit_with_the_fix(argv: list[str], message: str, tmp_path: Path,
                                         capsys: pytest.CaptureFixture,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    import dbo.cli.bench.launch

    def refuse(*args: object, **kwargs: object) -> int:
        raise AssertionError("ranks were started")

    monkeypatch.setattr(dbo.cli.bench.launch, "spawn_ranks", refuse)
    existing = tmp_path / "existing.txt"
    existing.write_text("not a folder")
    with pytest.raises(SystemExit) as exc:
        main(["--device", "cpu", *[str(existing) if a == "FILE" else a for a in argv]])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err
    assert err.count("\n") == 1 and err.startswith("dbo bench: "), err  # one line


def test_experts_must_split_over_ranks() -> None:
    cfg = BenchConfig(num_experts=9)
    with pytest.raises(ValueError, match="do not split over 2 ranks"):
        cfg.resolve_num_experts(2, 8)
    assert BenchConfig().resolve_num_experts(2, 256) == 64  # capped at 32 per rank
    assert BenchConfig(experts_per_rank=3).resolve_num_experts(2, 256) == 6


def test_regime_labels() -> None:
    assert regime_label("cuda", p2p_disabled=True) == EMULATED_REGIME
    assert EMULATED_REGIME == "scale-out emulated (NCCL_P2P_DISABLE=1)"
    assert regime_label("cuda", p2p_disabled=False) == NVLINK_REGIME
    # gloo does not use NCCL: CPU runs say so whatever NCCL_P2P_DISABLE says.
    args = build_parser().parse_args(["--device", "cpu"])
    assert config_from_args(args, {"NCCL_P2P_DISABLE": "1"}).regime == CPU_REGIME


def test_split_combine_switch_reaches_the_layers() -> None:
    from dbo.cli.bench.workload import WorkloadFactory

    for argv, split in (([], True), (["--no-split-combine"], False)):
        cfg = config_from_args(build_parser().parse_args(["--device", "cpu", *argv]), {})
        assert cfg.split_last_combine is split and cfg.summary()["split_last_combine"] is split
        factory = WorkloadFactory(cfg, group=None, device=torch.device("cpu"))
        stack = factory.get(tokens=8, backend="a2a", dbo=False).model
        assert [layer.last_layer for layer in stack.moe] == [False] * 3 + [True]
        assert all(layer.config.split_last_combine is split for layer in stack.moe)


def test_combine_chunks_reach_the_no_overlap_layers() -> None:
    from dbo.cli.bench.workload import WorkloadFactory

    argv = ["--device", "cpu", "--tokens", "8", "--backends", "a2a_ll", "--combine-chunks", "4"]
    cfg = config_from_args(build_parser().parse_args(argv), {})
    assert cfg.combine_chunks == 4 and cfg.summary()["combine_chunks"] == 4
    factory = WorkloadFactory(cfg, group=None, device=torch.device("cpu"))
    stack = factory.get(tokens=8, backend="a2a_ll", dbo=False).model
    assert all(layer.config.options.combine_chunks == 4 for layer in stack.moe)
    with pytest.raises(ValueError, match="combine_chunks=9 must be an int from 1 to the "
                                         "smallest point's 8 tokens"):
        config_from_args(build_parser().parse_args([*argv[:-1], "9"]), {})


def test_combine_groups_reach_the_no_overlap_layers() -> None:
    from dbo.cli.bench.workload import WorkloadFactory

    argv = ["--device", "cpu", "--tokens", "8", "--backends", "a2a_ll", "--combine-groups", "2"]
    cfg = config_from_args(build_parser().parse_args(argv), {})
    assert cfg.combine_groups == 2 and cfg.summary()["combine_groups"] == 2
    assert cfg.summary()["combine_chunks"] == 1
    assert cfg.sbo_form().startswith("a2a_ll: the experts in 2 expert groups over every row")
    factory = WorkloadFactory(cfg, group=None, device=torch.device("cpu"))
    stack = factory.get(tokens=8, backend="a2a_ll", dbo=False).model
    assert all(layer.config.options.combine_groups == 2 for layer in stack.moe)
    assert all(layer.config.options.combine_chunks == 1 for layer in stack.moe)
    # A backend whose options have no groups keeps its defaults.
    a2a = factory.get(tokens=8, backend="a2a", dbo=False).model
    assert all(layer.config.backend_options is None for layer in a2a.moe)
    with pytest.raises(ValueError, match=r"combine_chunks=2 and combine_groups=2: an SBO step "
                                         r"chunks its combine by rows or by expert group, not "
                                         r"both; drop --combine-chunks or --combine-groups"):
        config_from_args(build_parser().parse_args([*argv, "--combine-chunks", "2"]), {})
    with pytest.raises(ValueError, match="combine_groups=0 must be an int >= 1"):
        config_from_args(build_parser().parse_args([*argv[:-1], "0"]), {})
    with pytest.raises(ValueError, match="combine_groups=4 exceeds the 2 experts each rank "
                                         "holds"):
        config_from_args(build_parser().parse_args([*argv[:-1], "4", "--experts-per-rank",
                                                    "2"]), {})


def test_gate_thresholds_then_probe_then_trial() -> None:
    gate = GatePolicy(min_tokens_per_rank=512, min_gain=0.03)
    small = gate.decide(tokens_per_rank=256, ceiling=1.4, trial_speedups=[1.3])
    assert (small.choice, small.reason.startswith("threshold")) == ("off", True)
    low = gate.decide(tokens_per_rank=1024, ceiling=1.02, trial_speedups=[1.3])
    assert low.choice == "off" and "ceiling 1.020x < 1.030x" in low.reason
    # A GPU-side ceiling that a host-bound step cannot reach: the trial keeps DBO off.
    host_bound = gate.decide(tokens_per_rank=1024, ceiling=1.3, trial_speedups=[0.8])
    assert host_bound.choice == "off" and host_bound.reason.startswith("trial: DBO 0.800x <")
    high = gate.decide(tokens_per_rank=1024, ceiling=1.25, trial_speedups=[1.2])
    assert high.choice == "dbo" and "ceiling 1.250x" in high.reason
    assert "trial DBO 1.200x >=" in high.reason
    # One trial per round; the worst decides, whatever the order (a noisy host-bound point
    # whose first trial looked good stays off).
    for trials in ([1.07, 0.96, 1.05], [0.96, 1.07]):
        noisy = gate.decide(tokens_per_rank=1024, ceiling=1.6, trial_speedups=trials)
        assert noisy.choice == "off", noisy
        assert noisy.reason.startswith(f"trial: DBO 0.960x (worst of {len(trials)} trials)")
    steady = gate.decide(tokens_per_rank=4096, ceiling=1.5, trial_speedups=[1.31, 1.29, 1.33])
    assert steady.choice == "dbo" and "trial DBO 1.290x (worst of 3 trials) >=" in steady.reason
    blind = gate.decide(tokens_per_rank=1024, ceiling=None, no_probe_reason="probe skipped")
    assert blind.choice == "dbo" and "probe skipped" in blind.reason


def _timing(*ms: float) -> Timing:
    return Timing(tuple(ms))


class _FakeCeiling:
    """The probe's result as the sweep reads it (the probe itself needs CUDA)."""

    def __init__(self, compute: float, comm: float, both: float) -> None:
        self.compute, self.comm, self.both = _timing(compute, compute), _timing(comm, comm), \
            _timing(both * 0.99, both)
        self.serial_ms = compute + comm
        self.ceiling = self.serial_ms / both


def test_derived_figures_with_a_ceiling() -> None:
    cfg = BenchConfig()
    point = make_point(cfg, backend="a2a", tokens=1024, world_size=2,
                       t_off=_timing(10.0, 10.5), t_on=_timing(9.0, 9.1),
                       ceiling=_FakeCeiling(8.0, 3.0, 8.5), split=True, split_reason="halved",
                       use_dbo=True, gate_reason="probe: ...")
    assert point.t_nodbo_ms == 10.5 and point.t_nodbo_ms_rank0 == 10.0
    assert point.speedup == pytest.approx(10.5 / 9.1)
    assert point.tokens_per_s_nodbo == pytest.approx(2048 / 10.5e-3)
    assert point.t_serial_ms == 11.0 and point.ceiling == pytest.approx(11.0 / 8.5)
    assert point.eta == pytest.approx((10.5 - 9.1) / (10.5 - 8.5))
    assert point.t_both_ms_rank0 == pytest.approx(8.5 * 0.99)
    assert point.gated_speedup == point.speedup and point.gate == "dbo"
    off = make_point(cfg, backend="a2a", tokens=64, world_size=2, t_off=_timing(1.0, 1.0),
                     t_on=_timing(2.0, 2.0), ceiling=None, split=True, split_reason="",
                     use_dbo=False, gate_reason="threshold")
    assert off.gated_speedup == 1.0 and off.speedup == 0.5 and off.eta is None
    assert efficiency(5.0, 4.0, 5.0) == (None, ETA_NO_HEADROOM)
    # A headroom under 1% of T_noDBO is timing noise: no eta (NVLink once gave -181).
    assert efficiency(11.975, 15.227, 11.957) == (None, ETA_SMALL_HEADROOM)
    assert efficiency(10.0, 9.8, 9.7) == (pytest.approx(0.2 / 0.3), "")
    assert efficiency(10.0, 9.5, 9.91)[0] is None
    # DBO faster than the probe's both (4 ranks): eta kept, with a note.
    assert efficiency(83.4, 53.4, 58.8) == (pytest.approx(30.0 / 24.6), ETA_ABOVE_ONE)


def test_rounds_fold_to_per_rank_medians_and_keep_eta_spread() -> None:
    assert median_of_rounds([_timing(1.0, 9.0), _timing(3.0, 2.0), _timing(2.0, 4.0)]) == \
        _timing(2.0, 4.0)  # per rank, not per round: rank 1's median comes from round 3
    with pytest.raises(ValueError, match="disagree on the number of ranks"):
        median_of_rounds([_timing(1.0), _timing(1.0, 2.0)])

    def one(off: float, on: float, both: float) -> Round:
        ceiling = Ceiling(_timing(both - 1, both - 1), _timing(4.0, 4.0), _timing(both, both), 6)
        return Round(_timing(off, off), _timing(on, on), ceiling, True, "halved",
                     _timing(on - 0.5, on - 0.25))

    rounds = [one(20.0, 16.0, 15.0), one(21.0, 16.5, 16.0), one(30.0, 29.0, 16.0)]
    merged = Round.median(rounds)
    assert (merged.t_off.max_ms, merged.t_on.max_ms) == (21.0, 16.5)
    assert merged.t_split is not None and merged.t_split.per_rank_ms == (16.0, 16.25)
    assert merged.ceiling is not None and merged.ceiling.both.max_ms == 16.0
    assert merged.ceiling.compute.max_ms == 15.0 and merged.ceiling.num_collectives == 6
    point = make_point(BenchConfig(), backend="a2a", tokens=1024, world_size=2,
                       t_off=merged.t_off, t_on=merged.t_on, ceiling=merged.ceiling,
                       split=merged.split, split_reason=merged.split_reason, use_dbo=True,
                       gate_reason="", t_split=merged.t_split)
    add_rounds(point, rounds)
    assert (point.t_split_ms, point.t_split_ms_rank0) == (16.25, 16.0)
    assert point.rounds_ms["t_split"] == [15.75, 16.25, 28.75]
    assert point.per_rank_ms["t_split"] == [16.0, 16.25]
    assert point.eta == pytest.approx((21.0 - 16.5) / (21.0 - 16.0))
    assert point.eta_rounds == pytest.approx([0.8, 0.9, 1 / 14])
    assert (point.eta_min, point.eta_max) == (pytest.approx(1 / 14), pytest.approx(0.9))
    assert point.rounds == 3 and point.rounds_ms["t_dbo"] == [16.0, 16.5, 29.0]
    assert eta_rounds_cell(point) == "0.07..0.90"
    point.eta = None  # no headroom at the medians: the rounds' spread is not shown
    assert eta_rounds_cell(point) == "-"
    cpu = Round(_timing(2.0), _timing(1.0), None, True, "")
    assert Round.median([cpu, cpu]).ceiling is None and Round.median([cpu, cpu]).t_split is None


def test_table_says_why_eta_is_missing_or_above_one() -> None:
    from dbo.cli.bench.report import format_table

    cfg = BenchConfig(regime=EMULATED_REGIME, tokens=(1024, 4096), backends=("a2a",))
    shapes = {"hidden_size": 8, "num_experts": 4, "experts_per_rank": 2, "top_k": 2,
              "intermediate_size": 8, "layers": 2, "dtype": "float32"}
    # 1024: headroom 0.02 ms of 12 (noise); 4096: DBO below the probe's both.
    points = [make_point(cfg, backend="a2a", tokens=t, world_size=2, t_off=_timing(off, off),
                         t_on=_timing(on, on), ceiling=_FakeCeiling(c, m, b), split=True,
                         split_reason="", use_dbo=True, gate_reason="probe")
              for t, off, on, c, m, b in ((1024, 11.975, 15.227, 11.0, 0.65, 11.957),
                                          (4096, 83.4, 53.4, 41.0, 48.5, 58.8))]
    assert points[0].eta is None and points[0].eta_note == ETA_SMALL_HEADROOM
    assert points[1].eta == pytest.approx(30.0 / 24.6) and points[1].eta_note == ETA_ABOVE_ONE
    table = format_table(SweepResult(cfg, 2, shapes, "measured", points))
    decisions = table.split("gate decisions:")[1].splitlines()
    assert f"(eta n/a: {ETA_SMALL_HEADROOM})" in decisions[1]
    assert f"({ETA_ABOVE_ONE})" in decisions[2] and " 1.22 " in table


def test_cpu_run_is_reported_as_functional_without_a_speedup(tmp_path: Path) -> None:
    from dbo.cli.bench.plot import plot_sweep
    from dbo.cli.bench.report import FUNCTIONAL_NOTE, final_line, format_table, write_outputs

    cfg = BenchConfig(tokens=(16, 64), backends=("a2a",), out_dir=str(tmp_path))
    assert cfg.functional and not BenchConfig(regime=EMULATED_REGIME).functional
    shapes = {"hidden_size": 8, "num_experts": 4, "experts_per_rank": 2, "top_k": 2,
              "intermediate_size": 8, "layers": 2, "dtype": "float32"}
    # DBO "faster" on CPU: noise, not a speedup, and reported as neither.
    points = [make_point(cfg, backend="a2a", tokens=t, world_size=2, t_off=_timing(3.0, 3.0),
                         t_on=_timing(1.5, 1.5), ceiling=None, split=True, split_reason="",
                         use_dbo=True, gate_reason="trial")
              for t in cfg.tokens]
    result = SweepResult(cfg, 2, shapes, PROBE_SKIPPED_CPU, points)
    table = format_table(result)
    assert FUNCTIONAL_NOTE in table and "speedup" not in table.replace(FUNCTIONAL_NOTE, "")
    assert "2.000" not in table  # the ratio appears nowhere
    assert "summary: functional run, 2 points ran (DBO split the step at 2)" in table
    files = write_outputs(result)
    assert files["png"] is None and files["png_note"].startswith("not drawn: functional run")
    doc = json.loads(Path(files["json"]).read_text())
    final = json.loads(final_line(result, files))
    for out in (doc, final):
        assert out["timings"] == "functional" and out["note"] == FUNCTIONAL_NOTE
        assert out["summary"] == {"functional": True, "points": 2, "points_split": 2,
                                  "points_gated_on": 2, "points_gated_sbo": 0,
                                  "points_gated_joined": 0}
        assert all(p["speedup"] is None and p["gated_speedup"] is None for p in out["points"])
    with open(files["csv"]) as f:
        assert {r["speedup"] for r in csv.DictReader(f)} == {""}
    with pytest.raises(ValueError, match="functional check"):
        plot_sweep(result, str(tmp_path / "x.png"))


def test_time_steps_span_covers_the_timed_steps_only() -> None:
    import contextlib

    from dbo.cli.bench.timing import time_steps

    events: list[str] = []

    @contextlib.contextmanager
    def span():
        events.append("enter")
        yield
        events.append("exit")

    timing = time_steps(lambda: events.append("step"), device=torch.device("cpu"), group=None,
                        warmup=2, iters=3, span=span())
    assert events == ["step", "step", "enter", "step", "step", "step", "exit"]
    assert len(timing.per_rank_ms) == 1


def test_points_report_the_clock_of_each_timing() -> None:
    from dbo.cli.bench.report import format_table
    from dbo.cli.bench.sweep import CLOCKED, attach_clocks

    class Log:  # ClockLog's read side: summaries by (backend, tokens, timing)
        def summary(self, key: tuple) -> dict | None:
            backend, tokens, name = key
            if tokens != 4096 or name == "comm":
                return None  # no samples fell inside
            return {"sm_mhz": 1400 + 10 * list(CLOCKED).index(name), "capped": "2/3"}

    cfg = BenchConfig(regime=EMULATED_REGIME, tokens=(1024, 4096), backends=("a2a",))
    points = [make_point(cfg, backend="a2a", tokens=t, world_size=2, t_off=_timing(3.0, 3.0),
                         t_on=_timing(1.5, 1.5), ceiling=_FakeCeiling(1.2, 0.6, 1.4),
                         split=True, split_reason="", use_dbo=True, gate_reason="probe")
              for t in (1024, 4096)]
    for point in points:
        attach_clocks(point, Log())  # type: ignore[arg-type]
    assert points[0].sm_mhz == {} and points[0].capped == {}
    assert points[1].sm_mhz == {"nodbo": 1400.0, "dbo": 1410.0, "split": 1420.0,
                                "compute": 1430.0, "both": 1450.0, "sbo": 1460.0,
                                "joined": 1470.0}
    assert points[1].capped["both"] == "2/3" and "sm_mhz" not in points[1].row()
    shapes = {"hidden_size": 8, "num_experts": 4, "experts_per_rank": 2, "top_k": 2,
              "intermediate_size": 8, "layers": 2, "dtype": "float32"}
    table = format_table(SweepResult(cfg, 2, shapes, "measured", points))
    clock_lines = table.split("SM clock, rank 0")[1].splitlines()[1:]
    assert clock_lines[0].split() == ["a2a", "T=4096", "no", "DBO", "1400", "(2/3),", "DBO",
                                      "1410", "(2/3),", "split", "1420", "(2/3),", "compute",
                                      "1430", "(2/3),", "both", "1450", "(2/3),", "SBO",
                                      "1460", "(2/3),", "joined", "1470", "(2/3)"]
    assert "T=1024" not in table.split("SM clock, rank 0")[1]


def test_plot_draws_the_ceiling(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from dbo.cli.bench.plot import plot_sweep

    cfg = BenchConfig(regime=EMULATED_REGIME, tokens=(256, 1024), backends=("a2a", "naive"))
    points = [make_point(cfg, backend=b, tokens=t, world_size=2, t_off=_timing(t / 100, t / 100),
                         t_on=_timing(t / 120, t / 120),
                         ceiling=_FakeCeiling(t / 150, t / 300, t / 140), split=True,
                         split_reason="", use_dbo=True, gate_reason="")
              for b in cfg.backends for t in cfg.tokens]
    for point in points[:2]:  # a2a's points also draw a joined line
        attach_joined(point, [JoinedRound(_timing(1.0, 1.1), None, True, "")], note="")
    result = SweepResult(cfg, 2, {}, "measured", points)
    path = tmp_path / "sweep.png"
    plot_sweep(result, str(path))
    assert path.stat().st_size > 10_000


# --------------------------------------------------------- layer 2: two gloo processes
@pytest.mark.distributed
def test_cli_layer_mode_end_to_end(tmp_path: Path, capfd: pytest.CaptureFixture,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    # main() in this process (the ranks it spawns import torch, this process has; python -m
    # dbo.cli.bench: tests/tools/test_cli.py): capfd also sees the ranks' stderr.
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "NCCL_P2P_DISABLE"):
        monkeypatch.delenv(name, raising=False)  # not under torchrun: it spawns its ranks
    code = main(["--device", "cpu", "--mode", "layer", "--tokens", "16,64", "--backends",
                 "a2a,naive", "--iters", "2", "--warmup", "1", "--layers", "2",
                 "--gate-min-tokens", "32", "--rounds", "2", "--overlaps", "dbo,sbo,joined",
                 "--out", str(tmp_path)])
    stdout, stderr = capfd.readouterr()
    assert code == 0, stderr[-3000:]
    lines = stdout.strip().splitlines()
    final = json.loads(lines[-1])
    assert FINAL_KEYS <= set(final)
    assert final["regime"] == CPU_REGIME and final["world_size"] == 2
    assert final["probe"] == PROBE_SKIPPED_CPU
    assert "[dbo bench]" in stderr  # the progress bar
    table = "\n".join(lines[:-1])
    assert "regime=CPU gloo" in table and "ceiling probe: skipped on CPU" in table
    assert "gate decisions:" in table and "median of 2 alternating rounds" in table
    points = final["points"]
    assert len(points) == 4
    assert {(p["backend"], p["tokens_per_rank"]) for p in points} == {
        (b, t) for b in ("a2a", "naive") for t in (16, 64)}
    for p in points:
        assert POINT_KEYS <= set(p)
        assert p["t_nodbo_ms"] > 0 and p["t_dbo_ms"] > 0 and p["dbo_split"] is True
        assert p["t_both_ms"] is None and p["ceiling"] is None and p["eta"] is None
        assert p["t_split_ms"] is None  # GPU only, like the probe
        assert p["rounds"] == 2 and p["eta_min"] is None
        trials = p["trial_speedups"]  # one per round, each against its round's DBO-off time
        assert len(trials) == 2 and all(t > 0 for t in trials), p
        worst = f"{min(trials):.3f}x (worst of 2 trials)"
        dbo_reason = p["gate_reason"].split("DBO: ", 1)[1]  # after SBO's (`GatePolicy.choose`)
        if p["tokens_per_rank"] < 32:
            assert p["gate"] != "dbo" and dbo_reason.startswith("threshold")
        elif min(trials) < 1.01:  # a separate trial saw DBO lose (usual with gloo)
            assert p["gate"] != "dbo" and dbo_reason.startswith(f"trial: DBO {worst}")
        else:
            assert f"trial DBO {worst}" in dbo_reason
        # SBO: timed every round with its own trial; only its trials gate it.
        sbo_trials = p["sbo_trial_speedups"]
        assert len(sbo_trials) == 2 and p["t_sbo_ms"] > 0 and p["host_sbo_ms"] > 0
        assert p["speedup_sbo"] is None and p["sbo_note"] == ""  # functional: no speedup
        assert f"trial SBO {min(sbo_trials):.3f}x (worst of 2 trials)" in p["gate_reason"]
        # Joined experts: timed every round with its own trial, split as DBO, gated by the
        # split rules (the threshold here) and then its own worst trial.
        joined = p["joined_trial_speedups"]
        assert len(joined) == 2 and p["t_joined_ms"] > 0 and p["host_joined_ms"] > 0
        assert p["speedup_joined"] is None and p["joined_note"] == "" and p["joined_split"]
        joined_reason = p["gate_reason"].split("; joined: ", 1)[1]
        if p["tokens_per_rank"] < 32:
            assert joined_reason.startswith("threshold: 16 tokens/rank < 32"), p
        else:
            assert f"joined {min(joined):.3f}x (worst of 2 trials)" in joined_reason, p
        # The gate: of the modes that pass, the fastest worst trial; SBO, joined, DBO on
        # a tie.
        split_ok = p["tokens_per_rank"] >= 32
        passing = {mode: min(t) for mode, t, ok in (
            ("sbo", sbo_trials, True), ("joined", joined, split_ok), ("dbo", trials, split_ok))
            if ok and min(t) >= 1.01}
        expected = max(passing, key=lambda m: passing[m]) if passing else "off"
        assert p["gate"] == expected, p
    summary = final["summary"]
    assert summary["points"] == 4 and summary["functional"] is True
    assert summary["points_gated_on"] == sum(p["gate"] == "dbo" for p in points)
    assert summary["points_gated_sbo"] == sum(p["gate"] == "sbo" for p in points)
    assert summary["points_gated_joined"] == sum(p["gate"] == "joined" for p in points)
    columns = next(line for line in table.splitlines() if "T/rank" in line)
    assert " SBO ms" in columns and "SBO x" not in columns  # functional: no ratio column
    assert " joined ms" in columns and "joined x" not in columns
    assert final["timings"] == "functional" and "summary: functional run" in table
    assert all(p["speedup"] is None for p in points)

    files = final["files"]
    for kind in ("csv", "json"):
        assert Path(files[kind]).stat().st_size > 0, kind
    assert files["png"] is None  # a functional run is not plotted
    with open(files["csv"]) as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 4 and {r["regime"] for r in rows} == {CPU_REGIME}
    doc = json.loads(Path(files["json"]).read_text())
    assert doc["regime"] == CPU_REGIME and "eta" in doc["definitions"]
    assert all(len(p["per_rank_ms"]["t_dbo"]) == 2 for p in doc["points"])
    assert all(len(p["per_rank_ms"]["t_sbo"]) == 2 and len(p["rounds_ms"]["t_sbo"]) == 2
               for p in doc["points"])
    assert all(len(p["per_rank_ms"]["t_joined"]) == 2 and len(p["rounds_ms"]["t_joined"]) == 2
               and len(p["joined_trial_speedups"]) == 2 for p in doc["points"])
    assert {"t_sbo_ms", "speedup_sbo", "best_overlap", "best_speedup", "t_joined_ms",
            "t_joined_ms_rank0", "speedup_joined", "host_joined_ms", "joined_note"
            } <= set(rows[0])
    assert "speedup_joined" in doc["definitions"] and "joined_note" in doc["definitions"]
    assert all(len(p["rounds_ms"]["t_nodbo"]) == 2 and p["eta_rounds"] == []
               for p in doc["points"])


def _model_mode_and_probe_pieces(rank: int, world_size: int, out_dir: str) -> dict:
    import torch.distributed as dist

    from dbo.cli.bench.ceiling import (CommReplay, probe_split_compute, record_collectives,
                                   replayed_results)
    from dbo.cli.bench.report import final_line, write_outputs
    from dbo.cli.bench.sweep import run_sweep
    from dbo.cli.bench.workload import WorkloadFactory

    group, cpu = dist.group.WORLD, torch.device("cpu")
    out: dict = {}
    # Model mode, two token counts x two backends (a2a_ll capacity set automatically).
    # Two rounds: a2a_ll's DBO-off and DBO-on models differ, so each round rebuilds them.
    cfg = BenchConfig(mode="model", preset="tiny", tokens=(12, 40), backends=("a2a", "a2a_ll"),
                      iters=1, warmup=1, rounds=2, gate_min_tokens=20, out_dir=out_dir,
                      progress=False)
    result = run_sweep(cfg, group=group, device=cpu)
    if rank == 0:
        files = write_outputs(result)
        out["final"] = json.loads(final_line(result, files))
        out["sizes"] = {k: os.path.getsize(files[k]) for k in ("csv", "json")}

    # The probe's pieces on gloo: recording, replay, replayed results (compute alone).
    factory = WorkloadFactory(BenchConfig(layers=2), group=group, device=cpu)
    off = factory.get(tokens=10, backend="a2a", dbo=False)
    expected = off.step()
    with record_collectives(off.model) as recording:
        off.step()
    out["segments"] = [[op.name for op in seg] for seg in recording.segments]
    CommReplay(recording).run_all()  # every rank replays the same sequence
    with replayed_results(recording):
        # No communication happens here (the other rank does not take part), yet the
        # step computes exactly what the real one did, from the recorded results.
        replayed_out = off.step() if rank == 0 else expected
    out["replayed_equal"] = torch.equal(replayed_out, expected)
    out["after_ok"] = torch.equal(off.step(), expected)  # the real collectives are back

    # The same for a DBO step (split compute): its ubatches issue the collectives in the
    # same order every step, so a replay matches call by call.
    on = factory.get(tokens=10, backend="a2a", dbo=True)
    expected_on = on.step()
    with record_collectives(on.model) as recording:
        on.step()
    out["dbo_collectives"] = sorted(op.name for seg in recording.segments for op in seg)
    with replayed_results(recording):
        replayed_on = on.step() if rank == 0 else expected_on
    out["dbo_replayed_equal"] = torch.equal(replayed_on, expected_on) and on.was_split
    split = probe_split_compute(on, device=cpu, group=group, warmup=1, iters=2)
    out["split_ms"] = list(split.per_rank_ms)
    out["dbo_after_ok"] = torch.equal(on.step(), expected_on)
    return out


@pytest.mark.distributed
def test_model_mode_and_probe_pieces_on_gloo(tmp_path: Path) -> None:
    results = run_distributed(2, _model_mode_and_probe_pieces, str(tmp_path))
    final = results[0]["final"]
    assert final["mode"] == "model" and final["regime"] == CPU_REGIME
    assert final["probe"] == PROBE_SKIPPED_CPU
    assert {(p["backend"], p["tokens_per_rank"]) for p in final["points"]} == {
        (b, t) for b in ("a2a", "a2a_ll") for t in (12, 40)}
    for p in final["points"]:
        assert p["dbo_split"] is True and p["rounds"] == 2, p
        reason = p["gate_reason"]  # SBO's verdict, then DBO's (`GatePolicy.choose`)
        if p["tokens_per_rank"] < 20:
            assert p["gate"] != "dbo" and "DBO: threshold" in reason, p
        else:  # decided by the separate trials (DBO usually loses with gloo)
            dbo_lost = "DBO: trial: DBO" in reason
            assert dbo_lost or "trial DBO" in reason, p
            assert not (dbo_lost and p["gate"] == "dbo"), p
        sbo_passed = "(no split: thresholds and probe do not apply)" in reason
        assert p["gate"] != "sbo" or sbo_passed, p
        assert p["gate"] != "off" or not sbo_passed, p
    assert all(size > 0 for size in results[0]["sizes"].values())
    for r in results:
        # Segment 0 precedes the first MoE layer; each layer: count exchange, data, combine.
        assert r["segments"] == [[]] + [["all_to_all_single"] * 3] * 2
        assert r["replayed_equal"] and r["after_ok"]
        # The runner's vote, then two ubatches x 2 layers x (count exchange, data, combine).
        assert r["dbo_collectives"] == ["all_reduce"] + ["all_to_all_single"] * 12
        assert r["dbo_replayed_equal"] and r["dbo_after_ok"]
        assert len(r["split_ms"]) == 2 and all(t > 0 for t in r["split_ms"])


def test_a_sweep_without_backends_leaves_out_the_opt_in_ones() -> None:
    """symm_mem needs NVSHMEM: swept only when named (`OPT_IN_BACKENDS`)."""
    from dbo.cli.bench.config import BENCH_BACKENDS, GRAPH_BACKENDS, OPT_IN_BACKENDS

    assert "symm_mem" in OPT_IN_BACKENDS and "symm_mem" in BENCH_BACKENDS
    plain = config_from_args(build_parser().parse_args(["--device", "cpu"]), {})
    assert "a2a" in plain.backends and "symm_mem" not in plain.backends
    assert "symm_mem" in GRAPH_BACKENDS
    named = config_from_args(build_parser().parse_args(["--device", "cpu", "--backends",
                                                        "symm_mem"]), {})
    assert named.backends == ("symm_mem",)
