"""Persistent variant of the fused-MoE GEMM: one program per SM walks a table of tiles.

Same math, operands and epilogues as `moe.kernels.fused_moe.gemm_triton.fused_moe_kernel` (see
there); the difference is the schedule. That kernel launches one program per possible
tile and lets the ones over padding, dropped or idle blocks return. This one launches one
program per multiprocessor; each builds its TMA descriptors once and then loops over the
used tiles in grouped order, from the routing's tile table (`moe.kernels.fused_moe.align`): blocks
with more than BLOCK_M // 2 used rows first, then the half-used last blocks of experts as
half-height tiles (HALF_TAIL), so little math goes to padding rows. With FLATTEN, Triton
pipelines across the tile loop (the next tile's loads start during this one's epilogue).
GEMM1 loads a column block's gate and up rows as one TMA box and runs them as one dot
twice as wide (`_tile_loop`), as the other kernel does on its TMA path; per element the k
order is the same, so both kernels give the same bits.

It has no tails (`fused_moe_kernel`'s TAIL_M). The host (`host`) picks it per GEMM by
`KernelPolicy.persistent`, the caller's `sms_shared` and `rules.prefer_persistent`
(`rules.choose_paths`); its tiles and autotuner are in `tiles` (this package's modules).

Weights and sorted A tiles load through tensor descriptors (TMA), so this needs a Hopper
class GPU, 16-bit data and contiguous weights (`host.tma_unsupported_reason`); the
interpreter emulates it on CPU for the tests. Import only after TRITON_INTERPRET is
settled; nothing is compiled or launched at import.
"""
from __future__ import annotations

import triton
import triton.language as tl

from moe.kernels.fused_moe.epilogue_triton import (gate_up_descriptor, gate_up_dot, split_gate_up,
                                            store_tile)


