"""The slot layout of the fixed-capacity all-to-all (`a2a_ll`): which send row each
(token, rank) pair takes, and which token each send row carries.

Shape legend: T tokens (T <= C), K top-k, W ranks, E_loc experts per rank, C capacity
(rows in each rank's slot), X = W*C send rows.

    mask[t, w] = token t has an expert id in [w*E_loc, (w+1)*E_loc)   (-1: no expert)
    pos[t, w]  = number of tokens t' < t with mask[t', w]
    slot[t, w] = w*C + pos[t, w] where mask[t, w], else -1
    src[s]     = the token t with slot[t, w] = s for some w, else -1 (a padding row)

On CUDA this is one Triton kernel (`moe.backends.kernels.slots_triton`). The torch version (CPU,
and the reference in tests) takes about fifteen ops: on the GPU each is a launch costing
~7 us of host time, and the DBO schedule is host-bound there. Measured on H200 (Triton
3.6, T=4096, W=2, K=8, medians): host time per call 160-300 us -> 20-30 us (two
machines), GPU time 45 us -> 18 us.

`KernelPolicy.implementation` picks the path (`moe.kernels.policy`). The kernel takes at
most TRITON_MAX_WORLD_SIZE ranks: "auto" uses torch above that.
Triton is imported on first use, so importing this module never needs it.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from moe.kernels.policy import KernelPolicy, triton_module, use_triton
from moe.row_layout import destination_mask
from moe.workspace import Workspace, empty_from

TRITON_MAX_WORLD_SIZE = 64  # the kernel keeps a token's ranks as the bits of an int64


def ll_slots(topk_ids_TK: Tensor, *, num_local_experts: int, world_size: int, capacity: int,
             workspace: Workspace | None = None,
             policy: KernelPolicy = KernelPolicy()) -> tuple[Tensor, Tensor]:
    """(slot_TW, src_X) for the global expert ids `topk_ids_TK` (int64 [T, K], -1 = none).

    slot_TW: a fresh int64 [T, W], contiguous (the caller may keep it). src_X: int64 [X],
    from `workspace` when given (valid until its next "ll_slots.src"). Both on the ids'
    device, queued on the current stream, no host sync.
    """
    num_tokens = topk_ids_TK.shape[0]
    if num_tokens > capacity:
        raise ValueError(f"ll_slots: {num_tokens} tokens exceed the capacity {capacity}: "
                         f"raise the capacity (MoEConfig.max_tokens_per_rank)")
    device = topk_ids_TK.device
    num_rows = world_size * capacity
    if not _use_triton(policy, topk_ids_TK, world_size):
        mask_TW = destination_mask(topk_ids_TK, num_local_experts, world_size)
        # Position among the earlier tokens bound for the same rank: a scan along T of the
        # [W, T] transpose (down a [T, W] column it runs as a serial scan, ~0.4 ms).
        mask_WT = mask_TW.t().contiguous()
        pos_WT = torch.cumsum(mask_WT, dim=1, dtype=torch.int32) - 1
        base_W1 = torch.arange(world_size, device=device)[:, None] * capacity
        slot_TW = torch.where(mask_WT, base_W1 + pos_WT, -1).t().contiguous()
        # Pairs that do not exist write a dump entry past the end.
        src_X = empty_from(workspace, "ll_slots.src", (num_rows + 1,), torch.int64,
                           device).fill_(-1)
        tokens_TW = torch.arange(num_tokens, device=device)[:, None].expand(num_tokens,
                                                                            world_size)
        src_X.index_put_((torch.where(mask_TW, slot_TW, num_rows),), tokens_TW)
        return slot_TW, src_X[:num_rows]
    slot_TW = torch.empty(num_tokens, world_size, dtype=torch.int64, device=device)
    src_X = empty_from(workspace, "ll_slots.src", (num_rows,), torch.int64, device)
    _triton().launch_ll_slots(topk_ids_TK, num_local_experts=num_local_experts,
                              world_size=world_size, capacity=capacity, slot_TW=slot_TW,
                              src_X=src_X, compiled=policy.compiled_launches)
    return slot_TW, src_X


def _use_triton(policy: KernelPolicy, t: Tensor, world_size: int) -> bool:
    triton = use_triton(policy, t)
    if world_size <= TRITON_MAX_WORLD_SIZE:
        return triton
    if policy.implementation == "triton":
        raise ValueError(f"moe.backends.kernels.slots: the Triton kernel takes at most "
                         f"{TRITON_MAX_WORLD_SIZE} ranks, got {world_size}: use "
                         f"KernelPolicy(implementation='auto') or 'torch'")
    return False


def _triton() -> Any:
    return triton_module("moe.backends.kernels.slots_triton")
