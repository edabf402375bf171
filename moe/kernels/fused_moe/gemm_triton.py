"""The fused-MoE GEMM kernel (one program per tile) and the row gather, in Triton.

One kernel serves both GEMMs of an expert MLP; constexpr flags pick the epilogue:

    GEMM1 (GATED):             act[r]  = silu(x[r // K] @ gate_e^T) * (x[r // K] @ up_e^T)
    GEMM2 (MUL_ROUTED_WEIGHT): y[r]    = topk_weight[r] * (act[r] @ w2_e^T)

where r = n*K + k is a flat routed row and e = topk_ids[n, k]. That is dbo's default
expert; the flags of an expert form (`moe.kernels.fused_moe.form`: interleaved gate/up
rows, biases, no gate, other activations, GPT-OSS's clamped SwiGLU) change the loads of
w13's rows and the epilogue (`moe.kernels.fused_moe.epilogue_triton`), as constexpr branches.
Rows are visited in the expert-sorted, BLOCK_M-padded order p from
`moe.kernels.fused_moe.align_triton`, so each program multiplies BLOCK_M rows of one expert by a
BLOCK_N slice of that expert's weights. Every output row is written by exactly one
program (no atomics).

The host side (load paths, tile heights, launches) is `moe.kernels.fused_moe.host`; the tile
candidates and the autotuners are `moe.kernels.fused_moe.tiles`; the persistent schedule
of the same math is `moe.kernels.fused_moe.persistent_triton`; both take GEMM1's gate-and-up
dot on TMA loads and the tile epilogue from `moe.kernels.fused_moe.epilogue_triton`.

Import only after TRITON_INTERPRET is settled: Triton reads this module when the kernels
are defined. Nothing is compiled or launched at import.
"""
from __future__ import annotations

import triton
import triton.language as tl

from moe.kernels.fused_moe.epilogue_triton import (gate_up_descriptor, gate_up_dot, split_gate_up,
                                            store_tile)


