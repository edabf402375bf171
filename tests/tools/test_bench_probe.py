"""Layers 1-2, and GPU: `dbo bench` on a backend whose exchange the ceiling probe cannot
record (DeepEP, symm_mem: not torch.distributed collectives). In process (layer 1): which
backends declare themselves recordable, the probe scope read through a model's layers,
and the table / JSON of a point the probe did not measure. Two gloo ranks (layer 2,
marked distributed): a sweep through a stand-in backend (a2a declared unrecordable, wired
in through the factory, registered nowhere) measures no phase times, predicts nothing,
gates on the tokens and the trial, and says why, while a recordable backend beside it is
measured as before. Two GPUs (gpu, multigpu): the same sweep runs no probe for the
stand-in and the full probe for naive.
"""
from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Optional

import pytest
import torch
from torch import nn

from dbo.cli.bench.ceiling import moe_layers
from dbo.cli.bench.config import EMULATED_REGIME, NVLINK_REGIME, BenchConfig
from dbo.cli.bench.point import make_point
from dbo.cli.bench.probe_scope import ProbeScope, probe_scope
from dbo.cli.bench.sweep import SweepResult
from dbo.cli.bench.timing import Timing
from dbo.cli.bench.workload import WorkloadFactory
from moe.backends.a2a import AllToAllBackend
from moe.backends.registry import BACKENDS
from tests.dist_utils import run_distributed

RECORDABLE = {"local", "naive", "naive_mono", "a2a", "a2a_ll"}
SHAPES = {"hidden_size": 8, "num_experts": 4, "experts_per_rank": 2, "top_k": 2,
          "intermediate_size": 8, "layers": 2, "dtype": "float32"}


class OpaqueA2A(AllToAllBackend):
    """a2a declaring its exchange opaque to the probe, as DeepEP's kernels are: a
    stand-in that runs on gloo."""

    name = "opaque_a2a"
    comm_recordable = False


class OpaqueFactory(WorkloadFactory):
    """Builds a2a models with `OpaqueA2A` in every MoE layer (other backends untouched)."""

    def _get_model(self, backend: str, capacity: Optional[int]) -> nn.Module:
        model = super()._get_model(backend, capacity)
        if backend == "a2a":
            for layer in moe_layers(model):
                if not isinstance(layer.backend, OpaqueA2A):  # before its first call
                    layer.backend = OpaqueA2A(layer.config, self.group)
        return model


# ----------------------------------------------------------------- layer 1: in-process
def test_backends_declare_whether_the_probe_can_record_their_exchange() -> None:
    for name, where in BACKENDS.items():
        module, cls = where.split(":")
        declared = getattr(importlib.import_module(module), cls).comm_recordable
        assert declared is (name in RECORDABLE), name


def test_probe_scope_reads_the_backends_of_the_models_layers() -> None:
    cfg = BenchConfig(layers=2)
    model = WorkloadFactory(cfg, group=None, device=torch.device("cpu")).get(
        tokens=8, backend="a2a", dbo=False).model
    assert probe_scope(model) == ProbeScope() and probe_scope(model).note == ""
    opaque = OpaqueFactory(cfg, group=None, device=torch.device("cpu")).get(
        tokens=8, backend="a2a", dbo=False).model
    scope = probe_scope(opaque)
    assert scope == ProbeScope(("opaque_a2a",)) and not scope.measurable
    assert scope.note.startswith("probe n/a for backend 'opaque_a2a': its dispatch/combine "
                                 "runs in its own kernels, not torch.distributed collectives")
    assert "\n" not in scope.note and "'opaque_a2a'" in scope.gate_reason


def test_a_point_the_probe_cannot_measure_shows_dashes_and_says_why(tmp_path: Path) -> None:
    from dbo.cli.bench.report import final_line, format_table, write_outputs

    cfg = BenchConfig(regime=EMULATED_REGIME, tokens=(4096,), backends=("deepep_ht",),
                      out_dir=str(tmp_path), plot=False)
    note = ProbeScope(("deepep_ht",)).note
    point = make_point(cfg, backend="deepep_ht", tokens=4096, world_size=2,
                       t_off=Timing((40.0, 40.2)), t_on=Timing((36.0, 36.1)), ceiling=None,
                       split=True, split_reason="", use_dbo=True,
                       gate_reason=ProbeScope(("deepep_ht",)).gate_reason)
    point.probe_note = note
    result = SweepResult(cfg, 2, SHAPES, "measured", [point])
    table = format_table(result)
    assert f"  {note}" in table.splitlines()
    row = next(line for line in table.splitlines() if line.split()[:2] == ["4096", "deepep_ht"])
    # comp, comm, both, split, ceiling, eta, eta rounds: none measured.
    assert row.split()[9:16] == ["-"] * 7, row
    predicted = table.split("predicted (")[1].splitlines()
    assert any(line.split()[:2] == ["4096", "deepep_ht"] and "no prediction" in line
               for line in predicted), predicted
    final = json.loads(final_line(result, write_outputs(result)))
    assert final["points"][0]["probe_note"] == note
    assert final["points"][0]["ceiling"] is None and final["points"][0]["t_comm_ms"] is None