@triton.jit
def fused_moe_persistent_kernel(
    # Pointers
    a_ptr,  # A rows: x [N_tok, K] (gathered), or [P, K] in sorted row order (A_SORTED)
    b_ptr,  # expert weights [E, rows, K] (contiguous): w13 [E, 2N, K] (GATED) or w2 [E, N, K]
    c_ptr,  # output: [R, N] by flat routed id, or [P, N] in sorted row order (C_SORTED)
    topk_weights_ptr,  # float32 [N_tok, K] (row stride stride_wn); MUL_ROUTED_WEIGHT only
    bias_ptr,  # HAS_BIAS: the expert biases [E, rows], contiguous
    # Routing from moe.kernels.fused_moe.align
    sorted_ids_ptr,  # int32 [P]: flat routed id per row, `num_routed` = padding
    block_expert_ids_ptr,  # int32 [P // ROUTE_BLOCK_M]: expert per row block
    tile_rows_ptr,  # int32 [B]: the tile table (first row per tile)
    num_tiles_ptr,  # int32 [2]: (full tiles, half-used tiles)
    # GEMM sizes: C[R, N] = A[R, K] @ B_e[N, K]^T
    N,
    K,
    num_routed,  # R, also the padding sentinel
    max_padded_rows,  # P
    rows_bucket,  # next power of two of P: autotune key only (unused in the body)
    num_experts,  # E: the extent of B's descriptor
    weights_top_k,  # K of the routing weights: routed id r is weight [r // K, r % K]
    # Strides
    stride_am,
    stride_ak,
    stride_bn,  # row stride of B viewed as [E * rows, K]
    stride_cm,
    stride_cn,
    stride_wn,
    # Epilogue / addressing switches
    A_ROWS_DIV: tl.constexpr,  # gathered A row = routed id // A_ROWS_DIV (top-k for x)
    A_SORTED: tl.constexpr,  # A row = sorted row, loaded by TMA
    C_SORTED: tl.constexpr,  # C row = sorted row (the [P, I] activation)
    GATED: tl.constexpr,  # B holds gate rows [0, N) then up rows [N, 2N): act(g) * u
    MUL_ROUTED_WEIGHT: tl.constexpr,  # scale each row by its routing weight
    # The expert form's epilogue (`moe.kernels.fused_moe.epilogue_triton.store_tile`)
    INTERLEAVED: tl.constexpr,  # GATED: B's rows alternate gate, up
    ACTIVATION: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    LIMIT: tl.constexpr,
    ALPHA: tl.constexpr,
    HALF_TAIL: tl.constexpr,  # half-used tiles run BLOCK_M // 2 rows (else full height)
    # Tiles
    BLOCK_M: tl.constexpr,  # the routing's block: one tile per table entry
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,  # tiles of GROUP_M table entries per column, for L2 reuse
    NUM_PROGRAMS: tl.constexpr,  # the grid: one program per SM
    FLATTEN: tl.constexpr,  # pipeline across the tile loop
    INPUT_PRECISION: tl.constexpr,
):
    """C[r, n] = epilogue(sum_k A[r, k] * B[e, n, k]) for every used row r, over the tile
    table: program p takes tiles p, p + NUM_PROGRAMS, ... of the full tiles, then of the
    half-used ones (continuing the round-robin, so the programs that took one more full
    tile take their half tiles last). Rows are never written twice; padding rows of a
    sorted C are written with junk (never summed), rows of a half tile's lower half not
    at all."""
    num_full = tl.load(num_tiles_ptr)
    num_half = tl.load(num_tiles_ptr + 1)
    if not HALF_TAIL:
        num_full += num_half
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pid = tl.program_id(axis=0)
    _tile_loop(
        a_ptr, b_ptr, c_ptr, topk_weights_ptr, bias_ptr, sorted_ids_ptr, block_expert_ids_ptr,
        tile_rows_ptr, 0, num_full, pid,
        N, K, num_routed, max_padded_rows, num_experts, weights_top_k,
        stride_am, stride_ak, stride_bn, stride_cm, stride_cn, stride_wn,
        A_ROWS_DIV, A_SORTED, C_SORTED, GATED, MUL_ROUTED_WEIGHT,
        INTERLEAVED, ACTIVATION, HAS_BIAS, LIMIT, ALPHA,
        BLOCK_M, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, NUM_PROGRAMS, FLATTEN, INPUT_PRECISION)
    if HALF_TAIL:
        # Continue the round-robin where the full tiles stopped.
        shift = (num_full * num_pid_n) % NUM_PROGRAMS
        _tile_loop(
            a_ptr, b_ptr, c_ptr, topk_weights_ptr, bias_ptr, sorted_ids_ptr, block_expert_ids_ptr,
            tile_rows_ptr, num_full, num_half, (pid + NUM_PROGRAMS - shift) % NUM_PROGRAMS,
            N, K, num_routed, max_padded_rows, num_experts, weights_top_k,
            stride_am, stride_ak, stride_bn, stride_cm, stride_cn, stride_wn,
            A_ROWS_DIV, A_SORTED, C_SORTED, GATED, MUL_ROUTED_WEIGHT,
            INTERLEAVED, ACTIVATION, HAS_BIAS, LIMIT, ALPHA,
            BLOCK_M // 2, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, NUM_PROGRAMS, FLATTEN,
            INPUT_PRECISION)


