"""Layer 1 (CPU, in process): what the `dbo` commands print. `dbo run`'s summary (ties,
a loss explained, CPU timings labelled a functional check, the traced comm) and `dbo
inspect`'s outputs and refusals."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dbo import cli


def _summary(**overrides) -> dict:
    s = {"config": {"preset": "tiny", "out": "o", "steps": 3}, "world_size": 2, "model": "preset tiny",
         "device": "cuda", "num_experts": 8, "timings": "performance",
         "dtype": "torch.bfloat16", "backend": "a2a_ll", "tokens_per_rank": [8, 7],
         "split": True, "reason": "r", "outputs_match": True, "max_abs_diff": [0.0, 0.0],
         "tolerance": [0.1, 0.1], "routing_ties": [0, 2], "cuda_graph": False,
         "step_ms": {"dbo_off": 1.0, "dbo_on": 2.0}, "tokens_per_s": {"dbo_off": 1.0,
                                                                      "dbo_on": 0.5},
         "speedup": 0.5, "phase_order": [], "files": {}}
    s.update(overrides)
    return s


def test_run_summary_reports_ties_and_explains_a_loss_on_gpu(capsys):
    from dbo.cli.run_job import print_summary

    print_summary(_summary())
    out = capsys.readouterr().out
    assert "near-tie, their router logits agreeing, and the later tokens of their requests" in out
    assert "DBO lost here" in out and "--cuda-graph cuts the launches" in out
    print_summary(_summary(cuda_graph=True))
    out = capsys.readouterr().out
    assert "DBO lost here" in out and "--cuda-graph cuts" not in out
    print_summary(_summary(speedup=1.2, routing_ties=[0, 0]))
    out = capsys.readouterr().out
    assert "DBO lost here" not in out and "near-tie" not in out
    assert "DBO gained little" not in out
    # Barely faster (NVLink on 4 GPUs measured 1.001x): the same advice, and the share of
    # the traced step's comm that ran beside compute.
    print_summary(_summary(speedup=1.01, regime="nvlink",
                           traced_comm={"comm_ms": 27.4, "hidden_ms": 16.7,
                                        "hidden_fraction": 0.61}))
    out = capsys.readouterr().out
    assert "DBO gained little here" in out and "NCCL_P2P_DISABLE=1" in out
    assert "traced DBO step, rank 0: 27.4 ms of communication, 61% of it hidden" in out


def test_traced_comm_reads_the_captured_report():
    from types import SimpleNamespace

    from dbo.cli.run_job import traced_comm

    device = SimpleNamespace(comm_us=2000.0, comm_overlapped_us=500.0)
    captured = SimpleNamespace(report=SimpleNamespace(devices={0: device}))
    assert traced_comm(captured) == {"comm_ms": 2.0, "hidden_ms": 0.5, "hidden_fraction": 0.25}
    assert traced_comm(None) is None
    assert traced_comm(SimpleNamespace(report=SimpleNamespace(devices={}))) is None


def test_cpu_timings_are_labelled_a_functional_check(capsys):
    from dbo.cli.run_job import print_summary

    print_summary(_summary(device="cpu", timings="functional", speedup=None))
    out = capsys.readouterr().out
    assert "functional check on cpu, not a performance figure" in out
    assert "speedup" not in out and "DBO lost here" not in out
    print_summary(_summary(speedup=1.2))
    assert "speedup: 1.200x" in capsys.readouterr().out


def test_a_loss_on_nvlink_says_why_and_how_to_see_the_overlap(capsys):
    from dbo.cli.run_job import print_summary, why_dbo_lost

    nvlink = why_dbo_lost(_summary(regime="NVLink", speedup=0.6, tokens_per_rank=[4096, 3584]))
    text = " ".join(nvlink)
    assert "NVLink, fast enough that the dispatch and combine leave little to hide" in text
    assert "NCCL_P2P_DISABLE=1" in text and "more ranks" in text
    assert "--tokens 8192" in text  # twice rank 0's tokens
    emulated = " ".join(why_dbo_lost(_summary(regime="scale-out emulated (NCCL_P2P_DISABLE=1)")))
    assert "NVLink" not in emulated and "more tokens per rank" in emulated
    one = " ".join(why_dbo_lost(_summary(world_size=1, tokens_per_rank=[4096])))
    assert "no communication to hide" in one and "NCCL_P2P_DISABLE" not in one
    print_summary(_summary(regime="NVLink"))
    out = capsys.readouterr().out
    assert "speedup: 0.500x" in out and "leave little to hide" in out


@pytest.fixture(scope="module")
def cpu_trace(tmp_path_factory) -> Path:
    from torch.profiler import profile

    path = tmp_path_factory.mktemp("trace") / "trace.json"
    with profile() as prof:
        torch.ones(64, 64) @ torch.ones(64, 64)
    prof.export_chrome_trace(str(path))
    return path


def test_inspect_writes_into_a_folder_and_prints_the_file_written(cpu_trace, tmp_path, capsys):
    # --png / --json naming a folder write timeline.png / trace_analysis.json in it (as
    # dbo plan --out DIR writes plan.png in DIR), and print the file written.
    folder = tmp_path / "out"
    folder.mkdir()
    assert cli.main(["inspect", str(cpu_trace), "--png", str(folder), "--json",
                     str(tmp_path / "new") + "/"]) == 0
    out = capsys.readouterr().out
    assert f"timeline: {folder / 'timeline.png'}\n" in out
    assert (folder / "timeline.png").stat().st_size > 0
    report = json.loads((tmp_path / "new" / "trace_analysis.json").read_text())
    assert report == json.loads(out.strip().splitlines()[-1])
    assert cli.main(["inspect", str(cpu_trace), "--png", str(tmp_path / "t.png")]) == 0
    assert f"timeline: {tmp_path / 't.png'}\n" in capsys.readouterr().out
    assert (tmp_path / "t.png").stat().st_size > 0


@pytest.mark.parametrize("option, value, message", [
    ("--png", "x", "--png=X: name a .png file, or a folder to write timeline.png in (end it "
                   "with / if it does not exist yet)"),
    ("--png", "x.svg", "--png=X: name a .png file"),
    ("--json", "r.txt", "--json=X: name a .json file, or a folder to write "
                        "trace_analysis.json in"),
])
def test_inspect_refuses_an_output_it_would_not_write_as_named(option, value, message, cpu_trace,
                                                              tmp_path, capsys):
    path = str(tmp_path / value)
    with pytest.raises(SystemExit) as exc:
        cli.main(["inspect", str(cpu_trace), option, path])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"dbo inspect: {message.replace('X', path)}") and \
        err.count("\n") == 1, err
    assert not list(tmp_path.iterdir())  # nothing written
