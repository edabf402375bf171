"""Layer 1 (CPU, one process, no model): the gate of `dbo bench --hf` prefill points
(`dbo.cli.bench.hf_gate`). Points are made from synthetic `Timing`s as the sweep makes
them (`hf_sweep._point`, `hf_sweep.attach_sbo`), on a GPU regime, so each rule is
checked on chosen numbers: the token threshold, the probe's ceiling, the worst trial,
SBO on its trials alone, DBO with joined experts on the split rules and its own trials,
and the gated time, table and summary that follow. The
end-to-end run on two gloo ranks (test_bench_hf.py) checks the same fields as the
sweep fills them.
"""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional

import pytest

from dbo.cli.bench import hf_report, hf_sweep
from dbo.cli.bench.config import NVLINK_REGIME
from dbo.cli.bench.gating import GateChoice
from dbo.cli.bench.hf_config import Conversion, HFBenchConfig
from dbo.cli.bench.hf_gate import attach_gate, prefill_gate
from dbo.cli.bench.hf_joined import attach_joined
from dbo.cli.bench.hf_probe import NO_PROBE_ON_CPU, HFProbe
from dbo.cli.bench.timing import Timing
from tests.tools.test_bench_hf_host import SHAPES

# DBO off, SBO, DBO on and joined (ms, the slowest rank's): all faster than DBO off.
OFF_MS, SBO_MS, DBO_MS, JOINED_MS = 16.0, 14.0, 12.0, 11.0


def _timing(max_ms: float) -> Timing:
    """Two ranks, rank 1 the slowest."""
    return Timing((max_ms - 0.5, max_ms), (1.0, 1.0))


def _cfg(**gate: float) -> HFBenchConfig:
    return HFBenchConfig(arch="qwen3-30b-a3b", tokens=(4096,), device="cuda",
                         regime=NVLINK_REGIME, rounds=2, **gate)  # type: ignore[arg-type]


def _point(cfg: HFBenchConfig, *, sbo_note: str = "") -> hf_sweep.HFPoint:
    """A 4096-token point of two rounds, with an SBO time unless `sbo_note` says why not."""
    point = hf_sweep._point(cfg, backend="a2a_ll", tokens=4096, world=2,
                            conversion=Conversion(max_tokens_per_rank=4096, points=(4096,)),
                            unconverted=None, hf=_timing(20.0), offs=[_timing(OFF_MS)] * 2,
                            ons=[_timing(DBO_MS)] * 2, split=True, reason="",
                            diffs=[0.0, 0.0], probe=HFProbe(None, None, ""))
    hf_sweep.attach_sbo(point, [] if sbo_note else [_timing(SBO_MS)] * 2, note=sbo_note,
                        diff=None if sbo_note else 0.0, perf=True, total_tokens=8192)
    return point


def _gate(cfg: HFBenchConfig, point: hf_sweep.HFPoint, *, ceiling: Optional[float],
          dbo: list[float], sbo: list[float]) -> GateChoice:
    return attach_gate(point, prefill_gate(cfg), ceiling=ceiling,
                       no_probe_reason=NO_PROBE_ON_CPU, dbo_trials=dbo, sbo_trials=sbo,
                       perf=not cfg.functional)


def _check_gated_time(point: hf_sweep.HFPoint) -> None:
    """The gated time is the reported time of the chosen mode, never a trial's."""
    expected = {"off": OFF_MS, "sbo": SBO_MS, "dbo": DBO_MS, "joined": JOINED_MS}[point.gate]
    assert point.t_gated_ms == expected, point
    assert point.gated_speedup == pytest.approx(OFF_MS / expected, rel=1e-12)