@triton.jit
def _tile_loop(
    a_ptr, b_ptr, c_ptr, topk_weights_ptr, bias_ptr, sorted_ids_ptr, block_expert_ids_ptr,
    tile_rows_ptr,
    first_entry,  # table index of this loop's first tile row
    num_pid_m,  # table entries this loop covers
    start,  # this program's first tile of the loop
    N, K, num_routed, max_padded_rows, num_experts, weights_top_k,
    stride_am, stride_ak, stride_bn, stride_cm, stride_cn, stride_wn,
    A_ROWS_DIV: tl.constexpr,
    A_SORTED: tl.constexpr,
    C_SORTED: tl.constexpr,
    GATED: tl.constexpr,
    MUL_ROUTED_WEIGHT: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    ACTIVATION: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    LIMIT: tl.constexpr,
    ALPHA: tl.constexpr,
    BM: tl.constexpr,  # rows computed per tile: BLOCK_M, or BLOCK_M // 2 for half tiles
    ROUTE_BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr,
    FLATTEN: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):
    """The tiles of `num_pid_m` table entries x all output columns, BM rows each.

    GATED: the gate and up rows of a column block load as one [2, BLOCK_N, BLOCK_K] TMA
    box of w13 viewed [E * 2, N, K] and multiply as one [BM, 2 * BLOCK_N] dot; the
    accumulator is split into the two halves for the epilogue. Past an expert's last
    row the box reads zeros (INTERLEAVED: one [BLOCK_N, 2, BLOCK_K] box of w13 viewed
    [E * N, 2, K], which reads the next expert's rows there; `gate_up_descriptor`). Else
    B is viewed [E * N, K]: past an expert's last weight row the descriptor reads the
    next expert's rows (or zeros past the tensor), and the store mask drops those
    columns."""
    if GATED:
        b_desc = gate_up_descriptor(b_ptr, num_experts, N, K, stride_bn, BLOCK_N, BLOCK_K,
                                    INTERLEAVED)
    else:
        b_desc = tl.make_tensor_descriptor(
            b_ptr, shape=[num_experts * N, K], strides=[stride_bn, 1],
            block_shape=[BLOCK_N, BLOCK_K])
    if A_SORTED:
        a_desc = tl.make_tensor_descriptor(
            a_ptr, shape=[max_padded_rows, K], strides=[stride_am, 1],
            block_shape=[BM, BLOCK_K])
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_in_group = GROUP_M * num_pid_n
    k_tiles = tl.cdiv(K, BLOCK_K)
    offs_k = tl.arange(0, BLOCK_K)
    for tile in tl.range(start, num_pid_m * num_pid_n, NUM_PROGRAMS, flatten=FLATTEN):
        group_id = tile // num_pid_in_group
        first_pid_m = group_id * GROUP_M
        group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
        pid_m = first_pid_m + ((tile % num_pid_in_group) % group_size_m)
        pid_n = (tile % num_pid_in_group) // group_size_m

        row0 = tl.load(tile_rows_ptr + first_entry + pid_m)
        expert = tl.load(block_expert_ids_ptr + row0 // ROUTE_BLOCK_M)
        offs_m = row0 + tl.arange(0, BM)
        row_ids = tl.load(sorted_ids_ptr + offs_m)
        row_mask = row_ids < num_routed
        a_rows = (row_ids // A_ROWS_DIV).to(tl.int64)

        if GATED:
            acc_pair = tl.zeros((BM, 2 * BLOCK_N), dtype=tl.float32)
        else:
            acc = tl.zeros((BM, BLOCK_N), dtype=tl.float32)
        for ki in range(k_tiles):
            k0 = ki * BLOCK_K
            if A_SORTED:
                a = a_desc.load([row0, k0])
            else:
                a_ptrs = (a_ptr + a_rows[:, None] * stride_am
                          + (k0 + offs_k)[None, :] * stride_ak)
                a = tl.load(a_ptrs, mask=row_mask[:, None] & (k0 + offs_k < K)[None, :],
                            other=0.0)
            if GATED:
                acc_pair = gate_up_dot(b_desc, a, acc_pair, expert, pid_n * BLOCK_N, k0,
                                       BLOCK_N, BLOCK_K, INPUT_PRECISION, N, INTERLEAVED)
            else:
                b = b_desc.load([expert * N + pid_n * BLOCK_N, k0]).T
                acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
        if GATED:
            acc, acc_up = split_gate_up(acc_pair, BM, BLOCK_N, INTERLEAVED)
        else:
            acc_up = acc  # unused by the epilogue
        store_tile(acc, acc_up, c_ptr, topk_weights_ptr, bias_ptr, expert, offs_m, row_ids,
                   pid_n, N, num_routed, weights_top_k, stride_cm, stride_cn, stride_wn,
                   C_SORTED, GATED, MUL_ROUTED_WEIGHT, BLOCK_N,
                   INTERLEAVED, ACTIVATION, HAS_BIAS, LIMIT, ALPHA)
