"""Layer 4 (GPU, two processes over NCCL; skipped with fewer than 2 GPUs): the comm
benchmark's sweep on real GPUs, small shapes. Latencies from CUDA events, the comm
kernels' SMs from torch.profiler, and DeepEP's raw calls where `deep_ep` imports. With
`cuda_graph`: a2a_ll and symm_mem (where torch's op and NVSHMEM are there), then, in
other processes (DeepEP LL and symm_mem cannot share one), deepep_ll and deepep_raw_ll,
timed from replays of 3 captured pairs; a2a and deepep_raw_ht skipped with the reason.

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


# ------------------------------------------------------------------ --cuda-graph
# NVLink multicast off, as every GPU run here (BENCHMARKS.md); the spawned ranks inherit it.
_NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                 "NVSHMEM_DISABLE_NVLS": "1"}
_TWO_GPUS = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                               reason="needs 2 CUDA GPUs")


def _graphed_sweep(rank: int, world_size: int, backends: tuple[str, ...], hidden: int) -> dict:
    from moe.bench.comm import CommBenchConfig, run_comm_sweep

    cfg = CommBenchConfig(tokens=(1, 16), hidden=hidden, top_k=2, num_experts=8, iters=3,
                          warmup=1, backends=backends, cuda_graph=True, graph_layers=3)
    result = run_comm_sweep(cfg, group=dist.group.WORLD,
                            device=torch.device("cuda", torch.cuda.current_device()))
    return {"points": [(p.backend, p.tokens, p.dispatch_us, p.combine_us, p.total_us,
                        p.host_total_us, p.host_dispatch_us, p.host_combine_us)
                       for p in result.points],
            "skipped": [(s.backend, s.tokens, s.reason) for s in result.skipped]}


def _check_graphed(result: dict, backends: tuple[str, ...]) -> None:
    points = {(b, t): rest for b, t, *rest in result["points"]}
    for backend in backends:
        for tokens in (1, 16):
            assert (backend, tokens) in points, (backend, tokens, result["skipped"])
            dispatch, combine, total, host_layer, host_d, host_c = points[(backend, tokens)]
            assert dispatch > 0 and combine > 0 and total > 0 and host_layer > 0, backend
            assert host_d is None and host_c is None  # no per-call host time in a graph


def _symm_mem_missing() -> str | None:
    from moe.backends.symm_mem_support import require_symm_mem
    try:
        require_symm_mem()
    except (ImportError, ValueError) as exc:
        return str(exc)
    return None


@pytest.mark.gpu
@pytest.mark.multigpu
@_TWO_GPUS
def test_graphed_sweep_times_a2a_ll_and_symm_mem_and_skips_a2a(
        monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in _NO_MULTICAST.items():
        monkeypatch.setenv(name, value)
    # H 128 bf16: a row layout symm_mem's op takes (tests/moe/test_gpu_symm_mem.py).
    backends = ("a2a", "a2a_ll") + (() if _symm_mem_missing() else ("symm_mem",))
    result = run_distributed(2, _graphed_sweep, backends, 128, backend="nccl")[0]
    _check_graphed(result, backends[1:])
    skipped = {(b, t): r for b, t, r in result["skipped"]}
    for tokens in (1, 16):  # a2a reads its counts on the host: skipped, the run goes on
        assert "backend 'a2a' reads device values on the host" in skipped[("a2a", tokens)]


@pytest.mark.gpu
@pytest.mark.multigpu
@_TWO_GPUS
@pytest.mark.skipif(importlib.util.find_spec("deep_ep") is None, reason="needs DeepEP")
def test_graphed_sweep_times_deepep_low_latency(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in _NO_MULTICAST.items():
        monkeypatch.setenv(name, value)
    # H 7168: a hidden size DeepEP's low-latency kernels are compiled for.
    backends = ("deepep_ll", "deepep_raw_ll", "deepep_raw_ht")
    result = run_distributed(2, _graphed_sweep, backends, 7168, backend="nccl")[0]
    _check_graphed(result, backends[:2])
    reasons = {b: r for b, _, r in result["skipped"]}
    assert "DeepEP's normal dispatch waits on the host" in reasons["deepep_raw_ht"]
