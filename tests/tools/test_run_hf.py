"""Layer 2 (two gloo processes) and Layer 1 (CPU): `dbo run --hf-config NAME` end to end
on two CPU ranks (a tiny random Qwen3-MoE, its experts split over the ranks: DBO on and
off give the same logits, the timing table, the MoE layer's phase order, the trace), and
the options of `--hf` / `--hf-config` that are refused before any rank starts.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("transformers")

from dbo import cli  # noqa: E402


@pytest.mark.distributed
@pytest.mark.parametrize("backend", ["auto", "a2a_ll"])  # a2a_ll: a capacity is given
def test_dbo_run_hf_config_end_to_end(tmp_path, backend):
    proc = subprocess.run([sys.executable, "-m", "dbo.cli", "run", "--hf-config", "qwen3_moe",
                           "--tokens", "48", "--requests", "4", "--steps", "1",
                           "--backend", backend, "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["model"] == "hf-config qwen3_moe" and summary["world_size"] == 2
    assert summary["backend"] == ("a2a" if backend == "auto" else backend)
    assert summary["num_experts"] == 8
    assert summary["split"] is True and summary["outputs_match"] is True
    assert summary["tokens_per_rank"] == [48, 40]  # 4 sequences of 12 and of 10 tokens
    # The MoE layer's phases interleave: ubatch 1 routes before ubatch 0 receives.
    order = summary["phase_order"]
    assert order.index("ub1 router") < order.index("ub0 dispatch_recv")
    assert (tmp_path / "trace.json").stat().st_size > 0
    assert "dbo run: hf-config qwen3_moe, 2 ranks" in proc.stdout


@pytest.fixture
def no_launch(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("ranks were started")

    import dbo.cli.run_job
    monkeypatch.setattr(dbo.cli.run_job, "launch", refuse)


@pytest.mark.parametrize("args, message", [
    (("--hf-config", "nope"), "argument --hf-config: invalid choice: 'nope'"),
    (("--hf", "DIR"), "no config.json there: name a local checkpoint folder"),
    (("--hf", "DIR", "--hf-config", "mixtral"), "--hf and --hf-config name two models"),
    (("--hf-config", "qwen3_moe", "--num-experts", "5"),
     "5 routed experts (hf-config qwen3_moe) do not split over 2 ranks"),
    (("--hf-config", "qwen3_moe", "--world-size", "3"), "do not split over 3 ranks"),
    (("--hf-config", "mixtral", "--num-experts", "1", "--world-size", "1"),
     "top_k=2 exceeds num_experts=1"),
    (("--hf-config", "mixtral", "--cuda-graph"), "--cuda-graph needs CUDA GPUs"),
    (("--hf-config", "mixtral", "--preset", "mixtral-like"), "--preset with --hf-config"),
])
def test_bad_hf_arguments_fail_fast(args, message, tmp_path, capsys, no_launch):
    argv = ["run", *(str(tmp_path) if a == "DIR" else a for a in args)]
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and err.startswith("dbo run: "), err


def test_hf_checkpoint_sizes_are_not_overridden(tmp_path, capsys, no_launch):
    from tests.hf_utils import save, tiny_model
    path = save(tiny_model("qwen3_moe"), tmp_path)
    with pytest.raises(SystemExit):
        cli.main(["run", "--hf", path, "--num-experts", "8"])
    assert "--num-experts with --hf: a checkpoint's sizes come from its config.json" in \
        capsys.readouterr().err
    with pytest.raises(SystemExit):  # 4 experts over 3 ranks, read from config.json
        cli.main(["run", "--hf", path, "--world-size", "3"])
    assert f"4 routed experts (hf {path}) do not split over 3 ranks" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.multigpu
def test_dbo_run_hf_config_cuda_graph_on_two_gpus(tmp_path):
    """`dbo run --hf-config NAME --cuda-graph`: both modes replayed from CUDA graphs, a2a_ll
    chosen for "auto", DBO on and off giving the same logits."""
    import os
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
           "NVSHMEM_DISABLE_NVLS": "1"}
    proc = subprocess.run([sys.executable, "-m", "dbo.cli", "run", "--hf-config", "qwen3_moe",
                           "--tokens", "64", "--requests", "4", "--steps", "2",
                           "--cuda-graph", "--world-size", "2", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["backend"] == "a2a_ll" and summary["split"] is True, summary
    assert summary["outputs_match"] is True, summary
