"""The Triton kernel of `moe.backends.kernels.slots` (see there), and its launcher.

One launch, one program per block of BLOCK_T tokens (at least one program). Program b:

    1. reads every token's ids and counts, per rank, the tokens bound for it: those
       before block b (its base) and all of them (the totals);
    2. scans its own block's [BLOCK_T, W] destination mask down the tokens: slot of
       (t, w) = w*C + base[w] + (earlier tokens of the block bound for w); writes
       slot_TW and scatters t into src_X;
    3. writes -1 to its share of the padding rows: positions [total[w], C) of each
       rank's slot, split evenly over the programs.

So every src entry is written exactly once, with no fill before the scatter and no
ordering between programs. Step 1 repeats the count in every program: the ids are
L2-resident and a count is cheap, while one program walking all blocks in turn was
2-7x slower (a chain of dependent steps on one SM; measured on H200, Triton 3.6:
T=4096, W=2: 18 us instead of 40; T=8192, W=8: 37 us instead of 257).

A token's ranks are kept as the bits of an int64, so W <= 64 (TRITON_MAX_WORLD_SIZE);
a rank holding several of the token's experts is one bit, the token counted once there.

Import this module only after TRITON_INTERPRET is settled: Triton reads it when the
kernel is defined. Nothing is compiled or launched at import.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe.backends.kernels.slots import TRITON_MAX_WORLD_SIZE
from moe.kernels.launch import FastLauncher, cdiv, next_power_of_2

_BLOCK_T = 256  # tokens per program
_BLOCK_C = 256  # slot positions per step of the padding fill
_NUM_WARPS = 8


@triton.jit
def rank_bits(ids_ptr, offs_t, num_tokens, NUM_LOCAL_EXPERTS: tl.constexpr,
               TOP_K: tl.constexpr):
    """int64 [len(offs_t)]: bit w set when the token has an expert on rank w; 0 past T."""
    t_mask = offs_t < num_tokens
    token = offs_t.to(tl.int64)
    bits = tl.zeros(offs_t.shape, dtype=tl.int64)
    for k in tl.static_range(TOP_K):
        ids = tl.load(ids_ptr + token * TOP_K + k, mask=t_mask, other=-1).to(tl.int32)
        valid = ids >= 0
        rank = tl.where(valid, ids // NUM_LOCAL_EXPERTS, 0).to(tl.int64)
        bits |= tl.where(valid, tl.full(ids.shape, 1, tl.int64) << rank, 0)
    return bits


@triton.jit
def rank_hits(ids_ptr, offs_t, num_tokens, offs_w, NUM_LOCAL_EXPERTS: tl.constexpr,
              TOP_K: tl.constexpr):
    """int32 [len(offs_t), len(offs_w)]: 1 where the token has an expert on rank w."""
    bits = rank_bits(ids_ptr, offs_t, num_tokens, NUM_LOCAL_EXPERTS, TOP_K)
    return ((bits[:, None] >> offs_w[None, :].to(tl.int64)) & 1).to(tl.int32)


@triton.jit
def rank_counts(ids_ptr, num_tokens, block_start, offs_w, NUM_LOCAL_EXPERTS: tl.constexpr,
                TOP_K: tl.constexpr, WORLD_POW2: tl.constexpr, BLOCK_T: tl.constexpr):
    """(before_W, total_W), int32 [WORLD_POW2]: the tokens bound for each rank before
    `block_start`, and in all (every program recounts them: see the module doc)."""
    before_W = tl.zeros((WORLD_POW2,), dtype=tl.int32)
    total_W = tl.zeros((WORLD_POW2,), dtype=tl.int32)
    for start in range(0, num_tokens, BLOCK_T):
        count_W = tl.sum(rank_hits(ids_ptr, start + tl.arange(0, BLOCK_T), num_tokens, offs_w,
                                   NUM_LOCAL_EXPERTS, TOP_K), axis=0)
        total_W += count_W
        before_W += tl.where(start < block_start, count_W, 0)
    return before_W, total_W


@triton.jit
def store_block_slots(ids_ptr, slot_ptr, src_ptr, offs_t, num_tokens, offs_w, w_mask,
                      first_W, WORLD: tl.constexpr, WORLD_POW2: tl.constexpr,
                      BLOCK_T: tl.constexpr, NUM_LOCAL_EXPERTS: tl.constexpr,
                      TOP_K: tl.constexpr):
    """One block's slots: slot[t, w] = first_W[w] + (earlier tokens of the block bound for
    w) where token t goes to rank w, else -1, stored into slot_ptr (int64 [T, W]); t
    scattered into src_ptr at each slot."""
    hit = rank_hits(ids_ptr, offs_t, num_tokens, offs_w, NUM_LOCAL_EXPERTS, TOP_K)
    hit = tl.where(w_mask[None, :], hit, 0)
    goes = hit > 0
    slot = tl.where(goes, first_W[None, :] + tl.cumsum(hit, axis=0) - hit, -1).to(tl.int64)
    tl.store(slot_ptr + offs_t.to(tl.int64)[:, None] * WORLD + offs_w[None, :], slot,
             mask=(offs_t < num_tokens)[:, None] & w_mask[None, :])
    token = tl.broadcast_to(offs_t.to(tl.int64)[:, None], (BLOCK_T, WORLD_POW2))
    tl.store(src_ptr + slot, token, mask=goes)


@triton.jit
def ll_slots_kernel(
    # Pointers
    ids_ptr,  # int [T, K], contiguous: global expert ids in [-1, W * E_loc), -1 = none
    slot_ptr,  # int64 [T, W], contiguous (out)
    src_ptr,  # int64 [W * C] (out)
    # Sizes
    num_tokens,  # T
    capacity,  # C: slot rows per rank
    fill_per_program,  # padding positions per rank that each program writes
    # Meta-parameters
    NUM_LOCAL_EXPERTS: tl.constexpr,  # E_loc: rank w holds [w * E_loc, (w + 1) * E_loc)
    TOP_K: tl.constexpr,
    WORLD: tl.constexpr,  # W
    WORLD_POW2: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """slot[t, w] = w*C + (earlier tokens bound for w) or -1; src[slot] = t, -1 elsewhere."""
    block_start = tl.program_id(0) * BLOCK_T
    offs_w = tl.arange(0, WORLD_POW2)
    w_mask = offs_w < WORLD
    base_W = offs_w * capacity

    # 1. Tokens bound for each rank: before this block, and in all.
    before_W, total_W = rank_counts(ids_ptr, num_tokens, block_start, offs_w,
                                    NUM_LOCAL_EXPERTS, TOP_K, WORLD_POW2, BLOCK_T)

    # 2. This block's slots.
    offs_t = block_start + tl.arange(0, BLOCK_T)
    store_block_slots(ids_ptr, slot_ptr, src_ptr, offs_t, num_tokens, offs_w, w_mask,
                      base_W + before_W, WORLD, WORLD_POW2, BLOCK_T, NUM_LOCAL_EXPERTS,
                      TOP_K)

    # 3. This program's share of the padding rows: positions past each rank's total.
    padding = tl.full((WORLD_POW2, BLOCK_C), -1, dtype=tl.int64)
    fill_start = tl.program_id(0) * fill_per_program
    fill_end = tl.minimum(fill_start + fill_per_program, capacity)
    for start in range(fill_start, fill_end, BLOCK_C):
        offs_c = start + tl.arange(0, BLOCK_C)
        tail = (offs_c[None, :] >= total_W[:, None]) & (offs_c[None, :] < fill_end)
        tl.store(src_ptr + base_W[:, None] + offs_c[None, :], padding,
                 mask=tail & w_mask[:, None])


_SLOTS = FastLauncher(ll_slots_kernel)


def launch_ll_slots(topk_ids_TK: torch.Tensor, *, num_local_experts: int, world_size: int,
                    capacity: int, slot_TW: torch.Tensor, src_X: torch.Tensor,
                    compiled: bool = True) -> None:
    """`ll_slots_kernel` into slot_TW (int64 [T, W], contiguous) and src_X (int64 [W*C],
    contiguous), on the current stream. topk_ids_TK: int [T, K], T <= capacity,
    world_size <= TRITON_MAX_WORLD_SIZE. `compiled`: through the compiled handle
    (`moe.kernels.launch`)."""
    num_tokens, top_k = topk_ids_TK.shape
    assert slot_TW.shape == (num_tokens, world_size) and slot_TW.is_contiguous()
    assert src_X.shape == (world_size * capacity,) and src_X.is_contiguous()
    assert slot_TW.dtype == src_X.dtype == torch.int64
    assert num_tokens <= capacity and world_size <= TRITON_MAX_WORLD_SIZE
    if src_X.numel() == 0:  # capacity 0: no slot rows, and no tokens to place
        return
    num_programs = max(1, cdiv(num_tokens, _BLOCK_T))
    _SLOTS(
        (num_programs,),
        topk_ids_TK.contiguous(), slot_TW, src_X, num_tokens, capacity,
        cdiv(capacity, num_programs),
        NUM_LOCAL_EXPERTS=num_local_experts, TOP_K=top_k, WORLD=world_size,
        WORLD_POW2=next_power_of_2(world_size), BLOCK_T=_BLOCK_T, BLOCK_C=_BLOCK_C,
        num_warps=_NUM_WARPS, compiled=compiled,
    )
