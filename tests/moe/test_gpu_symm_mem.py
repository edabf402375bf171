"""Layer 4 (GPU, 2 GPUs over NVSHMEM; skipped without them or without torch's op):
backend `symm_mem` with the real `torch.ops.symm_mem.all_to_all_vdev`.

Bit-exact against `a2a` on the same routing (fp32 and bf16, DBO off and on, a zero-token
rank, all tokens to one expert; reference and triton experts), a capacity overflow
raising the same error on every rank, a DBO step captured in a CUDA graph and replayed,
and 200 random-size steps with flat memory, the two layers holding two shared sets of
symmetric buffers (one per ubatch).
With DeepEP installed too: a deepep_ll layer made after symm_mem has run is refused
(RuntimeError) instead of aborting the process in DeepEP's first low-latency kernel.

Run alone: NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
    python -m pytest -q -m gpu tests/moe/test_gpu_symm_mem.py
"""
from __future__ import annotations

import importlib.util
import random
from dataclasses import replace
from typing import Any

import pytest
import torch
import torch.distributed as dist

from dbo import DBOConfig, DBORunner
from dbo.graphs import GraphedRunner
from moe.backends.symm_mem_support import num_shared_sets
from moe.config import MoEConfig
from tests.dist_utils import run_distributed
from tests.moe.test_symm_mem import compare_with_a2a


def _why_not() -> str | None:
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        return "needs 2 CUDA GPUs"
    from moe.backends.symm_mem_support import require_symm_mem
    try:
        require_symm_mem()
    except (ImportError, ValueError) as exc:
        return str(exc)
    return None


pytestmark = [pytest.mark.gpu, pytest.mark.multigpu,
              pytest.mark.skipif(_why_not() is not None, reason=str(_why_not()))]

SPLIT = DBOConfig(split="tokens", min_decode_tokens=2, min_prefill_tokens=2)


@pytest.mark.parametrize("experts,against", [("reference", "a2a"), ("triton", "a2a_ll")])
@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_matches_a2a_bit_for_bit(dtype_name, experts, against):
    """Against a2a with the reference experts; with the triton experts against a2a_ll,
    whose experts see as many rows (their tiles depend on the row count)."""
    for rank, results in enumerate(run_distributed(2, compare_with_a2a, dtype_name, experts,
                                                   False, against, backend="nccl")):
        for name, same in results.items():
            assert same == [True, True, True], (rank, name, same)


def _stack(backend: str, device: torch.device, capacity: int) -> torch.nn.Module:
    from dbo.cli.bench.layer_stack import LayerStack
    cfg = MoEConfig(num_experts=8, top_k=2, hidden_size=128, intermediate_size=64,
                    num_shared_experts=1, dtype=torch.bfloat16, max_tokens_per_rank=capacity)
    model = LayerStack(replace(cfg, backend=backend, experts="triton"), num_layers=2,
                       attn_context=64, group=dist.group.WORLD, device=device)
    model.init_weights(seed=5)
    return model


def _inputs(tokens: int, seed: int, device: torch.device) -> torch.Tensor:
    gen = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(tokens, 128, generator=gen, device=device).to(torch.bfloat16)


def _workspace_allocations(model: torch.nn.Module) -> int:
    """Allocations of the MoE layers' workspaces (the symmetric buffers among them): a
    MoELayer keeps one ModularKernel, with its WorkspaceSets, per input device."""
    from moe.layer import MoELayer
    return sum(kernel.workspaces.num_allocations for m in model.modules()
               if isinstance(m, MoELayer) for kernel in m._kernels.values())


def _overflow_worker(rank: int, world_size: int) -> dict[str, Any]:
    device = torch.device("cuda", rank)
    runner = DBORunner(_stack("symm_mem", device, capacity=8), SPLIT, group=dist.group.WORLD)
    out: dict[str, Any] = {}
    with torch.no_grad():
        try:
            runner(_inputs(20 if rank == 1 else 6, rank, device))  # ubatches of 10 > 8
            out["error"] = "no error"
        except ValueError as exc:
            out["error"] = str(exc)
        out["after"] = tuple(runner(_inputs(8, 10 + rank, device)).shape)
    torch.cuda.synchronize()
    return out


def test_capacity_overflow_raises_the_same_error_on_every_rank():
    for out in run_distributed(2, _overflow_worker, backend="nccl"):
        assert out["error"].startswith("rank 1 of the group has 10 tokens"), out
        assert "max_tokens_per_rank=8" in out["error"], out
        assert out["after"] == (8, 128), out  # no collective was issued: the next step runs


