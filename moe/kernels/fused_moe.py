"""Fused MoE expert GEMMs in Triton: gathered rows x per-expert weights, per row block.

One kernel serves both GEMMs of an expert MLP; constexpr flags pick the epilogue:

    GEMM1 (GATED):             act[r]  = silu(x[r // K] @ gate_e^T) * (x[r // K] @ up_e^T)
    GEMM2 (MUL_ROUTED_WEIGHT): y[r]    = topk_weight[r] * (act[r] @ w2_e^T)
    then                       out[n]  = sum over k with id[n, k] >= 0 of y[n*K + k]
                               (`sum_routed_rows`, fp32 accumulation, k in order)

where r = n*K + k is a flat routed row and e = topk_ids[n, k]. Rows are visited in the
expert-sorted, BLOCK_M-padded order p from `moe.kernels.align_triton`, so each program
multiplies BLOCK_M rows of one expert by a BLOCK_N slice of that expert's weights. GEMM1
writes act in that sorted order ([P, I]), so GEMM2 reads contiguous row blocks. Every
output row is written by exactly one program and the k-sum adds in a fixed order: the
result is deterministic (no atomics). Rows of ids routed to other ranks (-1) are neither
computed, written nor read: under expert parallelism they are half or more of the rows.

Load paths (constexpr flags, chosen per GEMM by the host, see `fused_moe`): pointer loads;
TMA (tensor descriptors, Hopper and newer) for the weight tiles and for A when A is in the
sorted order; GEMM1 gathers x rows by pointer, or reads x copied into the sorted order
first (`gather_rows`), which pays only when x is much larger than L2 and GEMM1 runs
one program per tile.

Tile heights (`gemm_tiles`): on 128-row routing blocks GEMM1 may run 64-row tiles (a
tile of padding rows returns at once), and GEMM2 runs a half-height copy of its tile for
an expert's last block when that block is at most half used (`HALF_TAIL`). A GEMM2 last
block of at most `TAIL_M` rows rides on the expert's block before it instead, as a
second, swapped tile on the same weight loads (`TAIL_M`).

Schedule: one program per tile here; for large batches outside DBO the host may run a
GEMM as `moe.kernels.fused_moe_persistent` instead (one program per SM over a table of
the used tiles; `prefer_persistent`).

Legend (host side): N tokens, K top-k, H hidden, I intermediate, E local experts,
R = N*K routed rows, P padded rows. Inside the kernel M/N/K are the GEMM's own sizes.

Import this module only after TRITON_INTERPRET is settled: Triton reads it when the kernel
is defined. Nothing is compiled or launched at import.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from moe.experts.base import check_expert_inputs
from moe.kernels.align import AlignedRouting
from moe.kernels.align_triton import align_routing_triton
from moe.kernels.fused_moe_persistent import launch_persistent
from moe.kernels.launch import AutotunedLauncher, FastLauncher
from moe.kernels.moe_tile import (gate_up_descriptor, gate_up_dot, gemm_role, split_gate_up,
                                  store_tile, use_tma_scratch)
from moe.kernels.rows_triton import launch_sum_rows
from moe.workspace import Workspace, empty_from

# Fixed tile for CPU tensors (the interpreter): autotuning there would take minutes.
_INTERPRETER_CONFIG = {"BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 2}
_SMEM_BYTES = 220 * 1024  # H100/H200 allow 227 KiB per block; keep a margin.


@triton.jit
def fused_moe_kernel(
    # Pointers
    a_ptr,  # A rows: x [N_tok, K] (gathered), or [P, K] in sorted row order (A_SORTED)
    b_ptr,  # expert weights [E, rows, K]: w13 [E, 2N, K] (GATED) or w2 [E, N, K]
    c_ptr,  # output: [R, N] by flat routed id, or [P, N] in sorted row order (C_SORTED)
    topk_weights_ptr,  # float32 [N_tok, K] (row stride stride_wn); MUL_ROUTED_WEIGHT only
    # Routing from moe.kernels.align
    sorted_ids_ptr,  # int32 [P]: flat routed id per row, `num_routed` = padding
    block_expert_ids_ptr,  # int32 [P // BLOCK_M]: expert per row block, -1 = dropped/idle
    num_padded_rows_ptr,  # int32 [1]: rows in use; later blocks return at once
    # GEMM sizes: C[R, N] = A[R, K] @ B_e[N, K]^T
    N,
    K,
    num_routed,  # R, also the padding sentinel
    max_padded_rows,  # P, the launch bound (a multiple of BLOCK_M)
    rows_bucket,  # next power of two of P: autotune key only (unused in the body)
    num_experts,  # E: the extent of B's descriptor (USE_TMA)
    weights_top_k,  # K of the routing weights: routed id r is weight [r // K, r % K]
    # Strides
    stride_am,
    stride_ak,
    stride_be,
    stride_bn,
    stride_bk,
    stride_cm,
    stride_cn,
    stride_wn,  # routing weights' row stride (they may be a view into packed rows)
    # Epilogue / addressing switches
    A_ROWS_DIV: tl.constexpr,  # gathered A row = routed id // A_ROWS_DIV (top-k for x)
    A_SORTED: tl.constexpr,  # A row = sorted row (act, or x gathered by `gather_rows`)
    C_SORTED: tl.constexpr,  # C row = sorted row (the [P, I] activation)
    USE_TMA: tl.constexpr,  # load B, and A when A_SORTED, through tensor descriptors
    GATED: tl.constexpr,  # B holds gate rows [0, N) then up rows [N, 2N): silu(g) * u
    MUL_ROUTED_WEIGHT: tl.constexpr,  # scale each row by its routing weight
    ZERO_DROPPED: tl.constexpr,  # write zero rows for blocks of expert -1 (torch k-sum)
    HALF_TAIL: tl.constexpr,  # a block whose lower half is padding does half the math
    TAIL_M: tl.constexpr,  # > 0 (not GATED): an expert's last block of <= TAIL_M used
    # rows is computed by the block before it (BLOCK_M == ROUTE_BLOCK_M)
    # Tiles
    ROUTE_BLOCK_M: tl.constexpr,  # the routing's block (its layout); a multiple of BLOCK_M
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,  # M blocks per group, so neighbours reuse a weight tile in L2
    INPUT_PRECISION: tl.constexpr,  # tl.dot precision for fp32 inputs: "ieee" or "tf32"
):
    """One [BLOCK_M, BLOCK_N] tile: C[r, n] = epilogue(sum_k A[r, k] * B[e, n, k]) for the
    BLOCK_M rows r of one expert-e block (GATED: B rows n and N + n).

    Shapes: B [E, N or 2N, K], topk weights [N_tok, top-k] fp32 (row stride stride_wn);
    A and C as the flags say. The 1-D
    grid is cdiv(P, BLOCK_M) * cdiv(N, BLOCK_N) programs in grouped order. A tile may be
    shorter than the routing's blocks (BLOCK_M < ROUTE_BLOCK_M, dividing it): it reads
    its expert from the block that holds it, and a tile of padding rows only returns.
    Accumulates in fp32. With USE_TMA the weight tile is one TMA copy of rows
    [e*rows + n0, +BLOCK_N): past an expert's last row it reads the next expert's (or
    zeros past the tensor), and those columns are dropped by the store mask, as the
    wrapped columns are without TMA. GATED with USE_TMA, the gate and up rows of the
    column block load as one [2, BLOCK_N, BLOCK_K] box of w13 viewed [E * 2, N, K]
    (zeros past an expert's last row) and multiply as one dot twice as wide, as in
    `moe.kernels.fused_moe_persistent`.

    HALF_TAIL: an expert's rows come first in its segment and padding fills the rest, so
    when the block's row BLOCK_M // 2 is padding, so is every row after it: the block's
    last-block-of-an-expert case. Such a block multiplies only its upper BLOCK_M // 2
    rows (a second, half-height copy of the tile code), instead of spending up to half
    of its math on padding. The lower half of a sorted C is then left unwritten (padding
    rows are never summed).

    TAIL_M (GEMM2): a block whose row TAIL_M is padding holds at most TAIL_M rows and is
    its expert's last. When the block before it belongs to the same expert, that block
    computes these rows too, on the weight tiles it loads anyway, and the short block
    returns at once: the short block would otherwise stream a whole weight tile for a few
    rows. The tail's dot is swapped, (B_e A_tail^T)^T, so that the weight columns are the
    MMA's M (warpgroup MMA needs 64) and the tail's TAIL_M rows its N. (In GEMM1 the
    second accumulator took the kernel to 255 registers and was slower, in every form
    tried: BENCHMARKS.md section 2, sessions 18 and 19.)
    """
    # Grouped ordering: walk GROUP_M row blocks down one column of tiles before moving on.
    pid = tl.program_id(axis=0)
    num_pid_m = tl.cdiv(max_padded_rows, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m

    # The grid is sized for the worst case; the true row count is only known on device.
    if pid_m * BLOCK_M >= tl.load(num_padded_rows_ptr):
        return

    row0 = pid_m * BLOCK_M
    expert = tl.load(block_expert_ids_ptr + row0 // ROUTE_BLOCK_M).to(tl.int64)
    if expert < 0:
        # Rows routed to other ranks: no math. Zero rows only for the torch k-sum, which
        # reads all K rows of a token (SKIP_DROPPED_ROWS off).
        if ZERO_DROPPED:
            offs_m = row0 + tl.arange(0, BLOCK_M)
            row_ids = tl.load(sorted_ids_ptr + offs_m)
            offs_cn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            c_ptrs = (c_ptr + row_ids.to(tl.int64)[:, None] * stride_cm
                      + offs_cn[None, :] * stride_cn)
            c_mask = (row_ids < num_routed)[:, None] & (offs_cn[None, :] < N)
            zeros = tl.zeros((BLOCK_M, BLOCK_N), dtype=c_ptr.dtype.element_ty)
            tl.store(c_ptrs, zeros, mask=c_mask)
        return
    if BLOCK_M < ROUTE_BLOCK_M:
        # A tile in the padded tail of an expert's segment: nothing to compute or write.
        if tl.load(sorted_ids_ptr + row0) >= num_routed:
            return

    with_tail = False
    if TAIL_M > 0:
        tl.static_assert(BLOCK_M == ROUTE_BLOCK_M and not GATED)
        block = row0 // ROUTE_BLOCK_M
        last_block = max_padded_rows // ROUTE_BLOCK_M - 1
        short = tl.load(sorted_ids_ptr + row0 + TAIL_M) >= num_routed
        prev_expert = tl.load(block_expert_ids_ptr + tl.maximum(block - 1, 0))
        if short & (block > 0) & (prev_expert == expert):
            return  # the block before computes these rows
        next_row = row0 + BLOCK_M
        next_expert = tl.load(block_expert_ids_ptr + tl.minimum(block + 1, last_block))
        next_short = tl.load(
            sorted_ids_ptr + tl.minimum(next_row + TAIL_M, max_padded_rows - 1)) >= num_routed
        with_tail = ((next_row < tl.load(num_padded_rows_ptr)) & (next_expert == expert)
                     & next_short)
    half_used = False
    if HALF_TAIL:
        half_used = tl.load(sorted_ids_ptr + row0 + BLOCK_M // 2) >= num_routed
    if with_tail:
        _expert_tile(
            a_ptr, b_ptr, c_ptr, topk_weights_ptr, sorted_ids_ptr, row0, pid_n, expert,
            N, K, num_routed, max_padded_rows, num_experts, weights_top_k,
            stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn,
            stride_wn,
            A_ROWS_DIV, A_SORTED, C_SORTED, USE_TMA, GATED, MUL_ROUTED_WEIGHT,
            BLOCK_M, BLOCK_N, BLOCK_K, INPUT_PRECISION, TAIL_M)
    elif half_used:
        _expert_tile(
            a_ptr, b_ptr, c_ptr, topk_weights_ptr, sorted_ids_ptr, row0, pid_n, expert,
            N, K, num_routed, max_padded_rows, num_experts, weights_top_k,
            stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn,
            stride_wn,
            A_ROWS_DIV, A_SORTED, C_SORTED, USE_TMA, GATED, MUL_ROUTED_WEIGHT,
            BLOCK_M // 2, BLOCK_N, BLOCK_K, INPUT_PRECISION, 0)
    else:
        _expert_tile(
            a_ptr, b_ptr, c_ptr, topk_weights_ptr, sorted_ids_ptr, row0, pid_n, expert,
            N, K, num_routed, max_padded_rows, num_experts, weights_top_k,
            stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn,
            stride_wn,
            A_ROWS_DIV, A_SORTED, C_SORTED, USE_TMA, GATED, MUL_ROUTED_WEIGHT,
            BLOCK_M, BLOCK_N, BLOCK_K, INPUT_PRECISION, 0)


@triton.jit
def _expert_tile(
    a_ptr, b_ptr, c_ptr, topk_weights_ptr, sorted_ids_ptr,
    row0,  # first sorted row of the tile
    pid_n,  # column block of the output
    expert,  # int64, >= 0
    N, K, num_routed, max_padded_rows, num_experts, weights_top_k,
    stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn, stride_wn,
    A_ROWS_DIV: tl.constexpr,
    A_SORTED: tl.constexpr,
    C_SORTED: tl.constexpr,
    USE_TMA: tl.constexpr,
    GATED: tl.constexpr,
    MUL_ROUTED_WEIGHT: tl.constexpr,
    BM: tl.constexpr,  # rows of this tile: BLOCK_M, or BLOCK_M // 2 for a half-used block
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    TAIL: tl.constexpr,  # > 0 (not GATED): also the TAIL rows from row0 + BM, swapped
):
    """The body of `fused_moe_kernel` for the BM sorted rows from `row0` (with TAIL, also
    the next block's first TAIL rows, on the same weight loads): k-loop, epilogue and
    store (see there for the arguments)."""
    offs_m = row0 + tl.arange(0, BM)
    row_ids = tl.load(sorted_ids_ptr + offs_m)
    row_mask = row_ids < num_routed

    offs_k = tl.arange(0, BLOCK_K)
    if A_SORTED:
        a_rows = offs_m.to(tl.int64)
        a_row_mask = offs_m >= 0  # every sorted row below num_padded_rows exists
    else:
        a_rows = (row_ids // A_ROWS_DIV).to(tl.int64)
        a_row_mask = row_mask
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :] * stride_ak
    # Weight columns wrap around N so loads stay in bounds; the store mask drops them.
    offs_bn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
    b_ptrs = b_ptr + expert * stride_be + offs_bn[None, :] * stride_bn + offs_k[:, None] * stride_bk
    up_ptrs = b_ptrs + N * stride_bn
    if USE_TMA:
        if GATED:
            b_desc = gate_up_descriptor(b_ptr, num_experts, N, K, stride_bn, BLOCK_N, BLOCK_K)
            expert32 = expert.to(tl.int32)
        else:
            b_desc = tl.make_tensor_descriptor(
                b_ptr, shape=[num_experts * N, K], strides=[stride_bn, 1],
                block_shape=[BLOCK_N, BLOCK_K])
            b_row = (expert * N + pid_n * BLOCK_N).to(tl.int32)
        if A_SORTED:
            a_desc = tl.make_tensor_descriptor(
                a_ptr, shape=[max_padded_rows, K], strides=[stride_am, 1],
                block_shape=[BM, BLOCK_K])

    if TAIL > 0:
        offs_t = row0 + BM + tl.arange(0, TAIL)
        row_ids_t = tl.load(sorted_ids_ptr + offs_t)
        if A_SORTED:
            a_rows_t = offs_t.to(tl.int64)
            a_row_mask_t = offs_t >= 0
        else:
            a_rows_t = (row_ids_t // A_ROWS_DIV).to(tl.int64)
            a_row_mask_t = row_ids_t < num_routed
        a_ptrs_t = a_ptr + a_rows_t[:, None] * stride_am + offs_k[None, :] * stride_ak
        if USE_TMA and A_SORTED:
            a_desc_t = tl.make_tensor_descriptor(
                a_ptr, shape=[max_padded_rows, K], strides=[stride_am, 1],
                block_shape=[TAIL, BLOCK_K])
        acc_t = tl.zeros((BLOCK_N, TAIL), dtype=tl.float32)  # swapped: [columns, rows]

    acc = tl.zeros((BM, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BM, BLOCK_N), dtype=tl.float32)  # GATED only (else unused)
    acc_pair = tl.zeros((BM, 2 * BLOCK_N), dtype=tl.float32)  # GATED on TMA only
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_mask = offs_k < K - k * BLOCK_K
        if USE_TMA and A_SORTED:
            a = a_desc.load([row0, k * BLOCK_K])
        else:
            a = tl.load(a_ptrs, mask=a_row_mask[:, None] & k_mask[None, :], other=0.0)
        if TAIL > 0:
            if USE_TMA and A_SORTED:
                a_t = a_desc_t.load([row0 + BM, k * BLOCK_K])
            else:
                a_t = tl.load(a_ptrs_t, mask=a_row_mask_t[:, None] & k_mask[None, :], other=0.0)
                a_ptrs_t += BLOCK_K * stride_ak
        if USE_TMA and GATED:
            acc_pair = gate_up_dot(b_desc, a, acc_pair, expert32, pid_n * BLOCK_N,
                                   k * BLOCK_K, BLOCK_N, BLOCK_K, INPUT_PRECISION)
        else:
            if USE_TMA:
                b = b_desc.load([b_row, k * BLOCK_K]).T
            else:
                b = tl.load(b_ptrs, mask=k_mask[:, None], other=0.0)
            acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
            if TAIL > 0:
                acc_t = tl.dot(b.T, a_t.T, acc_t, input_precision=INPUT_PRECISION)
            if GATED:
                up = tl.load(up_ptrs, mask=k_mask[:, None], other=0.0)
                acc_up = tl.dot(a, up, acc_up, input_precision=INPUT_PRECISION)
                up_ptrs += BLOCK_K * stride_bk
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    if USE_TMA and GATED:
        acc, acc_up = split_gate_up(acc_pair, BM, BLOCK_N)

    store_tile(acc, acc_up, c_ptr, topk_weights_ptr, offs_m, row_ids, pid_n,
               N, num_routed, weights_top_k, stride_cm, stride_cn, stride_wn,
               C_SORTED, GATED, MUL_ROUTED_WEIGHT, BLOCK_N)
    if TAIL > 0:
        store_tile(acc_t.T, acc_t.T, c_ptr, topk_weights_ptr, offs_t, row_ids_t, pid_n,
                   N, num_routed, weights_top_k, stride_cm, stride_cn, stride_wn,
                   C_SORTED, GATED, MUL_ROUTED_WEIGHT, BLOCK_N)


@triton.jit
def gather_rows_kernel(
    src_ptr,  # [N_tok, H]
    dst_ptr,  # [P, H]: row p = src[sorted_ids[p] // ROWS_DIV], zeros for padding rows
    sorted_ids_ptr,  # int32 [P]
    num_padded_rows_ptr,  # int32 [1]
    num_routed,
    H,
    stride_src,
    stride_dst,
    ROWS_DIV: tl.constexpr,
    BLOCK_R: tl.constexpr,  # divides BLOCK_M, so a block is wholly used or wholly idle
    BLOCK_H: tl.constexpr,
):
    """Copy the routed rows of x into the sorted order (GEMM1's A for TMA loads)."""
    pid_r = tl.program_id(0)
    if pid_r * BLOCK_R >= tl.load(num_padded_rows_ptr):
        return
    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ids = tl.load(sorted_ids_ptr + offs_r)
    valid = ids < num_routed
    src = src_ptr + (ids // ROWS_DIV).to(tl.int64)[:, None] * stride_src + offs_h[None, :]
    h_mask = offs_h[None, :] < H
    rows = tl.load(src, mask=valid[:, None] & h_mask, other=0.0)
    dst = dst_ptr + offs_r.to(tl.int64)[:, None] * stride_dst + offs_h[None, :]
    tl.store(dst, rows, mask=h_mask)


# (BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages) per regime. Few rows per block
# (decode) is weight-bandwidth bound: wide loads, 4 warps, deep pipelines. Full blocks are
# tensor-core bound. The large-block list holds the winners of `python -m moe.tune_experts`
# on an H200 (DeepSeek-V3 and Qwen3 expert shapes, 2048-16384 tokens, BLOCK_M 64 and 128;
# then, with the TMA and sorted-x load variants, BLOCK_M 128):
# GEMM1 (gated, two accumulators) mostly wins with 64-128 wide tiles, GEMM2 with 256; a
# larger GROUP_M (more row blocks share a weight tile in L2) gained up to 15% at some points.
# GEMM1 in 64-row tiles (`gemm_tiles`) wins with 256 wide ones (the last two rows).
_SMALL_M_TILES = ((64, 64, 8, 4, 4), (64, 128, 8, 4, 4), (128, 64, 8, 4, 4), (128, 128, 8, 8, 3))
_LARGE_M_TILES = (
    (64, 64, 1, 4, 3),
    (64, 64, 8, 8, 3),
    (64, 64, 16, 4, 3),
    (128, 64, 8, 4, 3),
    (128, 64, 8, 4, 5),
    (128, 64, 16, 8, 3),
    (128, 64, 16, 8, 4),
    (128, 64, 32, 8, 3),
    (128, 64, 32, 8, 4),
    (256, 64, 8, 4, 4),
    (256, 64, 8, 8, 4),
    (256, 64, 16, 8, 3),
    (256, 64, 32, 8, 4),
    (128, 64, 8, 8, 3),
    (256, 64, 8, 8, 3),
    (256, 64, 32, 8, 3),
)


def autotune_configs(block_m: int | None = None) -> list[triton.Config]:
    """GPU tile candidates for `block_m` (BLOCK_M is picked by the host from the row
    count); all regimes when None. `_prune_configs` then drops the ones that do not fit
    the GEMM, the shared memory or the register file, before anything compiles."""
    if block_m is None:
        tiles = dict.fromkeys(_SMALL_M_TILES + _LARGE_M_TILES)
    else:
        tiles = _SMALL_M_TILES if block_m <= 32 else _LARGE_M_TILES
    return [
        triton.Config(
            {"BLOCK_N": block_n, "BLOCK_K": block_k, "GROUP_M": group_m},
            num_warps=num_warps,
            num_stages=num_stages,
        )
        for block_n, block_k, group_m, num_warps, num_stages in tiles
    ]


def tile_fits(
    *, block_m: int, block_n: int, block_k: int, num_warps: int, num_stages: int,
    gated: bool, elem_bytes: int, n: int, k: int, tail_m: int = 0,
) -> bool:
    """Whether a tile suits a GEMM of output width `n` and depth `k`: no wider than the
    GEMM, its pipeline stages of A and B tiles within shared memory, and its fp32
    accumulators (two when gated) within the register file. `tail_m`: the rows of a
    second tile on the same weight loads (`TAIL_M`); its accumulator may take the
    total to 160 registers per thread (128 x 256 tiles with a 32-row tail compiled to 228
    registers without spills on an H200, with a 64-row one they spilled)."""
    if block_n > max(16, triton.next_power_of_2(n)) or block_k > max(16, triton.next_power_of_2(k)):
        return False
    num_b = 2 if gated else 1
    smem = num_stages * ((block_m + tail_m) * block_k + num_b * block_n * block_k) * elem_bytes
    threads = num_warps * 32
    acc_regs = num_b * block_m * block_n // threads
    tail_regs = tail_m * block_n // threads
    return smem <= _SMEM_BYTES and acc_regs <= 128 and acc_regs + tail_regs <= 160


def _prune_configs(
    configs: list[triton.Config], named_args: dict[str, Any], **kwargs: Any
) -> list[triton.Config]:
    """Keep the configs of this BLOCK_M regime that `tile_fits` the GEMM."""
    block_m = kwargs["BLOCK_M"]
    regime = set(map(str, autotune_configs(block_m)))
    kept = [
        config
        for config in configs
        if str(config) in regime
        and tile_fits(
            block_m=block_m, block_n=config.kwargs["BLOCK_N"], block_k=config.kwargs["BLOCK_K"],
            num_warps=config.num_warps, num_stages=config.num_stages, gated=kwargs["GATED"],
            elem_bytes=named_args["a_ptr"].element_size(), n=named_args["N"], k=named_args["K"],
            tail_m=kwargs["TAIL_M"],
        )
    ]
    return kept or [min(configs, key=lambda c: c.kwargs["BLOCK_N"] * c.kwargs["BLOCK_K"])]


@functools.cache
def _tuned_kernel() -> Any:
    """The autotuned kernel, built on first GPU use (the interpreter never needs it)."""
    return triton.autotune(
        configs=autotune_configs(),
        # rows_bucket: the best tile at 256 tokens is not the best at 16384, yet keying on
        # the exact row count would re-tune for every batch size.
        key=["N", "K", "BLOCK_M", "ROUTE_BLOCK_M", "GATED", "A_SORTED", "USE_TMA", "HALF_TAIL",
             "TAIL_M", "rows_bucket"],
        prune_configs_by={"early_config_prune": _prune_configs},
    )(fused_moe_kernel)


@functools.cache
def _tuned_launcher() -> AutotunedLauncher:
    """Launches `_tuned_kernel`'s pick for a key without the autotuner's per-call work
    (`moe.kernels.launch`)."""
    return AutotunedLauncher(_tuned_kernel())


def tuned_configs() -> dict[str, str]:
    """The autotuner's picks so far: tuning key (N, K, BLOCK_M, GATED, dtypes) -> config."""
    return {str(key): str(config) for key, config in _tuned_kernel().cache.items()}


def choose_block_m(num_routed: int, num_experts: int) -> int:
    """BLOCK_M from the mean rows per expert: small blocks waste less padding at decode.

    Blocks are at most about half the mean segment, so padding stays under ~25% of rows.
    """
    rows_per_expert = num_routed / max(num_experts, 1)
    for block_m, limit in ((16, 32), (32, 96), (64, 256)):
        if rows_per_expert < limit:
            return block_m
    return 128


@functools.cache
def _capability(index: int | None) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def tma_unsupported_reason(*tensors: torch.Tensor) -> str | None:
    """None when tensor-descriptor (TMA) loads can read these operands, else why not.

    TMA needs a Hopper-class GPU (compute capability 9.0 or newer; on CPU the interpreter
    emulates it), 16-bit data, 16-byte aligned base pointers and row strides, and
    expert weights that are contiguous (the kernel views [E, rows, K] as [E*rows, K]).
    """
    device = tensors[0].device
    if device.type == "cuda":
        capability = _capability(device.index)
        if capability < (9, 0):
            return f"TMA needs compute capability 9.0 or newer, {device} has {capability}"
    for t in tensors:
        if t.dtype not in (torch.bfloat16, torch.float16):
            return f"TMA loads are used for 16-bit data only, got {t.dtype}"
        if t.data_ptr() % 16 or any((s * t.element_size()) % 16 for s in t.stride()[:-1]):
            return f"a {tuple(t.shape)} operand is not 16-byte aligned (pointer or row stride)"
        if t.dim() == 3 and not t.is_contiguous():
            return "expert weights are not contiguous: call .contiguous() on w13 / w2 once"
    return None


def fused_moe(
    x_NH: torch.Tensor,
    w13_EIH: torch.Tensor,
    w2_EHI: torch.Tensor,
    topk_ids_NK: torch.Tensor,
    topk_weights_NK: torch.Tensor,
    *,
    workspace: Workspace | None = None,
    block_m: int | None = None,
    tma: bool | None = None,
    sorted_x: bool | None = None,
    persistent: bool | None = None,
) -> torch.Tensor:
    """Routed expert MLPs: out[n] = sum_k w[n,k] * W2_e(silu(gate_e x[n]) * up_e x[n]).

    Args:
        x_NH: [N, H] activations, bf16/fp16/fp32, last dim contiguous.
        w13_EIH: [E, 2I, H] gate rows then up rows, x's dtype, last dim contiguous.
        w2_EHI: [E, H, I], x's dtype, last dim contiguous.
        topk_ids_NK: int64 [N, K] local expert ids in [0, E) or -1 (no contribution); not
            range-checked (that would sync).
        topk_weights_NK: float32 [N, K] routing weights.
        workspace: source of the intermediates (routing, [P, I] activation, [R, H] rows,
            which share memory with the [P, H] sorted x); fresh allocations when None.
            The returned tensor is always a fresh allocation.
        block_m: rows per block; `choose_block_m` when None (tests pin it).
        tma: load weight tiles (and sorted A tiles) with TMA. None: on a GPU where
            `tma_unsupported_reason` allows it, per GEMM where `prefer_tma` says it pays;
            True (both GEMMs) raises ValueError where TMA cannot load the operands (on CPU
            the interpreter emulates it, for tests); False: pointer loads only.
        sorted_x: copy x's routed rows into the sorted order first (one gather kernel),
            so GEMM1 loads A with TMA too; needs GEMM1 on TMA. None: `prefer_sorted_x`,
            where GEMM1 runs one program per tile (never before the persistent GEMM1).
        persistent: run a GEMM as `moe.kernels.fused_moe_persistent` (one program per
            SM over the tile table, TMA loads). None: on a GPU where TMA can load the
            operands and `tma` is not False, per GEMM where `prefer_persistent` says;
            True (both GEMMs) raises ValueError where TMA cannot load them; False: never.

    Returns:
        [N, H] in x's dtype on x's device, valid on the current stream. GEMMs accumulate in
        fp32; each weighted row is rounded to x's dtype once and the k-sum accumulates in
        fp32. fp32 inputs use TF32 tensor cores on the GPU only when
        `torch.backends.cuda.matmul.allow_tf32` is set, like torch's own matmul.
    """
    _check(x_NH, w13_EIH, w2_EHI, topk_ids_NK, topk_weights_NK)
    num_tokens, hidden = x_NH.shape
    num_experts, two_inter, _ = w13_EIH.shape
    inter = two_inter // 2
    top_k = topk_ids_NK.shape[1]
    num_routed = num_tokens * top_k
    device, dtype = x_NH.device, x_NH.dtype
    if num_routed == 0:
        return torch.zeros(num_tokens, hidden, dtype=dtype, device=device)

    # Whether TMA can load the operands decides the load paths and the persistent kernel.
    tma_reason = tma_unsupported_reason(w13_EIH, w2_EHI, x_NH)
    tma_auto = device.type == "cuda" and tma_reason is None
    if tma is None:
        tma1, tma2 = tma_auto and prefer_tma(hidden), tma_auto and prefer_tma(inter)
    elif tma and tma_reason is not None:
        raise ValueError(f"fused_moe(tma=True): {tma_reason}")
    else:
        tma1 = tma2 = tma
    if sorted_x and not tma1:
        raise ValueError("fused_moe(sorted_x=True) needs tma: the gather only pays for TMA loads")

    block_m = block_m or choose_block_m(num_routed, num_experts)
    rows_per_expert = num_routed / num_experts
    if persistent is None:
        allowed = tma is not False and tma_auto
        persist1 = allowed and prefer_persistent(block_m, gated=True, k=hidden,
                                                 rows_per_expert=rows_per_expert)
        persist2 = allowed and prefer_persistent(block_m, gated=False, k=inter,
                                                 rows_per_expert=rows_per_expert)
    elif persistent and tma_reason is not None:
        raise ValueError(f"fused_moe(persistent=True): {tma_reason}")
    else:
        persist1 = persist2 = persistent
    persist2 = persist2 and SKIP_DROPPED_ROWS  # it writes no zero rows for dropped ids
    if sorted_x is None:
        sorted_x = tma1 and prefer_sorted_x(x_NH, persistent_gemm1=persist1)
    routing = align_routing_triton(topk_ids_NK, num_experts, block_m, workspace=workspace)
    max_rows = routing.sorted_ids_P.numel()
    act_PI = empty_from(workspace, "triton.act", (max_rows, inter), dtype, device)

    a_x = x_NH
    if sorted_x:
        # The sorted x is dead once GEMM1 has run (same stream), so GEMM2's rows reuse it.
        a_x = empty_from(workspace, "triton.rows", (max_rows, hidden), dtype, device)
        gather_rows(x_NH, a_x, routing, rows_div=top_k)
        y_RH = a_x[:num_routed]
    else:
        y_RH = empty_from(workspace, "triton.rows", (num_routed, hidden), dtype, device)
    tiles1 = gemm_tiles(block_m, gated=True, rows_per_expert=rows_per_expert)
    tiles2 = gemm_tiles(block_m, gated=False, rows_per_expert=rows_per_expert)
    half_tail = block_m >= 32  # half tiles of at least 16 rows (tl.dot's minimum)
    if persist1:
        launch_persistent(a_x, w13_EIH, act_PI, None, routing, n=inter, k=hidden,
                          a_rows_div=top_k, a_sorted=sorted_x, half_tail=half_tail)
    else:
        _launch(kernel_launch(a_x, w13_EIH, act_PI, None, routing, n=inter, k=hidden,
                              a_rows_div=top_k, a_sorted=sorted_x, tma=tma1,
                              tiles=tiles1))
    if persist2:
        launch_persistent(act_PI, w2_EHI, y_RH, topk_weights_NK, routing, n=hidden, k=inter,
                          a_rows_div=1, a_sorted=True, half_tail=half_tail)
    else:
        _launch(kernel_launch(act_PI, w2_EHI, y_RH, topk_weights_NK, routing, n=hidden,
                              k=inter, a_rows_div=1, a_sorted=True, tma=tma2, tiles=tiles2))

    out_NH = torch.empty(num_tokens, hidden, dtype=dtype, device=device)
    if SKIP_DROPPED_ROWS:
        sum_routed_rows(y_RH, topk_ids_NK, out_NH)
    else:  # GEMM2 wrote zero rows for the dropped ids (torch sums in fp32)
        torch.sum(y_RH.view(num_tokens, top_k, hidden), dim=1, out=out_NH)
    return out_NH


# When the load paths pay, from `python -m moe.tune_experts --variants ptr,tma,sorted` on an
# H200 (BLOCK_M 128, best tile of each; BENCHMARKS.md section 2, session 3):
# - TMA weight tiles: 1-5% faster GEMMs at depth K >= 2048 (DeepSeek-V3 shapes, Qwen3's
#   GEMM1), 7% slower at K = 768 (Qwen3's GEMM2), where the in-kernel descriptor set-up
#   is a larger share of a short k-loop.
# - Sorting x first: GEMM1 11% faster at DeepSeek-V3 H = 7168, 16384 tokens (x is 235 MB,
#   about 4x L2), a net 0.8 ms of 21 ms after the gather; a net loss at 4096 tokens
#   (x 59 MB) and at Qwen3's 16384 tokens (x 67 MB). That was the one-program-per-tile
#   GEMM1. Before the persistent GEMM1, whose gate and up halves run as one dot (session
#   11), the 0.73 ms gather no longer pays: `fused_moe` end to end at DeepSeek-V3 shapes
#   with 16384 tokens was 0.8-1.2% faster without it (BENCHMARKS.md section 2).
TMA_MIN_K = 1024
SORTED_X_MIN_BYTES = 128 * 2**20


def prefer_tma(k: int) -> bool:
    """Whether a GEMM of depth `k` loads its tiles by TMA (where TMA can load them)."""
    return k >= TMA_MIN_K


def prefer_sorted_x(x_NH: torch.Tensor, *, persistent_gemm1: bool) -> bool:
    """Whether to gather x into the sorted order for GEMM1 (GEMM1 on TMA), which runs
    the persistent kernel when `persistent_gemm1`."""
    return not persistent_gemm1 and x_NH.numel() * x_NH.element_size() >= SORTED_X_MIN_BYTES


# The persistent kernel (`moe.kernels.fused_moe_persistent`), from per-GEMM timings of
# both kernels on an H200 (BENCHMARKS.md section 2, session 9; DeepSeek-V3 shapes with
# 8/32/128 local experts and the Qwen3 shape, 4096 and 16384 tokens, 128-row blocks):
# - GEMM2 (reads the sorted activation by TMA): 0-10% faster at every DeepSeek-V3 point,
#   15% at Qwen3 with 16384 tokens, 2% slower at Qwen3 with 4096.
# - GEMM1 at depth K = 7168 with 1024 or more rows per expert: 0-18% faster (ds-e8 and
#   ds-e32 at 4096 and 16384 tokens, ds-e128 at 16384); with 256 rows per expert (ds-e128
#   at 4096 tokens) slower in two runs of three (each expert spans only two 128-row
#   tiles; the other kernel runs 64-row ones there); at K = 2048 (Qwen3) 10% slower at
#   4096 tokens and 0-8% at 16384. Hence the two GEMM1 limits below.
# Only on 128-row blocks (large batches), where its tile list was tuned. PERSISTENT is a
# module switch, so that benchmarks can compare the two kernels. The experts never ask
# for it where other streams' kernels run beside them (`moe.experts.triton`).
# GEMM2 at 256 rows per expert (ds-e128 and qwen-e128 at 4096 tokens): the one-per-tile
# kernel with its short last blocks riding on the blocks before them (`TAIL_M`, which the
# persistent kernel lacks) was 4% faster at ds-e128 and level at qwen-e128 (session 19);
# hence PERSISTENT_GEMM2_MIN_ROWS.
PERSISTENT = True
PERSISTENT_GEMM1_MIN_K = 4096
PERSISTENT_GEMM1_MIN_ROWS = 512
PERSISTENT_GEMM2_MIN_ROWS = 512


def prefer_persistent(block_m: int, *, gated: bool, k: int, rows_per_expert: float) -> bool:
    """Whether a GEMM of depth `k` (`gated`: GEMM1) on `block_m`-row blocks runs the
    persistent kernel (where TMA can load its operands); `rows_per_expert`: routed rows
    (dropped ids included) over local experts."""
    if not PERSISTENT or block_m != 128:
        return False
    if not gated:
        return rows_per_expert >= PERSISTENT_GEMM2_MIN_ROWS
    return k >= PERSISTENT_GEMM1_MIN_K and rows_per_expert >= PERSISTENT_GEMM1_MIN_ROWS


# Tiles shorter than the routing's 128-row blocks, from `python -m moe.tune_experts` on an
# H200 (DeepSeek-V3 and Qwen3 shapes, 2048-4096 tokens; BENCHMARKS.md section 2, session 4):
# - GEMM1 (gated) in 64-row tiles: DeepSeek-V3 at 1024 rows per expert 15% faster (a
#   64 x 256 tile beats 128 x 64-128), equal within 2% at 256-512 rows and at Qwen3.
#   With many more rows per expert each weight tile is read twice as often, and
#   `bench_experts` at 4096-16384 rows per expert ran 2-4% slower: there GEMM1 keeps
#   128-row tiles (SHORT_GEMM1_MAX_ROWS, by routed rows per local expert).
# - GEMM2 in 128-row tiles, with half-height tiles for half-used blocks (`HALF_TAIL`):
#   0-4% faster at DeepSeek-V3, 6% at Qwen3. In GEMM1 the half tiles cost 3-4% at
#   K = 7168 (the kernel then holds two copies of the k-loop).
# - GEMM2 with last blocks of at most 32 rows riding on the block before (`TAIL_M`, a
#   swapped second tile): 3-5% faster than half tails alone at 256 rows per expert, 1.6%
#   at 513 (session 19). In GEMM1 a tail, swapped or not, took the kernel to 255
#   registers and was 5-20% slower (sessions 18 and 19).
# A module switch, so that benchmarks can compare against one tile height per call.
SHORT_TILES = True
SHORT_GEMM1_MAX_ROWS = 1024
GEMM2_TAIL_ROWS = 32


@dataclass(frozen=True)
class GemmTiles:
    """How one GEMM's tiles cover the routing's blocks (`kernel_launch`)."""

    rows: int | None = None
    """Rows per tile, dividing the routing's block; None: the block."""
    half_tail: bool = False
    """Half-height tiles for half-used blocks (tiles of >= 32 rows)."""
    tail_rows: int = 0
    """> 0: an expert's last block with at most this many used rows rides on the block
    before it (GEMM2 on whole-block tiles; a power of two from 16 to half the block)."""


def gemm_tiles(block_m: int, *, gated: bool, rows_per_expert: float) -> GemmTiles:
    """The tiles of GEMM1 (`gated`) or GEMM2 on `block_m`-row blocks; `rows_per_expert`:
    routed rows (dropped ids included) over local experts."""
    if not SHORT_TILES or block_m != 128:
        return GemmTiles(block_m)
    if gated:
        return GemmTiles(64 if rows_per_expert <= SHORT_GEMM1_MAX_ROWS else 128)
    return GemmTiles(128, half_tail=True, tail_rows=GEMM2_TAIL_ROWS)


# Rows of ids routed elsewhere (-1): GEMM2 skips them and the k-sum (`sum_routed_rows`) reads
# only the rows it wrote. False: GEMM2 writes zero rows there and torch sums all K rows
# (the path before session 4, kept for comparison).
SKIP_DROPPED_ROWS = True


def sum_routed_rows(y_RH: torch.Tensor, topk_ids_NK: torch.Tensor, out_NH: torch.Tensor) -> None:
    """out[n] = sum over the k with ids[n, k] >= 0 of y[n*K + k] (fp32, k in order)."""
    launch_sum_rows(y_RH, topk_ids_NK, out_NH, sel_is_row=False)


_GATHER = FastLauncher(gather_rows_kernel)
_GATHER_ROWS = 16  # divides every BLOCK_M (>= 16)
_GATHER_COLS = 512


def gather_rows(src_NH: torch.Tensor, dst_PH: torch.Tensor, routing: AlignedRouting, *,
                rows_div: int) -> None:
    """dst[p] = src[sorted_ids[p] // rows_div] for the used rows; zeros for padding rows."""
    hidden = src_NH.shape[1]
    grid = (dst_PH.shape[0] // _GATHER_ROWS, triton.cdiv(hidden, _GATHER_COLS))
    _GATHER(
        grid,
        src_NH, dst_PH, routing.sorted_ids_P, routing.num_padded_rows, routing.num_routed,
        hidden, src_NH.stride(0), dst_PH.stride(0),
        ROWS_DIV=rows_div, BLOCK_R=_GATHER_ROWS, BLOCK_H=_GATHER_COLS,
    )


@dataclass(frozen=True)
class KernelLaunch:
    """Everything but the tile of one `fused_moe_kernel` launch: positional args, the
    constexpr flags, and the routing's row count (the grid is rows x output columns)."""

    args: tuple[Any, ...]
    flags: dict[str, Any]
    max_rows: int
    n: int
    k: int

    def grid(self, block_n: int) -> tuple[int]:
        return (triton.cdiv(self.max_rows, self.flags["BLOCK_M"]) * triton.cdiv(self.n, block_n),)

    def tune_key(self) -> tuple[Any, ...]:
        """Determines the autotuner's key (`_tuned_kernel`): the flags, the GEMM's sizes,
        the row count (finer than its power-of-two bucket) and the operands' dtypes."""
        a, b, c = self.args[:3]
        return (tuple(self.flags.values()), self.n, self.k, self.max_rows, a.dtype, b.dtype,
                c.dtype)


def kernel_launch(
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    weights_NK: torch.Tensor | None,
    routing: AlignedRouting,
    *,
    n: int,
    k: int,
    a_rows_div: int,
    a_sorted: bool,
    tma: bool,
    tiles: GemmTiles = GemmTiles(),
) -> KernelLaunch:
    """The launch of one GEMM of the pair: GEMM1 (gated, `weights_NK` None, writes the
    sorted [P, N] activation) or GEMM2 (weighted by `weights_NK`, float32 [N, K] with a
    unit last stride, maybe a view into packed rows; writes rows by routed
    id; zero rows for dropped ids unless SKIP_DROPPED_ROWS). `a_sorted`: A is [P, K] in
    the sorted row order. `tiles`: see `GemmTiles`."""
    tile_m = tiles.rows or routing.block_m
    half_tail, tail_m = tiles.half_tail, tiles.tail_rows
    if routing.block_m % tile_m or (half_tail and tile_m < 32):
        raise ValueError(f"{tiles}: tiles must divide the routing's {routing.block_m}-row "
                         "blocks, and half tiles need >= 32 rows")
    if tail_m and (weights_NK is None or tile_m != routing.block_m or tail_m < 16
                   or tail_m > tile_m // 2 or tail_m & (tail_m - 1)):
        raise ValueError(f"{tiles} on {routing.block_m}-row blocks: tails are for GEMM2 on "
                         "whole-block tiles, a power of two from 16 to half the block")
    max_rows = routing.sorted_ids_P.numel()
    role = gemm_role(a, c, weights_NK, a_rows_div=a_rows_div, a_sorted=a_sorted)
    args = (
        a, b, c, role.weights,
        routing.sorted_ids_P, routing.block_expert_ids_B, routing.num_padded_rows,
        n, k, routing.num_routed, max_rows, triton.next_power_of_2(max(max_rows, 1)),
        b.shape[0], role.weights_top_k,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2), c.stride(0), c.stride(1),
        role.stride_wn,
    )
    flags = {
        **role.flags,
        "USE_TMA": tma,
        "ZERO_DROPPED": weights_NK is not None and not SKIP_DROPPED_ROWS,
        "HALF_TAIL": half_tail,
        "TAIL_M": tail_m,
        "ROUTE_BLOCK_M": routing.block_m,
        "BLOCK_M": tile_m,
    }
    return KernelLaunch(args=args, flags=flags, max_rows=max_rows, n=n, k=k)


def _launch(launch: KernelLaunch) -> None:
    """Queue one GEMM of the pair on the current stream (autotuned tile on the GPU)."""
    if launch.args[0].device.type == "cpu":  # TRITON_INTERPRET=1
        meta = _INTERPRETER_CONFIG
        fused_moe_kernel[launch.grid(meta["BLOCK_N"])](*launch.args, **launch.flags, **meta)
        return
    if launch.flags["USE_TMA"]:
        use_tma_scratch()
    _tuned_launcher()(launch.tune_key(), lambda meta: launch.grid(meta["BLOCK_N"]),
                      *launch.args, **launch.flags)


def _check(
    x_NH: torch.Tensor,
    w13_EIH: torch.Tensor,
    w2_EHI: torch.Tensor,
    topk_ids_NK: torch.Tensor,
    topk_weights_NK: torch.Tensor,
) -> None:
    """The `Experts.apply` contract, plus unit-stride last dims: other strides would be
    correct but silently slow (the tiles are loaded along the last dim)."""
    check_expert_inputs(x_NH, w13_EIH, w2_EHI, topk_ids_NK, topk_weights_NK)
    for name, t in (("x", x_NH), ("w13", w13_EIH), ("w2", w2_EHI)):
        if t.numel() and t.stride(-1) != 1:
            raise ValueError(
                f"fused_moe: {name} has strides {t.stride()}: the last dim must be contiguous "
                f"(call .contiguous())."
            )
