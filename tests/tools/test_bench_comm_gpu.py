"""Layer 4 (GPU, two processes over NCCL; skipped with fewer than 2 GPUs): the comm
benchmark's sweep on real GPUs, small shapes. Latencies from CUDA events, the comm
kernels' SMs from torch.profiler, and DeepEP's raw calls where `deep_ep` imports.

    python -m pytest -q -m gpu tests/tools/test_bench_comm_gpu.py
"""
from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.distributed as dist

from tests.dist_utils import run_distributed


def _sweep(rank: int, world_size: int) -> dict:
    from moe.bench.comm import CommBenchConfig, run_comm_sweep

    cfg = CommBenchConfig(tokens=(1, 128), hidden=7168, top_k=4, num_experts=16, iters=3,
                          warmup=1, backends=("a2a", "a2a_ll", "deepep_raw_ht",
                                              "deepep_raw_ll"))
    result = run_comm_sweep(cfg, group=dist.group.WORLD,
                            device=torch.device("cuda", torch.cuda.current_device()))
    return {"points": [(p.backend, p.tokens, p.total_us, p.sms_dispatch, p.sms_combine,
                        p.algbw_total_gbps) for p in result.points],
            "skipped": [(s.backend, s.tokens, s.reason) for s in result.skipped],
            "sm_count": result.sm_count}


@pytest.mark.gpu
@pytest.mark.multigpu
def test_sweep_times_backends_and_reads_comm_sms_on_two_gpus() -> None:
    result = run_distributed(2, _sweep, backend="nccl")[0]
    points = {(b, t): rest for b, t, *rest in result["points"]}
    for backend in ("a2a", "a2a_ll"):
        for tokens in (1, 128):
            total_us, sms_d, sms_c, gbps = points[(backend, tokens)]
            assert total_us > 0 and gbps > 0
            # NCCL's kernels were seen and hold between 1 SM and all of them.
            assert 1 <= sms_d <= result["sm_count"] and 1 <= sms_c <= result["sm_count"]
    if importlib.util.find_spec("deep_ep") is None:
        reasons = {b: r for b, _, r in result["skipped"]}
        assert "DeepEP is not installed" in reasons["deepep_raw_ht"]
        return
    for backend in ("deepep_raw_ht", "deepep_raw_ll"):
        for tokens in (1, 128):
            total_us, sms_d, sms_c, _ = points[(backend, tokens)]
            assert total_us > 0 and sms_d >= 1 and sms_c >= 1, (backend, tokens)
