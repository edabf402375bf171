"""The expert benchmarks' problems: the shapes, random weights and tokens (uniform or
balanced routing, with or without expert parallelism), and the bytes a call must move.
Shared by `moe.bench.experts`, `moe.bench.tune` and `moe.bench.host`.

Shape legend: T tokens (N rows), H hidden, I intermediate, K top-k, E local experts.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from moe.bench.baselines import gemm_flops

# name -> (hidden H, intermediate I, top-k K, local experts E)
SHAPES: dict[str, tuple[int, int, int, int]] = {
    "ds-e8": (7168, 2048, 8, 8),  # DeepSeek-V3 experts, EP 32
    "ds-e32": (7168, 2048, 8, 32),  # EP 8
    "ds-e128": (7168, 2048, 8, 128),  # EP 2 (11 GB of bf16 expert weights)
    "qwen-e128": (2048, 768, 8, 128),  # Qwen3-30B-A3B-like, all experts on one rank
    "tiny": (64, 32, 2, 4),  # smoke runs (CPU interpreter)
}


def min_bytes(tokens: int, hidden: int, inter: int, top_k: int, experts: int, elem: int) -> int:
    """x + ids (int64) + weights (fp32) + w13 + w2 + output + the [T*K, I] activation."""
    return (
        tokens * hidden * elem
        + tokens * top_k * (8 + 4)
        + 3 * experts * hidden * inter * elem
        + tokens * hidden * elem
        + tokens * top_k * inter * elem
    )


@dataclass(frozen=True)
class Problem:
    """Inputs of one point."""

    shape: str
    x_NH: torch.Tensor
    w13_EIH: torch.Tensor
    w2_EHI: torch.Tensor
    topk_ids_NK: torch.Tensor
    topk_weights_NK: torch.Tensor
    min_gb: float
    local_rows: int  # routed rows with a local expert (all T*K without EP)

    @property
    def tokens(self) -> int:
        return self.x_NH.shape[0]

    @property
    def flops(self) -> float:
        """FLOPs of the expert MLPs over the local rows."""
        _, hidden, inter = self.w2_EHI.shape
        return gemm_flops(self.local_rows, hidden, inter, 1)


def random_weights(shape: str, dtype: torch.dtype, gen: torch.Generator
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(w13 [E, 2I, H], w2 [E, H, I]) of `shape`, unit-variance outputs, on gen's device."""
    hidden, inter, _, num_experts = SHAPES[shape]
    device = gen.device
    w13 = torch.randn(num_experts, 2 * inter, hidden, dtype=dtype, device=device, generator=gen)
    w2 = torch.randn(num_experts, hidden, inter, dtype=dtype, device=device, generator=gen)
    return w13.mul_(hidden**-0.5), w2.mul_(inter**-0.5)


def random_tokens(shape: str, tokens: int, dtype: torch.dtype, gen: torch.Generator,
                  ep_ranks: int = 1, routing: str = "uniform",
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x [T, H], topk_weights [T, K] float32 summing to 1, topk_ids [T, K]): uniform
    routing to K distinct experts, on gen's device. `ep_ranks` W > 1: K of W * E experts,
    this rank holding the first E; other ids are -1, and every token has a local one
    (tokens without one are drawn again: the dispatch would not have sent them).
    `routing="balanced"` (W = 1 only): `balanced_ids`, random weights."""
    hidden, _, top_k, num_experts = SHAPES[shape]
    device = gen.device
    x = torch.randn(tokens, hidden, dtype=dtype, device=device, generator=gen)
    scores = torch.rand(tokens, num_experts * ep_ranks, device=device, generator=gen)
    topk_weights, topk_ids = scores.topk(top_k, dim=1)
    if routing == "balanced":
        if ep_ranks != 1:
            raise ValueError(f"balanced routing is for one rank, got ep_ranks={ep_ranks}")
        topk_ids = balanced_ids(tokens, top_k, num_experts, device)
    if ep_ranks > 1:
        while not_here := (topk_ids >= num_experts).all(dim=1).nonzero().view(-1).tolist():
            redraw = torch.rand(len(not_here), num_experts * ep_ranks, device=device,
                                generator=gen).topk(top_k, dim=1)
            topk_weights[not_here], topk_ids[not_here] = redraw.values, redraw.indices
        topk_ids = topk_ids.masked_fill(topk_ids >= num_experts, -1)
    return x, (topk_weights / topk_weights.sum(1, keepdim=True)).float(), topk_ids


def balanced_ids(tokens: int, top_k: int, num_experts: int, device: torch.device
                 ) -> torch.Tensor:
    """int64 [T, K]: ids[n, k] = (n*K + k) mod E. A token's K ids are distinct (K <= E)
    and every expert gets T*K/E rows, rounded down or up: no expert has a short last
    block unless T*K/E is not a multiple of the block (a diagnostic for padding costs,
    not a router's output)."""
    if top_k > num_experts:
        raise ValueError(f"balanced routing needs top-k <= experts, got {top_k} > {num_experts}")
    flat = torch.arange(tokens * top_k, device=device)
    return (flat % num_experts).view(tokens, top_k)
