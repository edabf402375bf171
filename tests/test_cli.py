"""Layer 2 (CPU, spawns gloo ranks): the `dbo` command end to end on the tiny preset:
`dbo run`, `dbo trace`, `dbo inspect`, and argument errors."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.distributed


def dbo(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dbo.cli", *args], capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="module")
def run_out(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    out = tmp_path_factory.mktemp("run")
    proc = dbo("run", "--tokens", "96", "--requests", "6", "--steps", "1", "--out", str(out))
    return out, proc


def test_dbo_run_end_to_end(run_out):
    out, proc = run_out
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["backend"] == "a2a"
    assert summary["split"] is True and summary["outputs_match"] is True
    assert summary["tokens_per_rank"] == [96, 84]
    assert summary["routing_ties"] == [0, 0]  # fp32: every token compared
    assert summary["step_ms"]["dbo_on"] > 0 and summary["step_ms"]["dbo_off"] > 0
    # The two ubatches interleave: ubatch 1 starts its attention before ubatch 0 receives.
    order = summary["phase_order"]
    assert order.index("ub1 attention") < order.index("ub0 dispatch_recv")
    assert order.index("ub0 combine_send") < order.index("ub1 combine_send")
    for name in ("trace.json", "trace_analysis.json", "trace_timeline.png"):
        assert (out / name).stat().st_size > 0
    assert (out / "rank1" / "trace.json").exists()
    last = json.loads(proc.stdout.strip().splitlines()[-1])
    assert last["outputs_match"] is True
    assert "order in which the ubatches issued the phases" in proc.stdout


def test_dbo_inspect_reads_the_run_trace(run_out):
    out, _ = run_out
    proc = dbo("inspect", str(out / "trace.json"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    json.loads(proc.stdout.strip().splitlines()[-1])


def test_dbo_trace_writes_analysis(tmp_path):
    proc = dbo("trace", "--tokens", "64", "--steps", "1", "--no-trace", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    analysis = json.loads((tmp_path / "trace_analysis.json").read_text())
    assert "devices" in analysis
    assert (tmp_path / "trace_timeline.png").stat().st_size > 0


@pytest.mark.parametrize("args, message", [
    (("run", "--tokens", "0"), "--tokens=0: must be >= 1"),
    (("run", "--preset", "nope"), "nope"),
    (("nope",), "unknown command 'nope'"),
    (("run", "--cuda-graph", "--backend", "a2a"), "--backend=a2a: that backend reads device values"),
    (("run", "--cuda-graph", "--experts", "reference"), "--cuda-graph with --experts=reference"),
])
def test_bad_arguments_fail_fast(args, message):
    proc = dbo(*args, timeout=60)
    assert proc.returncode == 2
    assert message in proc.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_run_with_cuda_graphs_is_refused_without_a_gpu():
    proc = dbo("run", "--cuda-graph", timeout=60)
    assert proc.returncode == 2
    assert "--cuda-graph needs CUDA GPUs" in proc.stderr


def _summary(**overrides) -> dict:
    s = {"config": {"preset": "tiny", "out": "o"}, "world_size": 2, "device": "cuda",
         "dtype": "torch.bfloat16", "backend": "a2a_ll", "tokens_per_rank": [8, 7],
         "split": True, "reason": "r", "outputs_match": True, "max_abs_diff": [0.0, 0.0],
         "tolerance": [0.1, 0.1], "routing_ties": [0, 2], "cuda_graph": False,
         "step_ms": {"dbo_off": 1.0, "dbo_on": 2.0}, "tokens_per_s": {"dbo_off": 1.0,
                                                                      "dbo_on": 0.5},
         "speedup": 0.5, "phase_order": [], "files": {}}
    s.update(overrides)
    return s


def test_run_summary_reports_ties_and_explains_a_loss_on_gpu(capsys):
    from dbo.run_job import print_summary

    print_summary(_summary())
    out = capsys.readouterr().out
    assert "near-tie, their router logits agreeing: [0, 2]" in out
    assert "DBO lost here" in out and "--cuda-graph cuts the launches" in out
    print_summary(_summary(cuda_graph=True))
    out = capsys.readouterr().out
    assert "DBO lost here" in out and "--cuda-graph cuts" not in out
    print_summary(_summary(speedup=1.2, routing_ties=[0, 0]))
    out = capsys.readouterr().out
    assert "DBO lost here" not in out and "near-tie" not in out