def _graph_worker(rank: int, world_size: int) -> dict[str, Any]:
    device = torch.device("cuda", rank)
    runner = DBORunner(_stack("symm_mem", device, capacity=64), SPLIT, group=dist.group.WORLD)
    # a2a_ll's triton experts see as many rows (W*C) as symm_mem's: the same tiles.
    reference = DBORunner(_stack("a2a_ll", device, capacity=64), SPLIT, group=dist.group.WORLD)
    graphed = GraphedRunner(runner)
    out: dict[str, Any] = {"same": [], "as_a2a_ll": []}
    with torch.no_grad():
        for tokens, seed in ((40 + 8 * rank, 1), (40 + 8 * rank, 2), (4 + rank, 3),
                             (4 + rank, 4)):  # prefill-sized, then decode-sized
            x = _inputs(tokens, seed + 10 * rank, device)
            got = graphed(x)
            out["same"].append(torch.equal(got, runner(x)))
            out["as_a2a_ll"].append(torch.equal(got, reference(x)))
        out["split"] = graphed.last_decision.split
        out["captures"] = graphed.num_captures
    torch.cuda.synchronize()
    return out


def test_graphed_dbo_steps_replay_the_eager_results():
    for out in run_distributed(2, _graph_worker, backend="nccl"):
        assert out["same"] == [True] * 4 and out["as_a2a_ll"] == [True] * 4, out
        assert out["split"] and out["captures"] == 2, out


def _soak_worker(rank: int, world_size: int, steps: int) -> dict[str, Any]:
    device = torch.device("cuda", rank)
    capacity = 48
    model = _stack("symm_mem", device, capacity=capacity)
    runner = DBORunner(model, SPLIT, group=dist.group.WORLD)
    rng = random.Random(7 + rank)
    out: dict[str, Any] = {}
    with torch.no_grad():
        for seed in range(4):  # warm up: the largest step, split and not, and zero tokens
            runner(_inputs((capacity, 1, 0, capacity // 2)[seed], seed, device))
        torch.cuda.synchronize()
        allocated, allocations = torch.cuda.memory_allocated(device), _workspace_allocations(model)
        for step in range(steps):
            runner(_inputs(rng.randint(0, capacity), 100 + step, device))
        torch.cuda.synchronize()
        out["allocated"] = (allocated, torch.cuda.memory_allocated(device))
        out["allocations"] = (allocations, _workspace_allocations(model))
    out["sets"] = num_shared_sets(dist.group.WORLD)
    return out


def test_random_size_steps_keep_memory_flat():
    for out in run_distributed(2, _soak_worker, 200, backend="nccl"):
        assert out["allocated"][1] == out["allocated"][0], out
        assert out["allocations"][1] == out["allocations"][0], out
        assert out["sets"] == 2, out  # both layers share one set per ubatch


def _deepep_ll_after_worker(rank: int, world_size: int) -> dict[str, Any]:
    """symm_mem runs a step (its symmetric buffers start NVSHMEM), then a deepep_ll layer
    is made in the same process: refused with RuntimeError, not DeepEP's abort."""
    from moe.layer import MoELayer
    from moe.reference import init_moe_weights
    device = torch.device("cuda", rank)
    cfg = MoEConfig(num_experts=8, top_k=2, hidden_size=2048, intermediate_size=64,
                    dtype=torch.bfloat16, max_tokens_per_rank=16, experts="triton")
    out: dict[str, Any] = {}
    with torch.no_grad():
        layer = MoELayer(replace(cfg, backend="symm_mem"), group=dist.group.WORLD,
                         device=device)
        layer.load_weights(init_moe_weights(replace(cfg, backend="symm_mem"), seed=0,
                                            device=device))
        gen = torch.Generator(device=device).manual_seed(rank)
        layer(torch.randn(8, 2048, generator=gen, device=device).to(torch.bfloat16))
        torch.cuda.synchronize()
        try:
            MoELayer(replace(cfg, backend="deepep_ll"), group=dist.group.WORLD, device=device)
            out["error"] = "no error"
        except RuntimeError as exc:
            out["error"] = str(exc)
    dist.barrier()
    return out


@pytest.mark.skipif(importlib.util.find_spec("deep_ep") is None, reason="needs DeepEP")
def test_deepep_ll_after_symm_mem_is_refused_not_aborted():
    for out in run_distributed(2, _deepep_ll_after_worker, backend="nccl"):
        assert out["error"].startswith("backend 'deepep_ll' would make a DeepEP low-latency "
                                       "buffer in a process where backend 'symm_mem' has "
                                       "started NVSHMEM"), out