@pytest.mark.parametrize("gate, ceiling, dbo, rule", [
    # A threshold above the point keeps DBO off, however fast its trials.
    (dict(gate_min_tokens=8192), 1.40, [1.5, 1.4], "DBO: threshold: 4096 tokens/rank < 8192"),
    (dict(), 1.01, [1.5, 1.4], "DBO: probe: measured ceiling 1.010x < 1.030x (1 + min_gain)"),
    (dict(min_gain=0.5), 1.40, [1.5, 1.4], "DBO: probe: measured ceiling 1.400x < 1.500x"),
    # The worst trial decides, not the better one.
    (dict(), 1.40, [1.5, 1.0], "DBO: trial: DBO 1.000x (worst of 2 trials) < 1.010x"),
])
def test_each_dbo_rule_keeps_dbo_off_and_the_reason_names_it(
        gate: dict, ceiling: float, dbo: list[float], rule: str) -> None:
    cfg = _cfg(**gate)
    point = _point(cfg)
    choice = _gate(cfg, point, ceiling=ceiling, dbo=dbo, sbo=[0.9, 1.2])  # SBO fails too
    assert (choice.mode, point.gate) == ("off", "off")
    assert rule in point.gate_reason, point.gate_reason
    assert point.gate_reason.startswith("SBO: trial SBO 0.900x (worst of 2 trials) < 1.010x")
    _check_gated_time(point)
    assert (point.trial_speedups, point.sbo_trial_speedups) == (dbo, [0.9, 1.2])


def test_dbo_passing_every_rule_is_gated_on_with_each_rule_said() -> None:
    cfg = _cfg()
    point = _point(cfg)
    _gate(cfg, point, ceiling=1.4, dbo=[1.3, 1.2], sbo=[1.0, 1.1])
    assert point.gate == "dbo"
    assert point.gate_reason == (
        "SBO: trial SBO 1.000x (worst of 2 trials) < 1.010x in a separate short run: "
        "reordering the step (shared experts under the dispatch, expert work under the "
        "combine) hides less than it costs; DBO: 4096 tokens/rank >= 512; measured ceiling "
        "1.400x >= 1.030x; trial DBO 1.200x (worst of 2 trials) >= 1.010x")
    _check_gated_time(point)


def test_without_a_probe_the_ceiling_rule_is_skipped_and_said() -> None:
    cfg = _cfg()
    point = _point(cfg)
    _gate(cfg, point, ceiling=None, dbo=[1.3, 1.2], sbo=[])
    assert point.gate == "dbo" and f"; {NO_PROBE_ON_CPU}; trial DBO 1.200x" in point.gate_reason
    _check_gated_time(point)


@pytest.mark.parametrize("dbo, sbo, mode", [
    ([1.0, 1.3], [1.05, 1.1], "sbo"),   # DBO's worst trial fails: SBO alone passes
    ([1.2, 1.3], [1.05, 1.1], "dbo"),   # both pass: DBO's worst trial is faster
    ([1.05, 1.3], [1.1, 1.2], "sbo"),   # both pass: SBO's worst trial is faster
])
def test_sbo_is_chosen_on_its_own_trials_as_the_layer_bench_chooses(
        dbo: list[float], sbo: list[float], mode: str) -> None:
    cfg = _cfg()
    point = _point(cfg)
    _gate(cfg, point, ceiling=1.4, dbo=dbo, sbo=sbo)
    assert point.gate == mode, point.gate_reason
    _check_gated_time(point)


def test_sbo_below_the_token_threshold_still_passes_on_its_trials() -> None:
    """SBO splits nothing: the threshold made for the split does not gate it."""
    cfg = _cfg(gate_min_tokens=8192)
    point = _point(cfg)
    _gate(cfg, point, ceiling=1.4, dbo=[1.5, 1.4], sbo=[1.05, 1.1])
    assert point.gate == "sbo" and "DBO: threshold: 4096 tokens/rank < 8192" in point.gate_reason
    _check_gated_time(point)


def test_a_point_without_an_sbo_step_never_gates_to_sbo() -> None:
    cfg = _cfg()
    point = _point(cfg, sbo_note="not offered: a blocker")
    _gate(cfg, point, ceiling=1.4, dbo=[1.0], sbo=[])
    assert point.gate == "off" and point.gate_reason.startswith("SBO: not offered: a blocker;")
    assert point.t_sbo_ms is None
    _check_gated_time(point)


