"""The exact (packed, rank-major) send order of `symm_mem`'s dispatch in one Triton
kernel, and its launcher: what `moe.row_layout.destination_mask`, a sum over its tokens
and `moe.backends.a2a.send_order` give, bit for bit, without their ~30 torch ops (each
a launch costing host time on the GPU, where the dispatch is host-bound).

Shape legend: T tokens, K top-k, W ranks, E_loc experts per rank, S (token, rank) pairs
that exist (rows sent), X = W*T.

    mask[t, w]  = token t has an expert id in [w*E_loc, (w+1)*E_loc)   (-1: no expert)
    splits[w]   = tokens t with mask[t, w]                  (rows for rank w)
    slot[t, w]  = sum(splits[:w]) + (tokens t' < t with mask[t', w]) where mask, else -1
    src[x]      = the token t with slot[t, w] = x for some w, for x < S; -1 for x >= S

That is `send_order`'s rank-major order (rank 0's tokens first, in token order), the
rows of each rank back to back from row 0, as `all_to_all_vdev` sends them.

One launch, one program per block of BLOCK_T tokens (at least one program), as in
`moe.backends.kernels.slots_triton` (whose measurements chose this shape over one program walking
all blocks). Program b:

    1. reads every token's ids and counts, per rank, the tokens bound for it: those
       before block b and all of them (the splits; program 0 stores them);
    2. scans its own block's [BLOCK_T, W] destination mask down the tokens: slot of
       (t, w) = (rows of the ranks before w) + (earlier tokens bound for w); writes
       slot_TW and scatters t into src_X;
    3. writes -1 to its share of src_X's tail [S, X), split evenly over the programs.

Every src entry is written once, with no fill first and no ordering between programs.
W <= TRITON_MAX_WORLD_SIZE (a token's ranks are the bits of an int64, `rank_bits`).

Import this module only after TRITON_INTERPRET is settled: Triton reads it when the
kernel is defined. Nothing is compiled or launched at import.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe.backends.kernels.slots import TRITON_MAX_WORLD_SIZE
from moe.backends.kernels.slots_triton import rank_counts, store_block_slots
from moe.kernels.launch import FastLauncher, cdiv, next_power_of_2

_BLOCK_T = 256  # tokens per program
_BLOCK_X = 256  # src positions per step of the tail fill
_NUM_WARPS = 8


@triton.jit
def send_order_kernel(
    # Pointers
    ids_ptr,  # int [T, K], contiguous: global expert ids in [-1, W * E_loc), -1 = none
    splits_ptr,  # int [W] (out): rows for each rank
    slot_ptr,  # int64 [T, W], contiguous (out)
    src_ptr,  # int64 [W * T] (out)
    # Sizes
    num_tokens,  # T
    fill_per_program,  # tail positions of src that each program writes
    # Meta-parameters
    NUM_LOCAL_EXPERTS: tl.constexpr,  # E_loc: rank w holds [w * E_loc, (w + 1) * E_loc)
    TOP_K: tl.constexpr,
    WORLD: tl.constexpr,  # W
    WORLD_POW2: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_X: tl.constexpr,
):
    """splits[w]; slot[t, w] = (rows before rank w) + (earlier tokens for w) or -1;
    src[slot] = t, -1 from S on."""
    block_start = tl.program_id(0) * BLOCK_T
    offs_w = tl.arange(0, WORLD_POW2)
    w_mask = offs_w < WORLD

    # 1. Tokens bound for each rank: before this block, and in all.
    before_W, total_W = rank_counts(ids_ptr, num_tokens, block_start, offs_w,
                                    NUM_LOCAL_EXPERTS, TOP_K, WORLD_POW2, BLOCK_T)
    total_W = tl.where(w_mask, total_W, 0)
    if tl.program_id(0) == 0:
        tl.store(splits_ptr + offs_w, total_W.to(splits_ptr.dtype.element_ty), mask=w_mask)
    num_sent = tl.sum(total_W, axis=0)  # S
    base_W = tl.cumsum(total_W, axis=0) - total_W  # rows of the ranks before w

    # 2. This block's slots.
    offs_t = block_start + tl.arange(0, BLOCK_T)
    store_block_slots(ids_ptr, slot_ptr, src_ptr, offs_t, num_tokens, offs_w, w_mask,
                      base_W + before_W, WORLD, WORLD_POW2, BLOCK_T, NUM_LOCAL_EXPERTS,
                      TOP_K)

    # 3. This program's share of the tail: the W*T - S positions past the rows sent.
    padding = tl.full((BLOCK_X,), -1, dtype=tl.int64)
    fill_start = tl.program_id(0) * fill_per_program
    fill_end = tl.minimum(fill_start + fill_per_program, num_tokens * WORLD)
    for start in range(fill_start, fill_end, BLOCK_X):
        offs_x = start + tl.arange(0, BLOCK_X)
        tl.store(src_ptr + offs_x, padding, mask=(offs_x >= num_sent) & (offs_x < fill_end))


_SEND_ORDER = FastLauncher(send_order_kernel)


def launch_send_order(topk_ids_TK: torch.Tensor, *, num_local_experts: int, splits_W: torch.Tensor,
                      slot_TW: torch.Tensor, src_X: torch.Tensor, compiled: bool = True) -> None:
    """`send_order_kernel` into splits_W (int [W], contiguous), slot_TW (int64 [T, W],
    contiguous) and src_X (int64 [W*T], contiguous), on the current stream.
    topk_ids_TK: int [T, K]; W <= TRITON_MAX_WORLD_SIZE. `compiled`: through the compiled
    handle (`moe.kernels.launch`). With T = 0 it writes zero splits."""
    num_tokens, top_k = topk_ids_TK.shape
    world_size = splits_W.shape[0]
    assert splits_W.is_contiguous() and slot_TW.is_contiguous() and src_X.is_contiguous()
    assert slot_TW.shape == (num_tokens, world_size)
    assert src_X.shape == (world_size * num_tokens,)
    assert slot_TW.dtype == src_X.dtype == torch.int64
    assert world_size <= TRITON_MAX_WORLD_SIZE
    num_programs = max(1, cdiv(num_tokens, _BLOCK_T))
    _SEND_ORDER(
        (num_programs,),
        topk_ids_TK.contiguous(), splits_W, slot_TW, src_X, num_tokens,
        cdiv(world_size * num_tokens, num_programs),
        NUM_LOCAL_EXPERTS=num_local_experts, TOP_K=top_k, WORLD=world_size,
        WORLD_POW2=next_power_of_2(world_size), BLOCK_T=_BLOCK_T, BLOCK_X=_BLOCK_X,
        num_warps=_NUM_WARPS, compiled=compiled,
    )
