"""`ReferenceExperts`: a per-expert loop in float32, the ground truth for the other kernels.

Shape legend: N rows, K top-k, E local experts, H hidden, I intermediate, S = N * K slots,
M slots routed to one expert.

Slow on purpose: one host sync per expert, float32 copies of the weights. Use it in tests
and to check a fast kernel, not in a benchmark.
"""
from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from moe.experts.base import Experts, check_expert_inputs, weighted_topk_sum
from moe.workspace import Workspace

__all__ = ["ReferenceExperts"]


class ReferenceExperts(Experts):
    """Loop over local experts: gather the rows routed to e, two float32 GEMMs, SiLU gate."""

    name: ClassVar[str] = "reference"

    @classmethod
    def is_available(cls, device: torch.device) -> tuple[bool, str]:
        """Runs wherever torch runs."""
        return True, ""

    def apply(
        self,
        x_NH: Tensor,
        w13_EIH: Tensor,
        w2_EHI: Tensor,
        topk_ids_NK: Tensor,
        topk_weights_NK: Tensor,
        *,
        workspace: Workspace | None = None,
    ) -> Tensor:
        """See `Experts.apply`. Ignores ``workspace``; raises ValueError on ids out of range."""
        check_expert_inputs(x_NH, w13_EIH, w2_EHI, topk_ids_NK, topk_weights_NK)
        num_rows, hidden = x_NH.shape
        top_k = topk_ids_NK.shape[1]
        num_experts, inter = w13_EIH.shape[0], w2_EHI.shape[2]
        ids_S = topk_ids_NK.reshape(-1)
        if ids_S.numel() > 0:
            low, high = int(ids_S.min()), int(ids_S.max())
            if low < -1 or high >= num_experts:
                raise ValueError(
                    f"ReferenceExperts: topk_ids span [{low}, {high}] but must be local ids in "
                    f"[0, {num_experts}) or -1: map global ids with the expert map first."
                )
        # Slot outputs in the identity layout; slots of other ranks (-1) stay zero.
        y_SH = torch.zeros(num_rows * top_k, hidden, dtype=torch.float32, device=x_NH.device)
        for e in range(num_experts):
            slots_M = (ids_S == e).nonzero().squeeze(1)
            if slots_M.numel() == 0:
                continue
            x_MH = x_NH.index_select(0, slots_M // top_k).float()
            h_M2I = x_MH @ w13_EIH[e].float().t()
            act_MI = F.silu(h_M2I[:, :inter]) * h_M2I[:, inter:]
            y_SH[slots_M] = act_MI @ w2_EHI[e].float().t()
        return weighted_topk_sum(y_SH, topk_ids_NK, topk_weights_NK, out_dtype=x_NH.dtype)
