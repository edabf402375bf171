"""Layer 4 (GPU, two NCCL ranks; skipped with fewer than 2 GPUs): short graphed soaks,
`dbo soak --cuda-graph`: a2a_ll in float32 and bfloat16, and deepep_ll in bfloat16 where
DeepEP is installed. Every step is padded to a capture size and replayed from a CUDA
graph; each rank captures one graph per size (all in the capture sweep, none after the
memory baseline), every step splits, the real rows match the reference, and CUDA memory
stays flat.

Run on a GPU machine: `python -m pytest -q -m gpu tests/tools/test_soak_gpu.py`.
The issue-sized soak is a command:

    dbo soak --steps 2000 --backend deepep_ll --cuda-graph --dtype bfloat16 \\
        --hidden 7168 --intermediate 256 --max-tokens 256 --experts triton
"""
from __future__ import annotations

import importlib.util
from dataclasses import replace
from typing import Any

import pytest
import torch

from dbo.cli.launch import RankContext
from dbo.cli.soak import SoakConfig, run_rank
from dbo.cli.soak.reference import BF16_REL_TOL
from tests.dist_utils import run_distributed

pytestmark = [
    pytest.mark.gpu, pytest.mark.multigpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                       reason="needs 2 GPUs"),
]

STEPS = 48
# max_tokens 32: sizes (2, 4, 8, 16, 32); the sweep's 5 steps fall in the warmup. Six
# samples (every 8 steps from 8): the object count is held over the later half, after
# the one-off rise that graphed replays show in their first steps after warmup.
BASE = SoakConfig(steps=STEPS, layers=2, warmup=8, report_every=8, max_tokens=32,
                  hidden=128, intermediate=64, experts="triton", cuda_graph=True,
                  backend="a2a_ll")


def _soaks(rank: int, world_size: int, jobs: list[SoakConfig]) -> Any:
    ctx = RankContext(rank, world_size, torch.device("cuda", rank), "nccl")
    return [run_rank(ctx, job) for job in jobs]


def _check_graphed(s: dict, job: SoakConfig) -> None:
    sizes = list(job.capture_sizes)
    assert s["cuda_graph"] and s["padded"] and s["device"] == "cuda"
    assert s["graphs"]["sizes"] == sizes and s["graphs"]["ok"], s["graphs"]
    # One graph per size on each rank (every step splits), none after the sweep.
    assert s["graphs"]["captured_per_rank"] == [len(sizes)] * 2, s["graphs"]
    assert s["graphs"]["captured_after_warmup_per_rank"] == [0, 0], s["graphs"]
    assert s["split_steps"] == job.steps
    assert s["mismatched_steps"]["count"] == 0, s["mismatched_steps"]
    assert s["memory_ok"] and s["ok"], s["memory"]
    for rank in s["memory"]:
        assert "cuda_allocated_less_workspace" in rank["checked"], rank["checked"]


def test_graphed_soak_a2a_ll():
    jobs = [BASE, replace(BASE, dtype="bfloat16")]
    fp32, bf16 = run_distributed(2, _soaks, jobs, backend="nccl")[0]
    for s, job in zip((fp32, bf16), jobs):
        _check_graphed(s, job)
    assert fp32["max_abs_diff"] <= fp32["atol"]
    assert 0 < bf16["max_rel_err"] <= BF16_REL_TOL


@pytest.mark.skipif(importlib.util.find_spec("deep_ep") is None,
                    reason="needs DeepEP (deep_ep): github.com/deepseek-ai/DeepEP")
def test_graphed_soak_deepep_ll_bf16():
    job = replace(BASE, backend="deepep_ll", dtype="bfloat16", hidden=2048, intermediate=256)
    (s,) = run_distributed(2, _soaks, [job], backend="nccl")[0]
    _check_graphed(s, job)
    assert 0 < s["max_rel_err"] <= BF16_REL_TOL