def test_a_functional_run_gates_but_reports_no_gated_speedup() -> None:
    cfg = HFBenchConfig(arch="qwen3_moe", tokens=(16,), rounds=1, gate_min_tokens=0)
    point = _point(cfg)
    _gate(cfg, point, ceiling=None, dbo=[1.2], sbo=[])
    assert point.gate == "dbo" and point.t_gated_ms == DBO_MS
    assert point.gated_speedup is None


def _with_joined(point: hf_sweep.HFPoint) -> hf_sweep.HFPoint:
    """`point` with a joined step of two rounds, split as the sweep's runner splits it."""
    runner: Any = SimpleNamespace(last_decision=SimpleNamespace(split=True, reason="split"))
    attach_joined(point, [_timing(JOINED_MS)] * 2, diff=0.0, runner=runner, perf=True,
                  total_tokens=8192)
    return point


@pytest.mark.parametrize("gate, ceiling, sbo, joined, mode, why", [
    # Its worst trial is the fastest and it passes: joined, over DBO (1.2x) and SBO (1.1x).
    (dict(), 1.4, [1.1, 1.2], [1.4, 1.3], "joined",
     "all 3 pass, joined's worst trial 1.300x > SBO's 1.100x, > DBO's 1.200x"),
    # The split rules come first, as for DBO: below the threshold or a low ceiling, SBO.
    (dict(gate_min_tokens=8192), 1.4, [1.1, 1.2], [1.4, 1.3], "sbo",
     "joined: threshold: 4096 tokens/rank < 8192"),
    (dict(), 1.01, [1.1, 1.2], [1.4, 1.3], "sbo",
     "joined: probe: measured ceiling 1.010x < 1.030x"),
    # Its worst trial fails: DBO's (1.2x) beats SBO's (1.1x).
    (dict(), 1.4, [1.1, 1.2], [1.4, 1.0], "dbo",
     "joined: trial: joined 1.000x (worst of 2 trials)"),
    # A tie with DBO goes to joined (it splits the experts less).
    (dict(), 1.4, [0.9], [1.2, 1.3], "joined",
     "both pass, joined's worst trial 1.200x >= DBO's 1.200x"),
])
def test_joined_is_gated_on_the_split_rules_and_its_own_trials(
        gate: dict, ceiling: float, sbo: list[float], joined: list[float], mode: str,
        why: str) -> None:
    cfg = _cfg(**gate)
    point = _with_joined(_point(cfg))
    choice = _gate_joined(cfg, point, ceiling=ceiling, dbo=[1.2, 1.3], sbo=sbo,
                          joined=joined)
    assert (choice.mode, point.gate) == (mode, mode), point.gate_reason
    assert why in point.gate_reason, point.gate_reason
    assert point.joined_trial_speedups == joined
    _check_gated_time(point)


def _gate_joined(cfg: HFBenchConfig, point: hf_sweep.HFPoint, *, ceiling: Optional[float],
                 dbo: list[float], sbo: list[float], joined: list[float]) -> GateChoice:
    return attach_gate(point, prefill_gate(cfg), ceiling=ceiling,
                       no_probe_reason=NO_PROBE_ON_CPU, dbo_trials=dbo, sbo_trials=sbo,
                       joined_trials=joined, perf=not cfg.functional)


