"""Layer 4 (GPU, NCCL): `nccl_ep` against the real NCCL EP (`nccl.ep`), both forms, on one
GPU (an EP group of one rank) and on two: DBO off and on against the reference, a rank
with no tokens, a layer replayed as a CUDA graph, and graphed DBO steps of a two-layer
stack against the same steps run eagerly. Skipped unless nccl-extensions and an NCCL
>= 2.29 loaded in the process are present.

Run on a GPU machine: `python -m pytest -q -m gpu tests/moe/test_nccl_ep_gpu.py`.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from dbo import DBOConfig, DBORunner
from dbo.graphs import GraphedRunner
from moe.backends import NCCLEPOptions
from moe.backends.nccl_comm import torch_nccl_version
from moe.backends.nccl_ep_support import MIN_NCCL, nccl_ep_installed
from moe.config import MoEConfig
from moe.layer import MoELayer
from moe.reference import init_moe_weights
from tests.dist_utils import run_distributed
from tests.moe.gpu_reference import off_and_on_errors

TOL = 4e-2  # bfloat16 (the form measured): 8-bit mantissa, one rounding per sum
MODES = ("ll", "ht")
SPLIT = DBOConfig(split="tokens", min_decode_tokens=2, min_prefill_tokens=2)


def _skip_unless_ready(world_size: int) -> None:
    """Skip unless this machine has `world_size` GPUs, nccl.ep and an NCCL >= 2.29 loaded."""
    if torch.cuda.device_count() < world_size:
        pytest.skip(f"needs {world_size} CUDA devices")
    if not nccl_ep_installed():
        pytest.skip("needs nccl.ep (pip install nccl-extensions)")
    version = torch_nccl_version()
    if version is None or version < MIN_NCCL:
        pytest.skip(f"needs NCCL >= 2.29 loaded, this process runs {version}")


def _config(mode: str, **kw) -> MoEConfig:
    base = dict(num_experts=8, top_k=2, hidden_size=512, intermediate_size=64,
                dtype=torch.bfloat16, max_tokens_per_rank=64, experts="reference",
                backend="nccl_ep", backend_options=NCCLEPOptions(mode=mode))
    return MoEConfig(**{**base, **kw})


def exact(rank: int, world_size: int, mode: str) -> dict:
    device = torch.device("cuda", rank)
    torch.manual_seed(7 + rank)
    cfg = _config(mode)
    layer = MoELayer(cfg, group=dist.group.WORLD, device=device)
    weights = init_moe_weights(cfg, seed=3, device=device)
    layer.load_weights(weights)
    errors = {}
    for tokens in ((37, 11), (0, 24), (64, 64)):
        x = torch.randn(tokens[rank], cfg.hidden_size, device=device, dtype=cfg.dtype)
        errors[tokens] = off_and_on_errors(layer, weights, cfg, x)
    return errors


@pytest.mark.gpu
@pytest.mark.parametrize("world_size", [1, pytest.param(2, marks=pytest.mark.multigpu)])
@pytest.mark.parametrize("mode", MODES)
def test_nccl_ep_matches_the_reference(mode, world_size):
    _skip_unless_ready(world_size)
    for rank, errors in enumerate(run_distributed(world_size, exact, mode, backend="nccl")):
        for tokens, errs in errors.items():
            assert max(errs) <= TOL, (rank, tokens, errs)


def graphed(rank: int, world_size: int, mode: str) -> dict:
    """One layer captured in a CUDA graph and replayed on new inputs, and graphed DBO
    steps of a two-layer stack: the largest difference from the same work run eagerly,
    relative to its largest value."""
    from dbo.cli.bench.layer_stack import LayerStack
    device = torch.device("cuda", rank)
    torch.manual_seed(11 + rank)
    cfg = _config(mode, experts="triton")  # the reference experts read ids on the host
    layer = MoELayer(cfg, group=dist.group.WORLD, device=device)
    layer.load_weights(init_moe_weights(cfg, seed=5, device=device))
    static_x = torch.randn(32, cfg.hidden_size, device=device, dtype=cfg.dtype)
    worst = {"layer": 0.0, "dbo": 0.0}

    def note(kind: str, got: torch.Tensor, eager: torch.Tensor) -> None:
        scale = max(eager.float().abs().max().item(), 1.0)
        worst[kind] = max(worst[kind], (got.float() - eager.float()).abs().max().item() / scale)

    with torch.no_grad():
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            layer(static_x)  # warm up outside the capture: handles and groups are made
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = layer(static_x)
        for _ in range(3):
            x = torch.randn_like(static_x)
            static_x.copy_(x)
            graph.replay()
            note("layer", static_out, layer(x))
        stack = LayerStack(replace(cfg, num_shared_experts=1), num_layers=2,
                           attn_context=64, group=dist.group.WORLD, device=device)
        stack.init_weights(seed=5)
        runner = DBORunner(stack, SPLIT, group=dist.group.WORLD)
        steps = GraphedRunner(runner)
        for seed in (1, 2):
            gen = torch.Generator(device=device).manual_seed(seed + rank)
            x = torch.randn(40 + 8 * rank, cfg.hidden_size, generator=gen,
                            device=device).to(cfg.dtype)
            note("dbo", steps(x), runner(x))
        worst["split"] = bool(steps.last_decision.split)
    torch.cuda.synchronize()
    return worst


@pytest.mark.gpu
@pytest.mark.parametrize("world_size", [1, pytest.param(2, marks=pytest.mark.multigpu)])
@pytest.mark.parametrize("mode", MODES)
def test_nccl_ep_replays_as_cuda_graphs(mode, world_size):
    _skip_unless_ready(world_size)
    for rank, worst in enumerate(run_distributed(world_size, graphed, mode, backend="nccl")):
        # the same kernels on the same inputs; a combine may add a token's rows from
        # several ranks in arrival order, so allow bf16's rounding of that sum
        assert worst["split"], worst
        assert worst["layer"] <= TOL and worst["dbo"] <= TOL, (rank, worst)


def raw_and_adapter(rank: int, world_size: int) -> dict:
    """`dbo bench-comm`'s engines for NCCL EP (raw calls and the backend in both forms) on
    the same inputs, with the rows dispatched sent back as the expert outputs: each
    engine's combine against what that identity gives, relative to its largest value."""
    from moe.bench.comm_engines import Shapes, make_source
    device = torch.device("cuda", rank)
    shapes = Shapes(hidden=512, top_k=2, num_experts=8, dtype=torch.bfloat16)
    gen = torch.Generator(device=device).manual_seed(3 + rank)
    x = torch.randn(24, shapes.hidden, generator=gen, device=device).to(shapes.dtype)
    ids = torch.rand(24, shapes.num_experts, generator=gen, device=device).topk(2).indices
    weights = torch.softmax(torch.rand(24, 2, generator=gen, device=device), 1)
    per_rank = shapes.num_experts // world_size
    num_ranks = torch.tensor([len(set((row // per_rank).tolist())) for row in ids],
                             device=device)
    expected = {"ll": x.float() * weights.sum(1, keepdim=True),  # weighted on receipt
                "ht": x.float() * num_ranks.unsqueeze(1)}  # one unweighted row per rank
    errors = {}
    for name, form in (("nccl_ep_raw_ll", "ll"), ("nccl_ep_raw_ht", "ht"),
                       ("nccl_ep", "ll"), ("nccl_ep:mode=ht", "ht")):
        source = make_source(name, shapes, dist.group.WORLD, tokens=(24,))
        engine = source.bind(x, weights, ids)
        with torch.no_grad():
            out = engine.combine(engine.dispatch())
        torch.cuda.synchronize()
        want = expected[form]
        errors[name] = ((out.float() - want).abs().max() / want.abs().max()).item()
        source.close()
    return errors


@pytest.mark.gpu
@pytest.mark.parametrize("world_size", [1, pytest.param(2, marks=pytest.mark.multigpu)])
def test_bench_comm_engines_of_nccl_ep_return_what_they_sent(world_size):
    _skip_unless_ready(world_size)
    for rank, errors in enumerate(run_distributed(world_size, raw_and_adapter, backend="nccl")):
        assert max(errors.values()) <= TOL, (rank, errors)