@triton.jit
def fused_moe_kernel(
    # Pointers
    a_ptr,  # A rows: x [N_tok, K] (gathered), or [P, K] in sorted row order (A_SORTED)
    b_ptr,  # expert weights [E, rows, K]: w13 [E, 2N, K] (GATED) or w2 [E, N, K]
    c_ptr,  # output: [R, N] by flat routed id, or [P, N] in sorted row order (C_SORTED)
    topk_weights_ptr,  # float32 [N_tok, K] (row stride stride_wn); MUL_ROUTED_WEIGHT only
    bias_ptr,  # HAS_BIAS: the expert biases [E, rows], contiguous
    # Routing from moe.kernels.fused_moe.align
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
    A_SORTED: tl.constexpr,  # A row = sorted row (act, or x gathered by `gather_rows_kernel`)
    C_SORTED: tl.constexpr,  # C row = sorted row (the [P, I] activation)
    USE_TMA: tl.constexpr,  # load B, and A when A_SORTED, through tensor descriptors
    GATED: tl.constexpr,  # B holds gate rows [0, N) then up rows [N, 2N): act(g) * u
    MUL_ROUTED_WEIGHT: tl.constexpr,  # scale each row by its routing weight
    # The expert form's epilogue (`moe.kernels.fused_moe.epilogue_triton.store_tile`)
    INTERLEAVED: tl.constexpr,  # GATED: B's rows alternate gate, up
    ACTIVATION: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    LIMIT: tl.constexpr,
    ALPHA: tl.constexpr,
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
    BLOCK_M rows r of one expert-e block (GATED: B rows n and N + n; INTERLEAVED: 2n and
    2n + 1).

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
    `moe.kernels.fused_moe.persistent_triton`.

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
    MMA's M (warpgroup MMA needs 64) and the tail's TAIL_M rows its N.
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
        return  # rows routed to other ranks: the k-sum never reads them
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
            a_ptr, b_ptr, c_ptr, topk_weights_ptr, bias_ptr, sorted_ids_ptr, row0, pid_n, expert,
            N, K, num_routed, max_padded_rows, num_experts, weights_top_k,
            stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn,
            stride_wn,
            A_ROWS_DIV, A_SORTED, C_SORTED, USE_TMA, GATED, MUL_ROUTED_WEIGHT,
            INTERLEAVED, ACTIVATION, HAS_BIAS, LIMIT, ALPHA,
            BLOCK_M, BLOCK_N, BLOCK_K, INPUT_PRECISION, TAIL_M)
    elif half_used:
        _expert_tile(
            a_ptr, b_ptr, c_ptr, topk_weights_ptr, bias_ptr, sorted_ids_ptr, row0, pid_n, expert,
            N, K, num_routed, max_padded_rows, num_experts, weights_top_k,
            stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn,
            stride_wn,
            A_ROWS_DIV, A_SORTED, C_SORTED, USE_TMA, GATED, MUL_ROUTED_WEIGHT,
            INTERLEAVED, ACTIVATION, HAS_BIAS, LIMIT, ALPHA,
            BLOCK_M // 2, BLOCK_N, BLOCK_K, INPUT_PRECISION, 0)
    else:
        _expert_tile(
            a_ptr, b_ptr, c_ptr, topk_weights_ptr, bias_ptr, sorted_ids_ptr, row0, pid_n, expert,
            N, K, num_routed, max_padded_rows, num_experts, weights_top_k,
            stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn,
            stride_wn,
            A_ROWS_DIV, A_SORTED, C_SORTED, USE_TMA, GATED, MUL_ROUTED_WEIGHT,
            INTERLEAVED, ACTIVATION, HAS_BIAS, LIMIT, ALPHA,
            BLOCK_M, BLOCK_N, BLOCK_K, INPUT_PRECISION, 0)


@triton.jit
def _expert_tile(
    a_ptr, b_ptr, c_ptr, topk_weights_ptr, bias_ptr, sorted_ids_ptr,
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
    INTERLEAVED: tl.constexpr,
    ACTIVATION: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    LIMIT: tl.constexpr,
    ALPHA: tl.constexpr,
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
    if INTERLEAVED:  # gate row 2n, up row 2n + 1
        b_ptrs = (b_ptr + expert * stride_be + (2 * offs_bn)[None, :] * stride_bn
                  + offs_k[:, None] * stride_bk)
        up_ptrs = b_ptrs + stride_bn
    else:
        b_ptrs = (b_ptr + expert * stride_be + offs_bn[None, :] * stride_bn
                  + offs_k[:, None] * stride_bk)
        up_ptrs = b_ptrs + N * stride_bn
    if USE_TMA:
        if GATED:
            b_desc = gate_up_descriptor(b_ptr, num_experts, N, K, stride_bn, BLOCK_N, BLOCK_K,
                                        INTERLEAVED)
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
                                   k * BLOCK_K, BLOCK_N, BLOCK_K, INPUT_PRECISION, N,
                                   INTERLEAVED)
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
        acc, acc_up = split_gate_up(acc_pair, BM, BLOCK_N, INTERLEAVED)

    store_tile(acc, acc_up, c_ptr, topk_weights_ptr, bias_ptr, expert, offs_m, row_ids, pid_n,
               N, num_routed, weights_top_k, stride_cm, stride_cn, stride_wn,
               C_SORTED, GATED, MUL_ROUTED_WEIGHT, BLOCK_N,
               INTERLEAVED, ACTIVATION, HAS_BIAS, LIMIT, ALPHA)
    if TAIL > 0:
        store_tile(acc_t.T, acc_t.T, c_ptr, topk_weights_ptr, bias_ptr, expert, offs_t,
                   row_ids_t, pid_n, N, num_routed, weights_top_k, stride_cm, stride_cn,
                   stride_wn, C_SORTED, GATED, MUL_ROUTED_WEIGHT, BLOCK_N,
                   INTERLEAVED, ACTIVATION, HAS_BIAS, LIMIT, ALPHA)


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
