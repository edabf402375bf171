"""Token-row movers for the dispatch/combine backends and the expert k-sum.

Shape legend: T tokens, W rows per token (ranks, or top-k), H hidden, X packed rows,
B bytes per packed row (`moe.row_layout.RowLayout`).

    pack_rows(rows_XB, layout, x, ids, weights, src_X)
        rows[s] = [ids[t] | weights[t] | x[t]]  for t = src[s] >= 0,
                  [-1 ... | 0 ...      | 0 ...] for src[s] < 0 (a padding row)
    sum_rows(rows_RH, sel_TW)
        out[t]  = sum over w with sel[t, w] >= 0 of rows[sel[t, w]]   (a gather-sum)

The expert k-sum (`moe.kernels.fused_moe.host.sum_routed_rows`) is the same kernel, reading
row t*W + w where ids[t, w] >= 0 (`moe.kernels.rows_triton`).

Sums accumulate in fp32, w in order, and round once to the rows' dtype. On CUDA each
call is one Triton kernel that reads each source row once and writes each output row
once. The torch versions (CPU, and the reference in tests) give the same results with a
few torch ops. What the kernels replaced on the GPU, per layer at 4096 tokens on 2x H200
(a profiler trace, 2026-11): `a2a_ll`'s index_put_ of uint8 rows
and a cumulative sum down a [T, W] column, 0.9 ms per dispatch; the combines' fp32
index_add_ or gather, convert and sum, 0.6 ms (`a2a`) and 0.4 ms (`a2a_ll`).

`KernelPolicy.implementation` picks the path (`moe.kernels.policy`). Triton is imported
on first use, so importing this module never needs it.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from moe.kernels.policy import KernelPolicy, triton_module, use_triton
from moe.row_layout import RowLayout


def pack_rows(rows_XB: Tensor, layout: RowLayout, x_TH: Tensor, topk_ids_TK: Tensor,
              topk_weights_TK: Tensor, src_X: Tensor, *,
              policy: KernelPolicy = KernelPolicy()) -> None:
    """Write token src[s]'s packed row into rows[s] (a padding row where src[s] < 0).

    rows_XB: uint8 [X, B], rows 16-byte aligned; src_X: int64 [X], values < T (not
    range-checked: that would sync); x_TH's last dim contiguous.
    """
    if rows_XB.shape[0] != src_X.shape[0]:
        raise ValueError(f"pack_rows: {rows_XB.shape[0]} rows but {src_X.shape[0]} sources")
    if rows_XB.shape[0] == 0:
        return
    ids_XK, weights_XK, x_XH = layout.unpack(rows_XB)
    pack_row_fields(ids_XK, weights_XK, x_XH, x_TH, topk_ids_TK, topk_weights_TK, src_X,
                    policy=policy)


def pack_row_fields(ids_XK: Tensor, weights_XK: Tensor, x_XH: Tensor, x_TH: Tensor,
                    topk_ids_TK: Tensor, topk_weights_TK: Tensor, src_X: Tensor, *,
                    policy: KernelPolicy = KernelPolicy()) -> None:
    """`pack_rows` into the three field views of X packed rows (`RowLayout.unpack`), for
    a caller that keeps those views of a buffer that never moves: unpacking is six view
    ops per call, each a host cost on CUDA. Same contract as `pack_rows`."""
    if src_X.shape[0] == 0:
        return
    if x_TH.shape[0] == 0:  # nothing to pack: every row is padding
        ids_XK.fill_(-1)
        weights_XK.zero_()
        x_XH.zero_()
        return
    if not use_triton(policy, x_XH):
        valid_X1 = (src_X >= 0)[:, None]
        token_X = src_X.clamp(min=0)
        ids_XK.copy_(torch.where(valid_X1, topk_ids_TK[token_X], -1))
        weights_XK.copy_(topk_weights_TK[token_X] * valid_X1)
        x_XH.copy_(torch.where(valid_X1, x_TH[token_X], 0))
        return
    _triton().launch_pack_rows(ids_XK, weights_XK, x_XH, x_TH, topk_ids_TK, topk_weights_TK,
                               src_X, compiled=policy.compiled_launches)


def sum_rows(rows_RH: Tensor, sel_TW: Tensor, *,
             policy: KernelPolicy = KernelPolicy()) -> Tensor:
    """out[t] = sum over w with sel[t, w] >= 0 of rows[sel[t, w]]: fp32, w in order, then
    rows' dtype; zeros where nothing is selected. sel_TW: int64 [T, W], values < R (not
    range-checked); rows' last dim contiguous. Returns a fresh [T, H] tensor."""
    num_tokens, width = sel_TW.shape
    hidden = rows_RH.shape[1]
    out_TH = torch.empty(num_tokens, hidden, dtype=rows_RH.dtype, device=rows_RH.device)
    if num_tokens == 0:
        return out_TH
    if not use_triton(policy, rows_RH):
        valid_TW = sel_TW >= 0
        picked = rows_RH.index_select(0, sel_TW.clamp(min=0).reshape(-1))
        picked = picked.view(num_tokens, width, hidden).float()
        out_TH.copy_(torch.where(valid_TW[..., None], picked, 0.0).sum(dim=1))
        return out_TH
    _triton().launch_sum_rows(rows_RH, sel_TW, out_TH, sel_is_row=True,
                              compiled=policy.compiled_launches)
    return out_TH


def _triton() -> Any:
    return triton_module("moe.kernels.rows_triton")
