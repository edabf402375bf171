"""`ReferenceExperts`: a per-expert loop in float32, the ground truth for the other kernels.

Shape legend: N rows, K top-k, E local experts, H hidden, I intermediate, S = N * K slots,
M slots routed to one expert.

Slow on purpose: one host sync per expert, float32 copies of the weights. Use it in tests
and to check a fast kernel, not in a benchmark. Computes every form of `moe.experts.form`
(biases, activations, no gate, interleaved gate/up, a post-expert norm).
"""
from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor

from dbo.compiling import graph_break
from moe.experts.base import Experts, check_expert_inputs, weighted_topk_sum
from moe.experts.form import ExpertExtras, activate
from moe.workspace import Workspace

__all__ = ["ReferenceExperts"]


class ReferenceExperts(Experts):
    """Loop over local experts: gather the rows routed to e, two float32 GEMMs, the form's
    activation (SiLU gate by default)."""

    name: ClassVar[str] = "reference"

    @classmethod
    def is_available(cls, device: torch.device) -> tuple[bool, str]:
        """Runs wherever torch runs."""
        return True, ""

    @graph_break  # it reads the ids on the host: eager under torch.compile
    def apply(self, x_NH: Tensor, w13_EIH: Tensor, w2_EHI: Tensor, topk_ids_NK: Tensor,
              topk_weights_NK: Tensor, *, workspace: Workspace | None = None,
              extras: ExpertExtras | None = None, sms_shared: bool = False) -> Tensor:
        """See `Experts.apply`. Ignores ``workspace`` and ``sms_shared``; raises ValueError on
        ids out of range."""
        check_expert_inputs(x_NH, w13_EIH, w2_EHI, topk_ids_NK, topk_weights_NK, extras)
        num_rows, hidden = x_NH.shape
        top_k = topk_ids_NK.shape[1]
        num_experts = w13_EIH.shape[0]
        bias13_EJ = bias2_EH = None
        if extras is not None and extras.form.bias:
            bias13_EJ, bias2_EH = extras.bias13_EJ, extras.bias2_EH
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
            h_MJ = x_MH @ w13_EIH[e].float().t()
            if bias13_EJ is not None:
                h_MJ = h_MJ + bias13_EJ[e].float()
            y_MH = activate(h_MJ, extras) @ w2_EHI[e].float().t()
            if bias2_EH is not None:
                y_MH = y_MH + bias2_EH[e].float()
            if extras is not None and extras.post_norm is not None:
                y_MH = extras.post_norm(y_MH).float()
            y_SH[slots_M] = y_MH
        return weighted_topk_sum(y_SH, topk_ids_NK, topk_weights_NK, out_dtype=x_NH.dtype)