# --------------------------------------------------------- layer 2: two gloo processes
def _opaque_sweep(rank: int, world_size: int, out_dir: str, device: str) -> dict:
    import torch.distributed as dist

    from dbo.cli.bench.report import final_line, format_table, write_outputs
    from dbo.cli.bench.sweep import run_sweep

    on = torch.device(device, rank) if device == "cuda" else torch.device("cpu")
    cfg = BenchConfig(mode="layer", tokens=(8, 32), backends=("a2a", "naive"), layers=2,
                      iters=1, warmup=1, rounds=1, gate_min_tokens=16, out_dir=out_dir,
                      device=device, plot=False, progress=False,
                      **({"regime": NVLINK_REGIME} if device == "cuda" else {}))
    factory = OpaqueFactory(cfg, group=dist.group.WORLD, device=on)
    result = run_sweep(cfg, group=dist.group.WORLD, device=on, factory=factory)
    if rank != 0:
        return {}
    files = write_outputs(result)
    doc = json.loads(Path(files["json"]).read_text())
    calibration = json.loads(Path(files["calibration"]).read_text())
    return {"final": json.loads(final_line(result, files)), "table": format_table(result),
            "doc_notes": [p["probe_note"] for p in doc["points"]],
            "calibrated": sorted({p["backend"] for p in calibration["points"]})}


def _check_opaque_sweep(out: dict, *, gpu: bool) -> None:
    note = ProbeScope(("opaque_a2a",)).note
    points = {(p["backend"], p["tokens_per_rank"]): p for p in out["final"]["points"]}
    assert set(points) == {(b, t) for b in ("a2a", "naive") for t in (8, 32)}
    for (backend, tokens), p in points.items():
        assert len(p["trial_speedups"]) == 1, p  # no calibration: the trial ran
        if backend == "a2a":
            assert p["probe_note"] == note, p
            for name in ("t_compute_ms", "t_comm_ms", "t_both_ms", "t_split_ms", "ceiling",
                         "eta", "t_nodbo_pred_ms", "t_dbo_pred_ms", "pred_err_dbo"):
                assert p[name] is None, (name, p)
            assert p["pred_choice"] == ""
        else:
            assert p["probe_note"] == "" and p["t_nodbo_pred_ms"] > 0, p
            assert (p["t_comm_ms"] is not None) is gpu, p
            assert (p["ceiling"] is not None) is gpu, p
        # SBO's verdict, then DBO's (`GatePolicy.choose`); SBO runs through any backend.
        assert len(p["sbo_trial_speedups"]) == 1 and p["t_sbo_ms"] > 0, p
        dbo_reason = p["gate_reason"].split("DBO: ", 1)[1]
        if tokens < 16:
            assert p["gate"] != "dbo" and dbo_reason.startswith("threshold"), p
        elif dbo_reason.startswith("trial: DBO"):
            assert p["gate"] != "dbo", p
        elif backend == "a2a":  # passed the trial; the missing probe is named, not a ceiling
            assert "trial DBO" in dbo_reason, p
            assert "no probe (backend 'opaque_a2a'" in dbo_reason, p
        # A probed backend that passed the trial may still stop at its measured ceiling
        # (on GPUs): which of the two reasons it gives is a timing outcome, not checked.
    assert out["doc_notes"] == [note, note, "", ""]
    assert out["calibrated"] == ["naive"]  # no phase times were measured for the stand-in
    assert f"  {note}" in out["table"].splitlines()


@pytest.mark.distributed
def test_sweep_through_an_unrecordable_backend_gates_on_trials_and_says_why(
        tmp_path: Path) -> None:
    out = run_distributed(2, _opaque_sweep, str(tmp_path), "cpu")[0]
    _check_opaque_sweep(out, gpu=False)


@pytest.mark.gpu
@pytest.mark.multigpu
def test_gpu_sweep_probes_the_recordable_backend_only(tmp_path: Path) -> None:
    out = run_distributed(2, _opaque_sweep, str(tmp_path), "cuda", backend="nccl")[0]
    _check_opaque_sweep(out, gpu=True)
