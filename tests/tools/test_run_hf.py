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
@pytest.mark.parametrize("backend", ["a2a_ll"])  # a capacity is given (auto: below)
def test_dbo_run_hf_config_end_to_end(tmp_path, backend, capfd, monkeypatch):
    # cli.main in this process (the ranks it spawns import torch and transformers, this
    # process has; python -m dbo.cli is checked by tests/tools/test_cli.py): capfd also
    # sees the ranks' output. Not under torchrun: it spawns its ranks.
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    code = cli.main(["run", "--hf-config", "qwen3_moe", "--tokens", "48", "--requests", "4",
                     "--steps", "1", "--backend", backend, "--out", str(tmp_path)])
    stdout, stderr = capfd.readouterr()
    assert code == 0, stderr[-3000:]
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
    assert "dbo run: hf-config qwen3_moe, 2 ranks" in stdout


def test_auto_backend_of_an_hf_run_is_the_preset_run_s():
    # --hf / --hf-config resolve "auto" as the preset job does (its end-to-end run over
    # a2a is tests/tools/test_cli.py's): local on one rank, a2a on several, a2a_ll graphed.
    from dbo.cli.run_config import RunConfig, run_backend
    job = RunConfig(hf_config="qwen3_moe")
    assert [run_backend(job, 1), run_backend(job, 2)] == ["local", "a2a"]
    assert run_backend(RunConfig(hf_config="qwen3_moe", cuda_graph=True), 2) == "a2a_ll"


