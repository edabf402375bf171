"""Layer 4 (GPU, two processes over NCCL): `deepep_v2` against the real DeepEP v2
`ElasticBuffer`, both modes, DBO on and off, a rank with no tokens, and decode mode
replayed as a CUDA graph. Skipped unless two GPUs, `deep_ep.ElasticBuffer` and an NCCL
>= 2.30.4 loaded in the process are present (DeepEP v2 needs peers: on one rank its own
`tests/elastic/test_ep.py` crashes in the dispatch, as this layer does; H200, NCCL 2.30.7).

Run on a GPU machine: `python -m pytest -q -m gpu tests/moe/test_deepep_v2_gpu.py`.
"""
from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.distributed as dist

from moe.backends.deepep_v2 import MIN_NCCL, DeepEPV2Options
from moe.backends.nccl_comm import torch_nccl_version
from moe.config import MoEConfig
from moe.layer import MoELayer
from moe.reference import init_moe_weights
from tests.dist_utils import run_distributed
from tests.moe.gpu_reference import off_and_on_errors

TOL = 4e-2  # bfloat16 (DeepEP v2 moves bf16 only): 8-bit mantissa, one rounding per sum


def _why_not() -> str:
    if torch.cuda.device_count() < 2:
        return "needs two CUDA devices"
    if importlib.util.find_spec("deep_ep") is None:
        return "needs deep_ep"
    import deep_ep
    if not hasattr(deep_ep, "ElasticBuffer"):
        return "needs deep_ep.ElasticBuffer (DeepEP v2)"
    version = torch_nccl_version()
    if version is None or version < MIN_NCCL:
        return f"needs NCCL >= 2.30.4 loaded, this process runs {version}"
    return ""


def real_v2(rank: int, world_size: int, mode: str) -> dict:
    device = torch.device("cuda", rank)
    torch.manual_seed(7 + rank)
    cfg = MoEConfig(num_experts=8, top_k=2, hidden_size=128, intermediate_size=64,
                    dtype=torch.bfloat16, max_tokens_per_rank=64, experts="reference",
                    backend="deepep_v2", backend_options=DeepEPV2Options(mode=mode))
    layer = MoELayer(cfg, group=dist.group.WORLD, device=device)
    weights = init_moe_weights(cfg, seed=3, device=device)
    layer.load_weights(weights)
    errors = {}
    for tokens in ((37, 11), (0, 24)):
        x = torch.randn(tokens[rank], cfg.hidden_size, device=device, dtype=cfg.dtype)
        errors[tokens] = off_and_on_errors(layer, weights, cfg, x)
    return errors


@pytest.mark.gpu
@pytest.mark.multigpu
@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_real_elastic_buffer_matches_reference(mode):
    reason = _why_not()
    if reason:
        pytest.skip(reason)
    for rank, errors in enumerate(run_distributed(2, real_v2, mode, backend="nccl")):
        for tokens, errs in errors.items():
            assert max(errs) <= TOL, (rank, tokens, errs)


def graphed_decode(rank: int, world_size: int) -> float:
    """Decode mode captured in a CUDA graph and replayed on new inputs: the largest
    difference from the same layer run eagerly on those inputs, relative to its largest
    value."""
    device = torch.device("cuda", rank)
    torch.manual_seed(11 + rank)
    cfg = MoEConfig(num_experts=8, top_k=2, hidden_size=128, intermediate_size=64,
                    dtype=torch.bfloat16, max_tokens_per_rank=64, experts="reference",
                    backend="deepep_v2", backend_options=DeepEPV2Options(mode="decode"))
    layer = MoELayer(cfg, group=dist.group.WORLD, device=device)
    layer.load_weights(init_moe_weights(cfg, seed=5, device=device))
    static_x = torch.randn(32, cfg.hidden_size, device=device, dtype=cfg.dtype)
    with torch.no_grad():
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            layer(static_x)  # warm up outside the capture
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = layer(static_x)
        worst = 0.0
        for _ in range(3):
            x = torch.randn_like(static_x)
            static_x.copy_(x)
            graph.replay()
            eager = layer(x)
            torch.cuda.synchronize()
            scale = max(eager.float().abs().max().item(), 1.0)
            worst = max(worst, (static_out.float() - eager.float()).abs().max().item() / scale)
    return worst


@pytest.mark.gpu
@pytest.mark.multigpu
def test_real_elastic_buffer_decode_replays_as_a_cuda_graph():
    reason = _why_not()
    if reason:
        pytest.skip(reason)
    for rank, worst in enumerate(run_distributed(2, graphed_decode, backend="nccl")):
        # the same kernels on the same inputs; DeepEP's combine may sum a token's rows
        # from several ranks in arrival order, so allow bf16's rounding of that sum
        assert worst <= TOL, (rank, worst)
