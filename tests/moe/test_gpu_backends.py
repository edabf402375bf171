"""Layer 4 (GPU, skipped without CUDA): the backends over NCCL on two GPUs, and the real
compute/comm streams of a DBO step on one GPU.

Run on a GPU machine: `python -m pytest tests/moe/test_gpu_backends.py -q`.
"""
from __future__ import annotations

from dataclasses import replace
import pytest
import torch
import torch.distributed as dist

from dbo import UBatchScheduler
from moe.config import MoEConfig
from moe.layer import MoELayer
from moe.reference import init_moe_weights, reference_moe
from moe.shared import SharedExperts
from tests.dist_utils import run_distributed

ATOL = 1e-4  # fp32 on GPU: TF32 is off by default for matmul; only summation order differs


def nccl_backend_check(rank: int, world_size: int, backend: str, experts: str) -> dict:
    device = torch.device("cuda", rank)
    torch.manual_seed(100 + rank)
    results = {}
    for tokens, shared in (((37, 11), True), ((0, 24), False), ((1, 1), False)):
        cfg = MoEConfig(num_experts=8, top_k=2, hidden_size=64, intermediate_size=32,
                        num_shared_experts=1 if shared else 0, max_tokens_per_rank=64)
        layer = MoELayer(replace(cfg, backend=backend, experts=experts), group=dist.group.WORLD,
                         device=device)
        weights = init_moe_weights(cfg, seed=3, device=device)
        layer.load_weights(weights)
        shared_mod = None
        if shared:
            shared_mod = SharedExperts.from_config(cfg, seed=4, device=device)
            layer.shared_experts.load_state_dict(shared_mod.state_dict())
        x = torch.randn(tokens[rank], cfg.hidden_size, device=device)
        ref = reference_moe(x, router_weight_EH=weights["router_weight"], w13_EIH=weights["w13"],
                            w2_EHI=weights["w2"], config=cfg, shared_experts=shared_mod)
        with torch.no_grad():
            off = layer(x)
            half = x.shape[0] // 2
            sched = UBatchScheduler(device)
            on = torch.cat(sched.run([lambda: layer(x[:half]), lambda: layer(x[half:])]))
            joined = torch.cat(sched.run([lambda: layer(x[:half]), lambda: layer(x[half:])],
                                         joined_experts=True))
            layer.last_layer = True  # a2a/a2a_ll: the split combine of the last ubatch
            on_split = torch.cat(sched.run([lambda: layer(x[:half]),
                                            lambda: layer(x[half:])]))
            torch.cuda.synchronize()
            comm_used = sched.streams.comm != sched.streams.compute
        err = lambda a: (a - ref).abs().max().item() if a.numel() else 0.0  # noqa: E731
        results[tokens] = (err(off), err(on), err(on_split), err(joined), comm_used)
    return results


@pytest.mark.gpu
@pytest.mark.multigpu
@pytest.mark.parametrize("backend,experts", [("naive", "reference"), ("a2a", "reference"),
                                             ("a2a_ll", "reference"), ("a2a", "triton"),
                                             ("a2a_ll", "triton")])
def test_backends_over_nccl_match_reference(backend, experts):
    for rank, res in enumerate(run_distributed(2, nccl_backend_check, backend, experts,
                                               backend="nccl")):
        for tokens, (*errors, comm_used) in res.items():
            assert comm_used
            assert max(errors) <= ATOL, (rank, tokens, errors)  # off, on, split, joined


@pytest.mark.gpu
def test_dbo_step_on_gpu_uses_two_streams_and_matches():
    device = torch.device("cuda")
    cfg = MoEConfig(num_experts=4, top_k=2, hidden_size=64, intermediate_size=32)
    layer = MoELayer(replace(cfg, experts="reference"), device=device)
    layer.load_weights(init_moe_weights(cfg, seed=0, device=device))
    x = torch.randn(32, 64, device=device)
    seen = []

    def ub(sl):
        def run():
            from dbo import dbo_switch_to_comm, dbo_yield_and_switch_from_comm_to_compute
            out = layer(x[sl])
            dbo_switch_to_comm()
            seen.append(torch.cuda.current_stream())
            dbo_yield_and_switch_from_comm_to_compute()
            seen.append(torch.cuda.current_stream())
            return out
        return run

    caller = torch.cuda.current_stream()
    with torch.no_grad():
        sched = UBatchScheduler(device)
        on = torch.cat(sched.run([ub(slice(0, 16)), ub(slice(16, 32))]))
        off = layer(x)
    assert seen[0] == sched.streams.comm and seen[1] == sched.streams.comm
    assert seen[2] == caller and seen[3] == caller
    assert torch.cuda.current_stream() == caller
    torch.testing.assert_close(on, off, atol=ATOL, rtol=ATOL)
