"""Layer 4 (GPU, two NCCL ranks, DeepEP installed; skipped otherwise): `deepep_ht` and
`deepep_ll` on DeepEP's real kernels, against the dense reference with DBO off and on,
with a zero-token rank and with every token sent to one expert; CUDA-graph capture
(`deepep_ll`; `deepep_ht` in its worst-case form) replaying the eager results; and each
low-latency receive hook run exactly once.

Run on a GPU machine with the DeepEP wheel installed:
`python -m pytest -q -m gpu tests/moe/test_deepep_backends.py`.

Tolerance: the layer runs in bfloat16 (Triton experts: the gate/up output, the
activation and each weighted expert row are rounded to bf16, 8 mantissa bits) where the
reference computes in float32 and rounds once, so outputs may differ by a few bf16 ulps
of the output scale: 4e-2 of it, as tests/moe/triton_problems.py allows for bf16.
"""
from __future__ import annotations

import importlib.util
from dataclasses import replace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dbo import DBOConfig, DBORunner, UBatchScheduler
from dbo.graphs import GraphedRunner
from moe.backends.deepep_ht import DeepEPHTOptions
from moe.config import MoEConfig
from moe.layer import MoELayer
from moe.reference import init_moe_weights, reference_moe
from tests.dist_utils import run_distributed

pytestmark = [
    pytest.mark.gpu, pytest.mark.multigpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                       reason="needs 2 GPUs"),
    pytest.mark.skipif(importlib.util.find_spec("deep_ep") is None,
                       reason="needs DeepEP (deep_ep); see docs/backends.md"),
]

REL_TOL = 4e-2
SPLIT = DBOConfig(split="tokens", min_decode_tokens=2, min_prefill_tokens=2)


def _to_expert_5(logits_TE: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every token to expert 5 (on rank 1) with weight 1; its other slot dropped."""
    num_tokens = logits_TE.shape[0]
    ids = torch.tensor([5, -1], device=logits_TE.device).expand(num_tokens, top_k)
    weights = torch.tensor([1.0, 0.0], device=logits_TE.device).expand(num_tokens, top_k)
    return weights.contiguous(), ids.contiguous()


def _config(backend: str, **kw: Any) -> MoEConfig:
    return MoEConfig(num_experts=8, top_k=2, hidden_size=2048, intermediate_size=256,
                     dtype=torch.bfloat16, backend=backend, experts="triton",
                     max_tokens_per_rank=64, **kw)


class _OneLayer(nn.Module):
    def __init__(self, layer: MoELayer) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x_TH: torch.Tensor) -> torch.Tensor:
        return self.layer(x_TH)


def _count_hooks() -> dict[str, Any]:
    """Wrap DeepEP's low-latency calls (in this process) so that every receive hook asked
    for (`return_recv_hook=True`, inside a DBO step) counts its runs. Outside a DBO step
    the adapter asks for none, and DeepEP's returned placeholder is never run."""
    import deep_ep

    counts: dict[str, Any] = {"sent": 0, "runs": []}
    for name in ("low_latency_dispatch", "low_latency_combine"):
        original = getattr(deep_ep.Buffer, name)

        def wrapped(self, *args, _original=original, **kwargs):
            result = list(_original(self, *args, **kwargs))
            if not kwargs.get("return_recv_hook", False):
                return tuple(result)
            hook, slot = result[-1], len(counts["runs"])
            counts["sent"] += 1
            counts["runs"].append(0)

            def counted() -> None:
                counts["runs"][slot] += 1
                hook()

            result[-1] = counted
            return tuple(result)

        setattr(deep_ep.Buffer, name, wrapped)
    return counts


def _worker(rank: int, world_size: int, backend: str, worst: bool) -> dict[str, Any]:
    from moe.backends.deepep_support import destroy_buffers

    device = torch.device("cuda", rank)
    counts = _count_hooks() if backend == "deepep_ll" else None
    torch.manual_seed(100 + rank)
    options = DeepEPHTOptions(worst_case_dispatch=worst) if backend == "deepep_ht" else None
    out: dict[str, Any] = {}
    base = _config(backend, backend_options=options)
    cases = {"mixed": (base, (37, 11)), "zero_tokens": (base, (0, 24)),
             "one_expert": (replace(base, custom_routing_function=_to_expert_5), (20, 9))}
    layers = []
    for case, (cfg, tokens) in cases.items():
        layer = MoELayer(cfg, group=dist.group.WORLD, device=device)
        weights = init_moe_weights(cfg, seed=3, device=device)
        layer.load_weights(weights)
        layers.append(layer)
        x = torch.randn(tokens[rank], cfg.hidden_size, device=device, dtype=cfg.dtype)
        ref = reference_moe(x, router_weight_EH=weights["router_weight"],
                            w13_EIH=weights["w13"], w2_EHI=weights["w2"], config=cfg)
        with torch.no_grad():
            off = layer(x)
            half = x.shape[0] // 2
            sched = UBatchScheduler(device)
            on = torch.cat(sched.run([lambda: layer(x[:half]), lambda: layer(x[half:])]))
            joined = torch.cat(sched.run([lambda: layer(x[:half]), lambda: layer(x[half:])],
                                         joined_experts=True))
        torch.cuda.synchronize()
        scale = max(1.0, ref.float().abs().max().item()) if ref.numel() else 1.0
        err = lambda a: (a.float() - ref.float()).abs().max().item() if a.numel() else 0.0  # noqa: E731
        out[case] = (err(off) / scale, err(on) / scale, err(joined) / scale, tuple(off.shape),
                     tuple(on.shape), tuple(joined.shape))

    if backend == "deepep_ll" or worst:
        model = _OneLayer(layers[0])
        runner = DBORunner(model, SPLIT, group=dist.group.WORLD)
        graphed = GraphedRunner(runner)
        with torch.no_grad():
            same = []
            for seed in (1, 2):
                torch.manual_seed(seed + 10 * rank)
                x = torch.randn(40 + 8 * rank, 2048, device=device, dtype=torch.bfloat16)
                same.append(torch.equal(graphed(x), runner(x)))
        torch.cuda.synchronize()
        out["graph"] = (same, graphed.num_captures, graphed.last_decision.split)
    if counts is not None:
        out["hooks"] = (counts["sent"], sorted(set(counts["runs"])))
    torch.cuda.synchronize()
    dist.barrier()
    destroy_buffers(dist.group.WORLD)
    return out


@pytest.mark.parametrize("backend,worst", [("deepep_ht", False), ("deepep_ht", True),
                                           ("deepep_ll", False)])
def test_deepep_backend_matches_reference_dbo_off_and_on(backend, worst):
    for rank, out in enumerate(run_distributed(2, _worker, backend, worst, backend="nccl")):
        for case in ("mixed", "zero_tokens", "one_expert"):
            err_off, err_on, err_joined, *shapes = out[case]
            assert len(set(shapes)) == 1, (rank, case, out[case])
            assert max(err_off, err_on, err_joined) <= REL_TOL, (rank, case, out[case])
        if backend == "deepep_ll" or worst:
            same, captures, split = out["graph"]
            assert same == [True, True] and captures == 1 and split, (rank, out["graph"])
        if backend == "deepep_ll":
            sent, runs = out["hooks"]
            assert sent > 0 and runs == [1], (rank, out["hooks"])  # every hook exactly once
