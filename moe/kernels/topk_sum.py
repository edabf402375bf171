"""`weighted_topk_sum`: the top-k weighting and reduction over k in torch, shared by the
torch expert kernels (`moe.experts`) and the fused-MoE host's post-expert-norm path
(`moe.kernels.fused_moe.host`).

Shape legend: N rows (tokens), K top-k, H hidden, R rows of expert outputs.
"""
from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["weighted_topk_sum"]


def weighted_topk_sum(
    y_RH: Tensor,
    topk_ids_NK: Tensor,
    topk_weights_NK: Tensor,
    *,
    out_dtype: torch.dtype,
    row_of_slot_NK: Tensor | None = None,
) -> Tensor:
    """The top-k weighting and reduction over k, shared by all torch expert kernels.

    ``out[n] = sum_k w[n, k] * y[row(n, k)]`` over slots with ``ids[n, k] >= 0``, in float32
    and in a fixed order (k ascending), so the result is deterministic.

    Args:
        y_RH: [R, H] expert outputs, any floating dtype. Rows of dropped slots (id -1) may
            hold garbage, NaN included: they are masked, not multiplied by 0.
        topk_ids_NK: int64 [N, K]; only the sign (-1 = dropped) is read.
        topk_weights_NK: float32 [N, K].
        out_dtype: dtype of the result.
        row_of_slot_NK: int64 [N, K] row of ``y`` holding slot (n, k); None means the
            identity layout ``row = n * K + k`` (then R = N * K).

    Returns:
        [N, H] ``out_dtype``, a fresh tensor.
    """
    num_rows, top_k = topk_ids_NK.shape
    hidden = y_RH.shape[1]
    acc_NH = torch.zeros(num_rows, hidden, dtype=torch.float32, device=y_RH.device)
    if num_rows == 0:
        return acc_NH.to(out_dtype)
    valid_NK = topk_ids_NK >= 0
    weights_NK = torch.where(valid_NK, topk_weights_NK.float(), 0.0)
    y_NKH = y_RH.view(num_rows, top_k, hidden) if row_of_slot_NK is None else None
    for k in range(top_k):
        if y_NKH is not None:
            y_NH = y_NKH[:, k]
        else:
            assert row_of_slot_NK is not None
            y_NH = y_RH.index_select(0, row_of_slot_NK[:, k])
        y_NH = torch.where(valid_NK[:, k, None], y_NH.float(), 0.0)
        acc_NH.addcmul_(y_NH, weights_NK[:, k, None])
    return acc_NH.to(out_dtype)