@pytest.fixture
def no_launch(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("ranks were started")

    import dbo.cli.run_job
    monkeypatch.setattr(dbo.cli.run_job, "launch", refuse)


@pytest.mark.parametrize("args, message", [
    (("--hf-config", "nope"), "unknown architecture 'nope' for --hf-config: use one of"),
    (("--hf-config", "qwen3-30b-a3b"), "--hf-config qwen3-30b-a3b builds real shapes: pass "
                                       "--layers N"),
    (("--hf", "DIR"), "no config.json there: name a local checkpoint folder"),
    (("--hf", "DIR", "--hf-config", "mixtral"), "--hf and --hf-config name two models"),
    (("--hf-config", "qwen3_moe", "--num-experts", "5"),
     "5 routed experts (hf-config qwen3_moe) do not split over 2 ranks"),
    (("--hf-config", "qwen3_moe", "--world-size", "3"), "do not split over 3 ranks"),
    (("--hf-config", "mixtral", "--num-experts", "1", "--world-size", "1"),
     "top_k=2 exceeds num_experts=1"),
    (("--hf-config", "mixtral", "--cuda-graph"), "--cuda-graph needs CUDA GPUs"),
    (("--hf-config", "mixtral", "--preset", "mixtral-like"), "--preset with --hf-config"),
    (("--hf-config", "qwen3_moe", "--trust-remote-code"),
     "--trust-remote-code with --hf-config: a tiny random model has no folder code to run"),
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


@pytest.mark.parametrize("index, message", [
    ("{not json", "model.safetensors.index.json: not valid JSON"),
    ('{"metadata": {}}', "has no \"weight_map\""),
    ('{"weight_map": {"lm_head.weight": "model-00009-of-00009.safetensors"}}',
     "'model-00009-of-00009.safetensors'"),
])
def test_a_broken_checkpoint_index_is_refused_before_any_rank(index, message, tmp_path, capsys,
                                                              no_launch):
    from tests.hf_utils import tiny_model
    path = tmp_path / "ckpt"
    tiny_model("qwen3_moe").save_pretrained(path, max_shard_size="40KB")
    index_file = path / "model.safetensors.index.json"
    assert index_file.exists()  # sharded: the index says where each tensor is
    index_file.write_text(index)
    capsys.readouterr()  # save_pretrained's progress bar
    with pytest.raises(SystemExit) as info:
        cli.main(["run", "--hf", str(path)])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("dbo run: --hf") and err.count("\n") == 1, err
    assert message in err, err


def test_a_corrupt_safetensors_file_is_refused_before_any_rank(tmp_path, capsys, no_launch):
    from tests.hf_utils import save, tiny_model
    path = save(tiny_model("qwen3_moe"), tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")
    capsys.readouterr()  # save_pretrained's progress bar
    with pytest.raises(SystemExit):
        cli.main(["run", "--hf", path])
    err = capsys.readouterr().err
    assert "'model.safetensors' is not a readable safetensors file" in err and \
        err.count("\n") == 1, err


def custom_code_checkpoint(tmp_path) -> tuple[str, object]:
    """A tiny Qwen3-MoE checkpoint whose config.json's auto_map names the folder's own
    (harmless) classes, which write a marker file when imported: (folder, marker)."""
    from tests.hf_utils import save, tiny_model
    from tests.models.test_hf_files import _with_custom_code
    marker = tmp_path / "marker"
    return _with_custom_code(save(tiny_model("qwen3_moe"), tmp_path / "ckpt"), marker), marker


def test_dbo_run_hf_refuses_a_folder_with_custom_code_in_one_line(tmp_path, capsys, no_launch):
    path, marker = custom_code_checkpoint(tmp_path)
    capsys.readouterr()  # save_pretrained's progress bar
    for command in ("run", "trace"):  # the commands that take --hf PATH
        with pytest.raises(SystemExit) as info:
            cli.main([command, "--hf", path])
        assert info.value.code == 2
        err = capsys.readouterr().err
        assert err.startswith(f"dbo {command}: --hf: ") and err.count("\n") == 1, err
        assert ("its auto_map names the folder's own code (custom.CustomConfig, "
                "custom.CustomModel), which was not run: pass --trust-remote-code") in err, err
    assert not marker.exists()


def test_dbo_run_hf_trust_remote_code_reaches_transformers_loader(tmp_path, monkeypatch):
    import moe.hf
    path, marker = custom_code_checkpoint(tmp_path)
    loaded: list[tuple[object, str]] = []
    real_load = moe.hf.load

    def spy(*args, **kwargs):
        model = real_load(*args, **kwargs)
        loaded.append((kwargs.get("trust_remote_code"), type(model).__name__))
        return model

    monkeypatch.setattr(moe.hf, "load", spy)
    # One rank runs in this process: the spy sees the rank's load.
    code = cli.main(["run", "--hf", path, "--trust-remote-code", "--world-size", "1",
                     "--steps", "1", "--warmup", "0", "--tokens", "16", "--requests", "2",
                     "--no-trace", "--out", str(tmp_path / "out")])
    assert code == 0
    # transformers built the folder's own class, from the folder's code.
    assert loaded == [(True, "CustomModel")], loaded
    assert marker.read_text() == "ran"
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["outputs_match"] is True and summary["model"] == f"hf {path}"


def test_dbo_run_hf_takes_a_checkpoint_of_a_family_that_is_not_hand_mapped(tmp_path):
    # OLMoE goes through the experts path (moe.hf.generic), not the hand-mapped blocks:
    # its checkpoint loads with moe.hf.load, and the job finds its experts and compares.
    from moe.hf.coverage import tiny_model
    path = tmp_path / "olmoe"
    tiny_model("olmoe", seed=3).save_pretrained(path)
    code = cli.main(["run", "--hf", str(path), "--world-size", "1", "--steps", "1",
                     "--warmup", "0", "--tokens", "16", "--requests", "2", "--no-trace",
                     "--out", str(tmp_path / "out")])
    assert code == 0
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["outputs_match"] is True and summary["split"] is True
    assert summary["model"] == f"hf {path}" and summary["num_experts"] > 0


def test_transformers_older_than_5_17_is_named_in_one_line(monkeypatch, capsys, no_launch):
    # Transformers 4.x holds a block's experts as a ModuleList, which moe.hf cannot take:
    # moe.hf.convert and dbo run --hf-config say the installed and the needed version.
    import transformers

    from moe.hf import convert
    from moe.hf.deps import check_transformers_version
    from tests.hf_utils import tiny_model

    model = tiny_model("qwen3_moe")
    check_transformers_version("5.17.0")
    check_transformers_version("5.24.0.dev0")
    monkeypatch.setattr(transformers, "__version__", "4.57.1")
    expected = ("moe.hf needs transformers >= 5.17 (MoE experts held as fused gate_up_proj / "
                "down_proj tensors), but transformers 4.57.1 is installed: pip install -e "
                "\".[hf]\" (transformers>=5.17, safetensors)")
    with pytest.raises(ImportError) as exc:
        convert(model)
    assert str(exc.value) == expected
    assert not any(type(m).__name__ == "HFMoEBlock" for m in model.modules())  # untouched
    with pytest.raises(SystemExit) as info:
        cli.main(["run", "--hf-config", "qwen3_moe"])
    assert info.value.code == 2
    assert capsys.readouterr().err == f"dbo run: {expected}\n"


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
