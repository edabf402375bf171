"""Layer 1 (CPU, one process, no model): the host issue times of `dbo bench --hf` (prefill
and `--mode decode`) and the host-bound rule. Points are made from synthetic `Timing`s as
the sweeps make them (`hf_sweep._point`, `hf_decode._point`), on a GPU regime, so the
rule is tested on chosen numbers rather than on this machine's timing. The end-to-end
runs in test_bench_hf.py and test_bench_hf_decode.py check the same fields on two gloo
ranks.
"""
from __future__ import annotations

import pytest

from dbo.cli.bench import hf_decode, hf_decode_report, hf_report, hf_sweep
from dbo.cli.bench.config import NVLINK_REGIME
from dbo.cli.bench.gating import GatePolicy
from dbo.cli.bench.hf_config import Conversion, HFBenchConfig, HFDecodeOptions
from dbo.cli.bench.hf_gate import attach_gate, prefill_gate
from dbo.cli.bench.hf_probe import HFProbe
from dbo.cli.bench.timing import HOST_BOUND_SHARE, Timing, host_bound

SHAPES = {"model_type": "qwen3_moe", "hidden_size": 2048, "num_experts": 128,
          "experts_per_rank": 64, "top_k": 8, "intermediate_size": 768, "layers": 4,
          "dtype": "bfloat16", "hf_experts_implementation": "grouped_mm",
          "kv_cache_layer": "DynamicLayer", "kv_cache_bytes_per_rank": 1e9, "max_requests": 64}
HOST_BOUND_LINE = ("the DBO step is host-bound (issued in 24.8 of 24.8 ms; DBO off: 11 of "
                   "16.1 ms")


def _timing(step_ms: float, host_ms: float) -> Timing:
    """Two ranks: rank 1 the slowest in both times."""
    return Timing((step_ms - 0.5, step_ms), (host_ms - 0.5, host_ms))


# (DBO step ms, its host ms): the host-bound point of the brief, and one issued in half.
BOUND, NOT_BOUND = (24.8, 24.8), (24.8, 12.4)


@pytest.mark.parametrize("host_ms, step_ms, expected", [
    (24.8, 24.8, True), (HOST_BOUND_SHARE * 20.0, 20.0, True),
    (HOST_BOUND_SHARE * 20.0 - 1e-6, 20.0, False), (11.0, 24.8, False),
    (None, 24.8, False), (0.0, 0.0, False)])
def test_host_bound_rule(host_ms: float, step_ms: float, expected: bool) -> None:
    assert host_bound(host_ms, step_ms) is expected


def _prefill_point(cfg: HFBenchConfig, tokens: int, dbo: tuple[float, float]) -> hf_sweep.HFPoint:
    point = hf_sweep._point(cfg, backend="a2a", tokens=tokens, world=2,
                            conversion=Conversion(max_tokens_per_rank=None, points=(tokens,)),
                            unconverted=None, hf=_timing(20.0, 9.0), offs=[_timing(16.1, 11.0)],
                            ons=[_timing(*dbo)], split=True, reason="", diffs=[0.0, 0.0],
                            probe=HFProbe(None, None, ""))
    attach_gate(point, prefill_gate(cfg), ceiling=None, no_probe_reason="no probe",
                dbo_trials=[0.7], sbo_trials=[], perf=not cfg.functional)
    return point


def test_prefill_table_and_rows_show_host_times_and_the_host_bound_point_only() -> None:
    cfg = HFBenchConfig(arch="qwen3-30b-a3b", tokens=(4096, 8192), device="cuda",
                        regime=NVLINK_REGIME, rounds=1)
    points = [_prefill_point(cfg, 4096, BOUND), _prefill_point(cfg, 8192, NOT_BOUND)]
    row = points[0].row()
    assert (row["host_hf_ms"], row["host_nodbo_ms"], row["host_dbo_ms"]) == (9.0, 11.0, 24.8)
    assert [p.dbo_host_bound for p in points] == [True, False]
    assert "host_hf_ms/host_nodbo_ms/host_dbo_ms" in hf_report.DEFINITIONS
    table = hf_report.format_table(hf_sweep.HFSweepResult(cfg, 2, SHAPES, points))
    assert "host unconv  host noDBO  host DBO" in table
    assert "  host unconv / host noDBO / host DBO: the host's time to issue one step" in table
    bound = [line for line in table.splitlines() if "host-bound" in line]
    assert bound == [f"  a2a T=4096: {HOST_BOUND_LINE}; a2a reads on the host, so this "
                     f"includes waits for the device): each ubatch runs the model's Python, "
                     f"so DBO pays the host's launch cost twice per step; larger batches per "
                     f"rank or CUDA graphs would help"]


def test_decode_table_and_rows_show_host_times_and_the_host_bound_point_only() -> None:
    opts = HFDecodeOptions(requests=(64, 256), context=1024)
    cfg = HFBenchConfig(arch="qwen3-30b-a3b", decode=opts, device="cuda",
                        regime=NVLINK_REGIME, rounds=1)
    gate = GatePolicy(min_tokens_per_rank=0, min_gain=0.0)
    points = [hf_decode._point(cfg, opts, gate, backend="a2a_ll", requests=r, world=2,
                               conversion=Conversion(max_tokens_per_rank=None, points=(r,)),
                               unconverted=None, hf=_timing(20.0, 9.0),
                               offs=[_timing(16.1, 11.0)], ons=[_timing(*dbo)], trials=[0.7],
                               split=True, reason="", diffs=[0.0, 0.0])
              for r, dbo in ((64, NOT_BOUND), (256, BOUND))]
    assert [p.row()["host_dbo_ms"] for p in points] == [12.4, 24.8]
    assert [p.dbo_host_bound for p in points] == [False, True]
    assert "dbo_host_bound" in hf_decode_report.DEFINITIONS
    table = hf_decode_report.format_table(hf_decode.HFDecodeResult(cfg, 2, SHAPES, points))
    assert "host unconv  host noDBO  host DBO" in table
    bound = [line for line in table.splitlines() if "host-bound" in line]
    # a2a_ll reads nothing on the host: its host time is the issue time alone.
    assert len(bound) == 1 and bound[0].startswith(f"  a2a_ll R=256: {HOST_BOUND_LINE}): ")


def test_functional_run_reports_host_times_but_never_host_bound() -> None:
    """On CPU the host time is the step time: every step would read as host-bound."""
    cfg = HFBenchConfig(arch="qwen3_moe", tokens=(16,), rounds=1)
    point = _prefill_point(cfg, 16, BOUND)
    assert point.host_dbo_ms == 24.8 and point.dbo_host_bound is None
    table = hf_report.format_table(hf_sweep.HFSweepResult(cfg, 2, SHAPES, [point]))
    assert "host DBO" in table and "host-bound" not in table
