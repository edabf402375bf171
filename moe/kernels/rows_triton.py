"""The Triton kernels of `moe.kernels.rows` (see there), and their launchers.

Import this module only after TRITON_INTERPRET is settled: Triton reads it when the
kernels are defined. Nothing is compiled or launched at import.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe.kernels.launch import FastLauncher, cdiv, next_power_of_2

_BLOCK_ROWS = 4  # rows per program
_BLOCK_COLS = 1024  # hidden columns per program


@triton.jit
def pack_rows_kernel(
    src_ptr,  # int64 [X]: token of each packed row, < 0 = padding row
    x_ptr,  # [T, H]
    ids_ptr,  # int64 [T, K], contiguous
    weights_ptr,  # float32 [T, K], contiguous
    dst_ids_ptr,  # int64 view [X, K] of the packed rows
    dst_weights_ptr,  # float32 view [X, K]
    dst_x_ptr,  # x-dtype view [X, H]
    num_rows,  # X
    H,
    stride_x,
    stride_dst_ids,
    stride_dst_weights,
    stride_dst_x,
    TOP_K: tl.constexpr,
    TOP_K_POW2: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """BLOCK_R packed rows x BLOCK_H hidden columns; column block 0 also writes the ids
    and weights. Padding rows get ids -1 and zero weights and x."""
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_mask = offs_r < num_rows
    src = tl.load(src_ptr + offs_r, mask=r_mask, other=-1)
    valid = src >= 0
    token = tl.where(valid, src, 0).to(tl.int64)
    dst_r = offs_r.to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = offs_h[None, :] < H
    x = tl.load(x_ptr + token[:, None] * stride_x + offs_h[None, :],
                mask=valid[:, None] & h_mask, other=0.0)
    tl.store(dst_x_ptr + dst_r[:, None] * stride_dst_x + offs_h[None, :], x,
             mask=r_mask[:, None] & h_mask)
    if tl.program_id(1) == 0:
        offs_k = tl.arange(0, TOP_K_POW2)
        k_mask = offs_k[None, :] < TOP_K
        load_mask = valid[:, None] & k_mask
        ids = tl.load(ids_ptr + token[:, None] * TOP_K + offs_k[None, :], mask=load_mask,
                      other=-1)
        weights = tl.load(weights_ptr + token[:, None] * TOP_K + offs_k[None, :],
                          mask=load_mask, other=0.0)
        store_mask = r_mask[:, None] & k_mask
        tl.store(dst_ids_ptr + dst_r[:, None] * stride_dst_ids + offs_k[None, :], ids,
                 mask=store_mask)
        tl.store(dst_weights_ptr + dst_r[:, None] * stride_dst_weights + offs_k[None, :],
                 weights, mask=store_mask)


@triton.jit
def sum_rows_kernel(
    rows_ptr,  # [R, H]
    sel_ptr,  # int64 [T, W], contiguous: a row index (SEL_IS_ROW) or an expert id
    out_ptr,  # [T, H]
    num_tokens,
    H,
    stride_rows,
    stride_out,
    WIDTH: tl.constexpr,  # W
    SEL_IS_ROW: tl.constexpr,  # True: row sel[t, w]; False: row t*W + w (the k-sum)
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """out[t] = sum over w with sel[t, w] >= 0 of the selected row, in w order, in fp32."""
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    t_mask = offs_t < num_tokens
    h_mask = offs_h[None, :] < H
    acc = tl.zeros((BLOCK_T, BLOCK_H), dtype=tl.float32)
    for w in tl.static_range(WIDTH):
        sel = tl.load(sel_ptr + offs_t * WIDTH + w, mask=t_mask, other=-1)
        if SEL_IS_ROW:
            rows = tl.where(sel >= 0, sel, 0)
        else:
            rows = offs_t * WIDTH + w
        y = tl.load(rows_ptr + rows.to(tl.int64)[:, None] * stride_rows + offs_h[None, :],
                    mask=(sel >= 0)[:, None] & h_mask, other=0.0)
        acc += y.to(tl.float32)
    out = out_ptr + offs_t.to(tl.int64)[:, None] * stride_out + offs_h[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=t_mask[:, None] & h_mask)


_PACK = FastLauncher(pack_rows_kernel)
_SUM = FastLauncher(sum_rows_kernel)


def _grid(num_rows: int, hidden: int) -> tuple[tuple[int, int], int]:
    """((row blocks, column blocks), BLOCK_H) for `num_rows` rows of `hidden` columns."""
    block_h = min(_BLOCK_COLS, next_power_of_2(hidden))
    return (cdiv(num_rows, _BLOCK_ROWS), cdiv(hidden, block_h)), block_h


def launch_pack_rows(dst_ids_XK: torch.Tensor, dst_weights_XK: torch.Tensor,
                     dst_x_XH: torch.Tensor, x_TH: torch.Tensor, topk_ids_TK: torch.Tensor,
                     topk_weights_TK: torch.Tensor, src_X: torch.Tensor, *,
                     compiled: bool = True) -> None:
    """`pack_rows_kernel` over the X rows of the three field views, on the current stream
    (`compiled`: launched through its compiled handle, `moe.kernels.launch`)."""
    num_rows, hidden = dst_x_XH.shape
    top_k = dst_ids_XK.shape[1]
    grid, block_h = _grid(num_rows, hidden)
    _PACK(
        grid,
        src_X.contiguous(), x_TH, topk_ids_TK.contiguous(), topk_weights_TK.contiguous(),
        dst_ids_XK, dst_weights_XK, dst_x_XH, num_rows, hidden, x_TH.stride(0),
        dst_ids_XK.stride(0), dst_weights_XK.stride(0), dst_x_XH.stride(0),
        TOP_K=top_k, TOP_K_POW2=next_power_of_2(top_k),
        BLOCK_R=_BLOCK_ROWS, BLOCK_H=block_h, compiled=compiled,
    )


def launch_sum_rows(rows_RH: torch.Tensor, sel_TW: torch.Tensor, out_TH: torch.Tensor, *,
                    sel_is_row: bool, compiled: bool = True) -> None:
    """`sum_rows_kernel` into out_TH [T, H], on the current stream (`compiled`: as in
    `launch_pack_rows`)."""
    num_tokens, width = sel_TW.shape
    hidden = out_TH.shape[1]
    grid, block_h = _grid(num_tokens, hidden)
    _SUM(
        grid,
        rows_RH, sel_TW.contiguous(), out_TH, num_tokens, hidden, rows_RH.stride(0),
        out_TH.stride(0), WIDTH=width, SEL_IS_ROW=sel_is_row,
        BLOCK_T=_BLOCK_ROWS, BLOCK_H=block_h, compiled=compiled,
    )
