"""Layers 1-2 (CPU): the ceiling probe of `dbo bench --hf` prefill points
(`dbo.cli.bench.hf_probe`).
Layer 1 (one process, no model run): points made from synthetic `Timing`s and `Ceiling`s
as the sweep makes them (`hf_sweep._point`), on a GPU regime, so the fields, ceiling,
eta and table columns are checked on chosen numbers; which points the probe skips (CPU;
a backend outside torch.distributed collectives) and why, in the gate's words too.
Layer 2 (two gloo ranks): what of the probe runs without streams on a converted model,
as the GPU sweep runs it (the recording, compute alone on the recorded results, the split
compute through the runner with the prefill call's keyword arguments).
The end-to-end run on two gloo ranks (test_bench_hf.py) shows the skipped probe; the GPU
test there the measured one.
"""
from __future__ import annotations

import pytest
import torch

from dbo.cli.bench import hf_report, hf_sweep
from dbo.cli.bench.ceiling import Ceiling
from dbo.cli.bench.config import BenchConfig, NVLINK_REGIME
from dbo.cli.bench.hf_config import Conversion, HFBenchConfig
from dbo.cli.bench.hf_gate import attach_gate, prefill_gate
from dbo.cli.bench.hf_probe import (NO_PROBE_ON_CPU, PROBE_NA_CPU, PROBE_NO_FIGURES,
                                    HFProbe, no_probe_reason, probe_hf_point, skipped)
from dbo.cli.bench.point import ETA_ABOVE_ONE
from dbo.cli.bench.probe_scope import ProbeScope
from dbo.cli.bench.timing import Timing
from dbo.cli.bench.workload import WorkloadFactory
from tests.tools.test_bench_hf_host import SHAPES
from tests.tools.test_bench_probe import OpaqueFactory

CUDA = torch.device("cuda", 0)  # only its type is read: no GPU needed


def _timing(max_ms: float) -> Timing:
    """Two ranks, rank 1 the slowest."""
    return Timing((max_ms - 0.5, max_ms), (1.0, 1.0))


def _measured(both_ms: float = 11.0) -> HFProbe:
    return HFProbe(Ceiling(_timing(10.0), _timing(6.0), _timing(both_ms), num_collectives=4),
                   _timing(10.5), "")


def _point(cfg: HFBenchConfig, backend: str, tokens: int, dbo_ms: float,
           probe: HFProbe) -> hf_sweep.HFPoint:
    point = hf_sweep._point(cfg, backend=backend, tokens=tokens, world=2,
                            conversion=Conversion(max_tokens_per_rank=None, points=(tokens,)),
                            unconverted=None, hf=_timing(20.0), offs=[_timing(16.0)],
                            ons=[_timing(dbo_ms)], split=True, reason="", diffs=[0.0, 0.0],
                            probe=probe)
    attach_gate(point, prefill_gate(cfg),
                ceiling=None if probe.ceiling is None else probe.ceiling.ceiling,
                no_probe_reason=probe.note, dbo_trials=[1.2], sbo_trials=[],
                perf=not cfg.functional)
    return point


def test_probed_point_carries_the_layer_bench_ceiling_and_eta() -> None:
    cfg = HFBenchConfig(arch="qwen3-30b-a3b", tokens=(4096,), device="cuda",
                        regime=NVLINK_REGIME, rounds=1)
    point = _point(cfg, "a2a_ll", 4096, 12.0, _measured())
    row = point.row()
    assert (row["t_compute_ms"], row["t_comm_ms"], row["t_both_ms"], row["t_split_ms"]) == (
        10.0, 6.0, 11.0, 10.5)  # max over ranks
    assert row["ceiling"] == round((10.0 + 6.0) / 11.0, 5)
    assert row["eta"] == round((16.0 - 12.0) / (16.0 - 11.0), 5)
    assert (row["eta_note"], row["probe_note"]) == ("", "")
    assert point.per_rank_ms["t_both"] == [10.5, 11.0]
    assert point.per_rank_ms["t_split"] == [10.0, 10.5]
    beat = _point(cfg, "a2a_ll", 4096, 10.5, _measured())  # DBO under the probe's both
    assert beat.eta == (16.0 - 10.5) / 5.0 and beat.eta_note == ETA_ABOVE_ONE
    flat = _point(cfg, "a2a_ll", 4096, 12.0, _measured(both_ms=16.0))
    assert flat.eta is None and flat.eta_note.startswith("T_noDBO <= T_both")


def test_table_shows_probe_columns_dashes_and_why_not() -> None:
    cfg = HFBenchConfig(arch="qwen3-30b-a3b", tokens=(4096,), device="cuda",
                        regime=NVLINK_REGIME, rounds=1)
    opaque = ProbeScope(("symm_mem",)).reason + "; " + PROBE_NO_FIGURES
    points = [_point(cfg, "a2a_ll", 4096, 12.0, _measured()),
              _point(cfg, "a2a", 4096, 10.5, _measured()),
              _point(cfg, "symm_mem", 4096, 12.0, HFProbe(None, None, opaque))]
    table = hf_report.format_table(hf_sweep.HFSweepResult(cfg, 2, SHAPES, points))
    lines = table.splitlines()
    header = next(line for line in lines if "T/rank" in line)
    assert "comp ms   comm ms   both ms  split ms  ceiling     eta" in header
    probed, beat, none = (next(line for line in lines
                               if line.lstrip().startswith(f"4096  {b:>7}"))
                          for b in ("a2a_ll", "a2a", "symm_mem"))
    assert "10.000     6.000    11.000    10.500    1.455    0.80" in probed
    assert "1.455    1.10" in beat
    assert "-         -         -         -        -       -" in none
    assert f"  symm_mem T=4096: {opaque}" in lines
    assert f"  a2a T=4096: {ETA_ABOVE_ONE}" in lines
    assert lines[-1].endswith("ceiling = (comp + comm) / both, eta = (noDBO - DBO) / "
                              "(noDBO - both)")
    assert any(line.startswith("  ceiling probe: measured: compute alone") for line in lines)
    for key in ("t_compute / t_comm / t_both", "t_split", "ceiling", "eta", "probe_note"):
        assert key in hf_report.DEFINITIONS, key