def test_table_rows_and_summary_carry_the_gate(tmp_path: Path) -> None:
    cfg = HFBenchConfig(arch="qwen3-30b-a3b", tokens=(4096,), device="cuda",
                        regime=NVLINK_REGIME, rounds=2, out_dir=str(tmp_path))
    on, sbo, off = _point(cfg), _point(cfg), _point(cfg)
    _gate(cfg, on, ceiling=1.4, dbo=[1.3, 1.2], sbo=[])
    _gate(cfg, sbo, ceiling=1.4, dbo=[1.0, 1.3], sbo=[1.1, 1.2])
    _gate(cfg, off, ceiling=1.01, dbo=[1.3, 1.2], sbo=[0.9, 1.0])
    result = hf_sweep.HFSweepResult(cfg, 2, SHAPES, [on, sbo, off])
    lines = hf_report.format_table(result).splitlines()
    header = next(line for line in lines if "T/rank" in line)
    assert "SBO speedup  joined speedup    gate   gated  DBO/unconv" in header
    rows = [line.split() for line in lines if line.split()[:2] == ["4096", "a2a_ll"]]
    assert [row[13:15] for row in rows] == [
        ["dbo", f"{OFF_MS / DBO_MS:.3f}"], ["sbo", f"{OFF_MS / SBO_MS:.3f}"],
        ["off", "1.000"]], rows
    start = lines.index("gate decisions:")
    assert [line.split(":")[0] for line in lines[start + 1:start + 4]] == [
        "   a2a_ll T=4096      dbo", "   a2a_ll T=4096      sbo", "   a2a_ll T=4096      off"]
    assert lines[start + 4] == (f"summary: speedup {OFF_MS / DBO_MS:.3f}-{OFF_MS / DBO_MS:.3f}x; "
                                f"worst gated speedup 1.000x; gated never >1% slower: True  "
                                f"[{NVLINK_REGIME}]")
    final = json.loads(hf_report.final_line(result, hf_report.write_outputs(result)))
    summary = final["summary"]
    assert (summary["points_gated_on"], summary["points_gated_sbo"]) == (1, 1)
    assert summary["min_gated_speedup"] == 1.0 and summary["gated_never_slower_than_1pct"]
    point = final["points"][1]
    assert (point["gate"], point["t_gated_ms"], point["trial_speedups"],
            point["sbo_trial_speedups"]) == ("sbo", SBO_MS, [1.0, 1.3], [1.1, 1.2])
    assert point["gate_reason"] == sbo.gate_reason
    doc = json.loads(Path(final["files"]["json"]).read_text())
    assert doc["points"][0]["trial_speedups"] == [1.3, 1.2]
    assert "gate" in doc["definitions"] and "gated" in doc["definitions"]
    assert doc["config"]["gate_min_tokens"] == 512 and doc["config"]["min_gain"] == 0.03
    csv_header = Path(final["files"]["csv"]).read_text().splitlines()[0].split(",")
    assert {"gate", "gate_reason", "t_gated_ms", "gated_speedup"} <= set(csv_header)
    assert "trial_speedups" not in csv_header  # lists: the JSON's only


def test_a_slower_gated_point_fails_the_one_percent_check() -> None:
    """A gate that chose DBO where the reported DBO step came out slower (its trials were
    faster than its rounds): the summary says the gated time is >1% slower."""
    cfg = _cfg()
    point = hf_sweep._point(cfg, backend="a2a", tokens=4096, world=2,
                            conversion=Conversion(max_tokens_per_rank=None, points=(4096,)),
                            unconverted=None, hf=_timing(20.0), offs=[_timing(16.0)],
                            ons=[_timing(16.5)], split=True, reason="", diffs=[0.0, 0.0],
                            probe=HFProbe(None, None, ""))
    hf_sweep.attach_sbo(point, [], note="not offered: x", diff=None, perf=True,
                        total_tokens=8192)
    _gate(cfg, point, ceiling=1.4, dbo=[1.1], sbo=[])
    summary = hf_report.summarize(hf_sweep.HFSweepResult(cfg, 2, SHAPES, [point]))
    assert point.gate == "dbo" and summary["min_gated_speedup"] == 16.0 / 16.5
    assert summary["gated_never_slower_than_1pct"] is False
    assert summary["min_gated_speedup_at"] == {"backend": "a2a", "tokens_per_rank": 4096}
