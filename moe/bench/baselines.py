"""GEMM-only baselines of the expert benchmark: the experts' FLOPs with no routing at all.

Legend: T tokens, R rows (routed rows with a local expert), E local experts, m rows per
expert, H hidden, I intermediate. Both chains run GEMM1 into [., 2I], take its first I
columns (no activation) and run GEMM2 into [., H]; both read rows of the point's own x.

- `dense_chain` ("dense"): `torch.matmul` on [R, H] x [H, 2I] then [R, I] x [I, H] with
  ONE expert's weights. The same FLOPs as the experts, without the weight traffic of E
  experts or any routing: the GEMM ceiling that issue 4's target is set against.
- `batched_chain` ("bmm"): `torch.bmm` over the E experts, m = ceil(R / E) rows each,
  every expert with its own weights: a grouped GEMM with perfectly balanced, pre-sorted
  rows and no gather, padding, activation or k-sum. It pays the weight traffic of E
  experts and runs each expert's GEMMs at m rows, so its share of dense is what cuBLAS's
  batched GEMMs reach at this point before any cost of routing.

Nothing here is a path of the MoE layer: neither output is the experts' output.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch


class GemmChain(NamedTuple):
    """A baseline made ready: `fn()` runs both GEMMs; `min_gb` is what it needs at least
    (rows in, weights, both outputs); `flops` its own FLOPs; `note` its table note."""

    fn: Callable[[], torch.Tensor]
    min_gb: float
    flops: float
    note: str


def gemm_flops(rows: int, hidden: int, inter: int, top_k: int) -> float:
    """FLOPs of the expert MLPs over `rows` tokens routed to `top_k` experts each:
    GEMM1 [rows*K, H] x [H, 2I], GEMM2 [rows*K, I] x [I, H]."""
    return 2.0 * rows * top_k * 3 * hidden * inter


def activation_rows(x_TH: torch.Tensor, num_rows: int) -> torch.Tensor:
    """[num_rows, H]: each row of x repeated in place, as many times as it takes (a token's
    top-k copies sit together, as in the routed rows)."""
    repeats = -(-num_rows // max(x_TH.shape[0], 1))
    return x_TH.repeat_interleave(repeats, dim=0)[:num_rows]


def dense_chain(x_TH: torch.Tensor, w13_EIH: torch.Tensor, w2_EHI: torch.Tensor, *,
                rows: int) -> GemmChain:
    """The experts' FLOPs over `rows` routed rows as one GEMM chain on expert 0's weights."""
    inter, hidden = w2_EHI.shape[2], x_TH.shape[1]
    a_RH = activation_rows(x_TH, rows)
    w1_HI2, w2_IH = w13_EIH[0].t(), w2_EHI[0].t()

    def fn() -> torch.Tensor:
        return torch.matmul(torch.matmul(a_RH, w1_HI2)[:, :inter], w2_IH)

    elems = a_RH.numel() + w1_HI2.numel() + w2_IH.numel() + rows * (2 * inter + hidden)
    return GemmChain(fn, elems * x_TH.element_size() / 1e9,
                     gemm_flops(rows, hidden, inter, 1), "one expert's weights, same FLOPs")


def batched_chain(x_TH: torch.Tensor, w13_EIH: torch.Tensor, w2_EHI: torch.Tensor, *,
                  rows: int) -> GemmChain:
    """`rows` routed rows spread evenly over the E experts (ceil(rows / E) each) as two
    batched GEMMs on every expert's own weights."""
    num_experts, inter, hidden = w2_EHI.shape[0], w2_EHI.shape[2], x_TH.shape[1]
    per_expert = -(-rows // num_experts)
    a_EmH = activation_rows(x_TH, num_experts * per_expert).view(num_experts, per_expert, hidden)
    w13_EHI2, w2_EIH = w13_EIH.transpose(1, 2), w2_EHI.transpose(1, 2)

    def fn() -> torch.Tensor:
        return torch.bmm(torch.bmm(a_EmH, w13_EHI2)[:, :, :inter], w2_EIH)

    total = num_experts * per_expert
    elems = a_EmH.numel() + w13_EIH.numel() + w2_EHI.numel() + total * (2 * inter + hidden)
    return GemmChain(fn, elems * x_TH.element_size() / 1e9,
                     gemm_flops(total, hidden, inter, 1),
                     f"ceiling: {per_expert} rows x {num_experts} experts, no routing")


BASELINES: dict[str, Callable[..., GemmChain]] = {"dense": dense_chain, "bmm": batched_chain}