def test_cpu_points_are_not_probed_and_say_so() -> None:
    cfg = HFBenchConfig(arch="qwen3_moe", tokens=(16,), rounds=1)
    model = WorkloadFactory(BenchConfig(layers=1), group=None,
                            device=torch.device("cpu")).get(tokens=8, backend="a2a",
                                                            dbo=False).model
    probe = probe_hf_point(model, {}, tokens=8, runner=None,  # type: ignore[arg-type]
                           device=torch.device("cpu"), group=None, warmup=0, iters=1,
                           cuda_graph=False, gemm_sm_carveout=None)
    assert probe == HFProbe(None, None, PROBE_NA_CPU)
    point = _point(cfg, "a2a", 16, 12.0, probe)
    row = point.row()
    assert [row[k] for k in ("t_compute_ms", "t_comm_ms", "t_both_ms", "t_split_ms",
                             "ceiling", "eta")] == [None] * 6
    assert row["probe_note"].startswith("probe n/a on CPU: gloo runs each collective")
    table = hf_report.format_table(hf_sweep.HFSweepResult(cfg, 2, SHAPES, [point, point]))
    assert f"  a2a T=16, a2a T=16: {PROBE_NA_CPU}" in table.splitlines()
    assert "ceiling probe: measured" not in table


def test_a_backend_outside_torch_distributed_collectives_is_not_probed_on_gpu() -> None:
    cfg = BenchConfig(layers=1)
    cpu = torch.device("cpu")
    model = WorkloadFactory(cfg, group=None, device=cpu).get(tokens=8, backend="a2a",
                                                             dbo=False).model
    assert skipped(model, CUDA) == ""
    opaque = OpaqueFactory(cfg, group=None, device=cpu).get(tokens=8, backend="a2a",
                                                            dbo=False).model
    note = skipped(opaque, CUDA)
    assert note == (f"probe n/a for backend 'opaque_a2a': its dispatch/combine runs in its "
                    f"own kernels, not torch.distributed collectives, so the probe can "
                    f"neither replay its traffic alone nor take it out of the step; "
                    f"{PROBE_NO_FIGURES}")
    # The layer bench's note is the same reason and what it reports instead.
    assert ProbeScope(("opaque_a2a",)).note.startswith(note.removesuffix(PROBE_NO_FIGURES))
    # The gate's words for the missing ceiling: the layer bench's, and none where probed.
    assert no_probe_reason(model, CUDA) == ""
    assert no_probe_reason(opaque, CUDA) == ("no probe (backend 'opaque_a2a' communicates "
                                             "outside torch.distributed collectives)")
    assert no_probe_reason(model, cpu) == NO_PROBE_ON_CPU == "probe skipped on CPU"


def _probe_parts_on_a_converted_model(rank: int, world: int) -> tuple:
    import torch.distributed as dist

    import moe.hf
    from dbo.cli.bench.ceiling import (CommReplay, probe_split_compute, record_collectives,
                                       replayed_results)
    from dbo.cli.bench.hf_sweep import _DBO_ON, _batch, build_model, largest_ubatch
    from dbo.cli.bench.workload import Workload
    from dbo.runner import DBORunner
    cfg = HFBenchConfig(arch="deepseek_v3", tokens=(16,), requests=2)
    cpu, group = torch.device("cpu"), dist.group.WORLD
    model = moe.hf.convert(build_model(cfg, cfg.model_config(world), device=cpu,
                                       dtype=torch.float32),
                           group=group, backend="a2a_ll", max_tokens_per_rank=16,
                           max_tokens_per_ubatch=largest_ubatch(cfg, 16))
    inputs = _batch(cfg, 16, model.config.vocab_size, rank=rank, device=cpu)
    off = Workload(model, (), inputs, 16, None)
    with record_collectives(model) as recording:
        logits = off.step().logits
    CommReplay(recording).run_all()
    with replayed_results(recording) as drift:
        alone = off.step().logits
    runner = DBORunner(model, _DBO_ON, group=group)
    split = probe_split_compute(Workload(model, (), inputs, 16, runner), device=cpu,
                                group=group, warmup=0, iters=1)
    return ([len(s) for s in recording.segments], torch.equal(alone, logits), drift.calls,
            split.max_ms > 0, bool(runner.last_decision.split))


@pytest.mark.distributed
def test_the_probe_records_and_replays_a_converted_model_on_two_gloo_ranks() -> None:
    """The converted model's MoE layer (one, in an HFMoEBlock) opens its own segment with
    a2a_ll's dispatch and combine; compute alone gives the logits the real step gave; the
    split compute runs the DBO step (split) on the recorded results."""
    from tests.dist_utils import run_distributed
    pytest.importorskip("transformers")
    for out in run_distributed(2, _probe_parts_on_a_converted_model):
        assert out == ([0, 2], True, 0, True, True), out
