"""Sort routed (token, k) pairs by local expert into BLOCK_M-aligned row blocks.

The fused MoE kernel (`moe.kernels.fused_moe.host`) walks its rows in blocks of BLOCK_M
that all belong to one expert. This module builds that layout with a handful of torch
ops on the routing's device and no host sync (the reference;
`moe.kernels.fused_moe.align_triton` builds the same in three launches for the fused
kernel): every buffer is sized by an upper bound that is
known on the host, and the true number of used rows stays on the device.

Legend: N tokens, K top-k, E local experts, R = N*K routed rows (flat id = token*K + k),
P = max padded rows (a multiple of BLOCK_M), B = P // BLOCK_M blocks.

Layout: one segment per expert in id order, each padded to a multiple of BLOCK_M, then one
segment for the rows with id -1 (routed to another rank). Those "dropped" rows do no math,
but the final GEMM writes zeros for them, so every flat id appears exactly once and the
[R, H] output needs no memset. Padding rows hold the sentinel R.

Tile table (for the persistent GEMMs, `moe.kernels.fused_moe.persistent_triton`): the blocks
that hold an expert's rows, listed without the padding, dropped and idle blocks. Blocks
with more than BLOCK_M // 2 used rows come first, in row order; then the half-used ones
(at most BLOCK_M // 2 used rows: only an expert's last block can be one), in row order.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from moe.workspace import Workspace, empty_from


@dataclass(frozen=True)
class AlignedRouting:
    """Expert-sorted, BLOCK_M-padded routing; all tensors live on the routing's device.

    Produced on the current stream; valid there once the ops queued by `align_routing`
    have run (no host sync happens).
    """

    sorted_ids_P: torch.Tensor
    """int32 [P]: flat (token*K + k) id per row, expert-major; R marks a padding row.
    Rows at or past `num_padded_rows` are never read (the torch version fills them with
    R, the Triton version leaves them as they were)."""
    block_expert_ids_B: torch.Tensor
    """int32 [B]: local expert of each block of BLOCK_M rows; -1 for the dropped segment
    and for the unused blocks past `num_padded_rows`."""
    num_padded_rows: torch.Tensor
    """int32 [1]: rows actually used (a multiple of BLOCK_M); blocks at or past it are idle."""
    block_m: int
    """Rows per block."""
    num_routed: int
    """R = N*K, also the padding sentinel in `sorted_ids_P`."""
    tile_rows_B: torch.Tensor
    """int32 [B]: first row of each block in the tile table (see the module doc); entries
    at or past `num_tiles[0] + num_tiles[1]` are never read (the torch version fills them
    with 0, the Triton version leaves them as they were)."""
    num_tiles: torch.Tensor
    """int32 [2]: (blocks with more than BLOCK_M // 2 used rows, half-used blocks)."""


def max_padded_rows(num_routed: int, num_experts: int, block_m: int) -> int:
    """Upper bound P on the padded row count, known without looking at the routing.

    At most min(E + 1, R) segments are non-empty (the +1 is the dropped segment), and each
    adds fewer than BLOCK_M padding rows.
    """
    if num_routed == 0:
        return 0
    bound = num_routed + min(num_experts + 1, num_routed) * (block_m - 1)
    return -(-bound // block_m) * block_m


def check_align_args(topk_ids_NK: torch.Tensor, num_experts: int, block_m: int) -> None:
    """The argument checks shared by both align implementations."""
    if topk_ids_NK.dim() != 2:
        raise ValueError(f"topk_ids must be [N, K], got shape {tuple(topk_ids_NK.shape)}")
    if topk_ids_NK.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"topk_ids must be int32 or int64, got {topk_ids_NK.dtype}")
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1, got {num_experts}")
    if block_m < 1 or block_m & (block_m - 1):
        raise ValueError(f"block_m must be a power of two, got {block_m}")


def align_routing(
    topk_ids_NK: torch.Tensor,
    num_experts: int,
    block_m: int,
    *,
    workspace: Workspace | None = None,
) -> AlignedRouting:
    """Group the routed rows of `topk_ids_NK` by expert into BLOCK_M-aligned blocks.

    Args:
        topk_ids_NK: int32/int64 [N, K] local expert ids in [0, E), or -1 (not on this rank).
        num_experts: E, the number of local experts.
        block_m: rows per block, a power of two (the kernel's BLOCK_M; it needs >= 16).
        workspace: when given, `sorted_ids_P` and `block_expert_ids_B` come from it.

    Returns:
        `AlignedRouting` on `topk_ids_NK.device`. Rows of one expert keep token order
        (stable sort), so the layout is deterministic.
    """
    check_align_args(topk_ids_NK, num_experts, block_m)
    device = topk_ids_NK.device
    num_routed = topk_ids_NK.numel()
    num_rows = max_padded_rows(num_routed, num_experts, block_m)
    num_blocks = num_rows // block_m

    sorted_ids_P = empty_from(
        workspace, "triton.align.sorted_ids", (num_rows,), torch.int32, device
    )
    block_expert_ids_B = empty_from(
        workspace, "triton.align.block_expert_ids", (num_blocks,), torch.int32, device
    )
    tile_rows_B = empty_from(
        workspace, "triton.align.tile_rows", (num_blocks,), torch.int32, device
    )
    if num_routed == 0:
        return AlignedRouting(
            sorted_ids_P=sorted_ids_P,
            block_expert_ids_B=block_expert_ids_B,
            num_padded_rows=torch.zeros(1, dtype=torch.int32, device=device),
            block_m=block_m,
            num_routed=0,
            tile_rows_B=tile_rows_B,
            num_tiles=torch.zeros(2, dtype=torch.int32, device=device),
        )

    # Segment index per row: the expert, or E for -1. Python-style modulo maps -1 to E in
    # one op (ids are in [-1, E) by contract).
    segment_R = topk_ids_NK.reshape(-1).to(torch.int64).remainder(num_experts + 1)
    sorted_segment_R, order_R = torch.sort(segment_R, stable=True)

    # Segment starts in the sorted order, from the sorted keys (no atomics, no bincount:
    # CUDA bincount syncs to size its output).
    segment_ids_S = torch.arange(num_experts + 2, device=device, dtype=torch.int64)
    bounds_S = torch.searchsorted(sorted_segment_R, segment_ids_S)  # [E + 2]
    start_S = bounds_S[:-1]
    padded_S = (bounds_S[1:] - start_S + (block_m - 1)).bitwise_and_(-block_m)  # [E + 1]
    padded_end_S = torch.cumsum(padded_S, dim=0)

    # Sorted entry i of segment s goes to row padded_start[s] + (i - start[s]).
    shift_S = padded_end_S - padded_S - start_S
    dest_R = shift_S[sorted_segment_R]
    dest_R += torch.arange(num_routed, device=device, dtype=torch.int64)
    sorted_ids_P.fill_(num_routed)
    sorted_ids_P.index_copy_(0, dest_R, order_R.to(torch.int32))

    # Expert of each block: the segment whose padded range holds the block's first row;
    # segment E (dropped) and the idle tail past the last segment both map to -1.
    block_start_B = torch.arange(0, num_rows, block_m, device=device, dtype=torch.int64)
    torch.searchsorted(
        padded_end_S[:-1], block_start_B, right=True, out_int32=True, out=block_expert_ids_B
    )
    block_expert_ids_B.masked_fill_(block_expert_ids_B == num_experts, -1)
    num_tiles = _tile_table(block_start_B, block_expert_ids_B, bounds_S, padded_end_S - padded_S,
                            block_m, out=tile_rows_B)

    return AlignedRouting(
        sorted_ids_P=sorted_ids_P,
        block_expert_ids_B=block_expert_ids_B,
        num_padded_rows=padded_end_S[-1:].to(torch.int32),
        block_m=block_m,
        num_routed=num_routed,
        tile_rows_B=tile_rows_B,
        num_tiles=num_tiles,
    )


def _tile_table(
    block_start_B: torch.Tensor,
    block_expert_ids_B: torch.Tensor,
    bounds_S: torch.Tensor,
    padded_start_S: torch.Tensor,
    block_m: int,
    *,
    out: torch.Tensor,
) -> torch.Tensor:
    """Fill `out` [B] with the tile table (module doc) and return `num_tiles` [2], with
    no host sync: each block's slot comes from running counts over the blocks."""
    num_blocks = block_start_B.numel()
    expert_B = block_expert_ids_B.long()
    is_expert_B = expert_B >= 0
    safe_B = expert_B.clamp(min=0)
    total_B = bounds_S[safe_B + 1] - bounds_S[safe_B]  # rows of the block's expert
    used_B = (total_B - (block_start_B - padded_start_S[safe_B])).clamp(0, block_m)
    half_B = is_expert_B & (used_B > 0) & (used_B <= block_m // 2)
    full_B = is_expert_B & (used_B > block_m // 2)
    num_full = full_B.sum()
    slot_B = torch.where(full_B, torch.cumsum(full_B, 0) - 1, num_blocks)
    slot_B = torch.where(half_B, num_full + torch.cumsum(half_B, 0) - 1, slot_B)
    spill = out.new_zeros(num_blocks + 1)  # slot B collects the blocks not in the table
    spill.index_copy_(0, slot_B, block_start_B.to(torch.int32))
    out.copy_(spill[:num_blocks])
    return torch.stack([num_full, half_B.sum()]).to(torch.int32)

