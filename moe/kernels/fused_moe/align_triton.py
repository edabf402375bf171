"""Expert-sorted, BLOCK_M-padded routing in three Triton launches (the GPU path of align).

Same contract and the same output as `moe.kernels.fused_moe.align.align_routing` (the torch
version, kept as the reference and for the tests), with three launches instead of about
fifteen torch ops and a radix sort. The host launch work matters: under DBO each ubatch
aligns its own rows in every layer.

    1. count:   per chunk of CHUNK routed rows, a histogram over segments
                (expert 0..E-1, E = dropped id -1, and one junk bin for the tail).
    2. scan:    one program: segment totals, BLOCK_M-padded segment starts, each chunk's
                base offset per segment, the block -> expert table, the padding sentinels,
                the used row count and the tile table (`moe.kernels.fused_moe.align`).
    3. scatter: per chunk, a sort of (segment, position) keys gives every row its rank
                among the chunk's rows of its segment; row -> base + rank.

Rows of one segment keep flat-id order (chunks in order, positions in order), exactly like
the stable torch sort, so both versions produce identical buffers.

Legend: R routed rows, E local experts, S = E + 1 segments, S_PAD >= S + 1 (a power of two,
the last bin is junk), C chunks of CHUNK rows, P max padded rows, B = P // BLOCK_M blocks.
Import only after TRITON_INTERPRET is settled; nothing is compiled at import.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe.kernels.fused_moe.align import AlignedRouting, check_align_args, max_padded_rows
from moe.kernels.launch import FastLauncher, cdiv, next_power_of_2
from moe.workspace import Workspace, empty_from

CHUNK = 1024  # rows per count/scatter program: one in-register sort of CHUNK keys
SMALL_CHUNK = 64  # for at most this many rows: a shorter sort (decode; the interpreter)
_FILL_COLS = 16  # padding sentinels are written [S_PAD, _FILL_COLS] at a time
_SCAN_TILE = 4096  # elements per step of the scan's loops: [S_PAD, a power of two]
_CHUNK_STEP = 16  # at most this many chunk histograms per step
_BLOCK_STEP = 64  # at most this many blocks of each segment per step


@triton.jit
def _segments(ids_ptr, offs, num_routed, num_experts, S_PAD: tl.constexpr):
    """Segment per row: its expert, E for id -1, S_PAD - 1 (junk) past the end."""
    in_range = offs < num_routed
    ids = tl.load(ids_ptr + offs, mask=in_range, other=0).to(tl.int32)
    seg = tl.where(ids < 0, num_experts, ids)
    return tl.where(in_range, seg, S_PAD - 1)


@triton.jit
def align_count_kernel(
    ids_ptr,  # int32/int64 [R] expert ids in [-1, E)
    counts_ptr,  # int32 [C, S_PAD] out: rows per segment in each chunk
    num_routed,
    num_experts,
    S_PAD: tl.constexpr,
    CHUNK: tl.constexpr,
):
    chunk = tl.program_id(0)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    seg = _segments(ids_ptr, offs, num_routed, num_experts, S_PAD)
    counts = tl.histogram(seg, S_PAD)
    tl.store(counts_ptr + chunk * S_PAD + tl.arange(0, S_PAD), counts)


@triton.jit
def align_scan_kernel(
    counts_ptr,  # int32 [C, S_PAD] in: chunk histograms; out: base offset per (chunk, seg)
    sorted_ids_ptr,  # int32 [P] out: the padding rows get the sentinel R
    block_expert_ids_ptr,  # int32 [B] out: expert per block, -1 for dropped/idle
    num_padded_rows_ptr,  # int32 [1] out
    tile_rows_ptr,  # int32 [B] out: the tile table's first rows
    num_tiles_ptr,  # int32 [2] out: (more than half-used blocks, half-used blocks)
    num_routed,
    num_experts,
    num_chunks,
    num_blocks,
    BLOCK_M: tl.constexpr,
    S_PAD: tl.constexpr,
    FILL_COLS: tl.constexpr,
    CHUNK_STEP: tl.constexpr,  # chunk histograms read [CHUNK_STEP, S_PAD] at a time
    BLOCK_STEP: tl.constexpr,  # blocks of each segment written [S_PAD, BLOCK_STEP] at a time
):
    """One program. Segments are laid out in id order, each padded to BLOCK_M; the junk
    bin (tail rows) gets no space. Every loop works on a whole tile of chunks, blocks or
    columns per step, so a step is one wide vector operation, not one per chunk or block:
    this program runs alone between the count and the scatter launches."""
    segs = tl.arange(0, S_PAD)
    steps = tl.arange(0, CHUNK_STEP)
    totals = tl.zeros((S_PAD,), dtype=tl.int32)
    for c0 in range(0, num_chunks, CHUNK_STEP):
        chunks = c0 + steps
        tile = tl.load(counts_ptr + chunks[:, None] * S_PAD + segs[None, :],
                       mask=(chunks < num_chunks)[:, None], other=0)
        totals += tl.sum(tile, axis=0)
    totals = tl.where(segs <= num_experts, totals, 0)
    padded = (totals + (BLOCK_M - 1)) // BLOCK_M * BLOCK_M
    padded_end = tl.cumsum(padded, axis=0)
    padded_start = padded_end - padded

    # Base per (chunk, segment): the segment's start, plus the rows earlier chunks put
    # there, less the rows of lower segments in this chunk (the scatter adds the row's
    # position among the chunk's rows sorted by segment).
    running = padded_start
    for c0 in range(0, num_chunks, CHUNK_STEP):
        chunks = c0 + steps
        offs = chunks[:, None] * S_PAD + segs[None, :]
        in_range = (chunks < num_chunks)[:, None]
        tile = tl.load(counts_ptr + offs, mask=in_range, other=0)
        earlier = tl.cumsum(tile, axis=0) - tile
        below = tl.cumsum(tile, axis=1) - tile
        tl.store(counts_ptr + offs, running[None, :] + earlier - below, mask=in_range)
        running += tl.sum(tile, axis=0)

    # Padding rows of each segment: [start + total, padded end).
    fill_start = padded_start + totals
    for col in range(0, BLOCK_M, FILL_COLS):
        rows = fill_start[:, None] + col + tl.arange(0, FILL_COLS)[None, :]
        sentinel = tl.full((S_PAD, FILL_COLS), 0, tl.int32) + num_routed
        tl.store(sorted_ids_ptr + rows, sentinel, mask=rows < padded_end[:, None])

    # Tile table: per expert, its blocks but the last in full, then the last one as full
    # or half-used; the half-used ones go after every full one.
    is_expert = segs < num_experts
    num_blocks_s = padded // BLOCK_M
    num_blocks_e = tl.where(is_expert, num_blocks_s, 0)
    last_used = totals - (num_blocks_e - 1) * BLOCK_M
    half = is_expert & (totals > 0) & (last_used <= BLOCK_M // 2)
    full = num_blocks_e - half.to(tl.int32)
    full_start = tl.cumsum(full, axis=0) - full
    num_full = tl.sum(full, axis=0)
    half_slot = num_full + tl.cumsum(half.to(tl.int32), axis=0) - 1
    tl.store(tile_rows_ptr + half_slot, padded_start + full * BLOCK_M, mask=half)

    # Each segment writes its own blocks: the expert per block (-1 for the dropped
    # segment) and its full tiles' first rows.
    first_block = padded_start // BLOCK_M
    expert = tl.where(is_expert, segs, -1)
    blocks_per_seg = tl.max(num_blocks_s, axis=0)
    for j0 in range(0, blocks_per_seg, BLOCK_STEP):
        j = j0 + tl.arange(0, BLOCK_STEP)[None, :]
        in_seg = j < num_blocks_s[:, None]
        tl.store(block_expert_ids_ptr + first_block[:, None] + j,
                 expert[:, None] + 0 * j, mask=in_seg)
        tl.store(tile_rows_ptr + full_start[:, None] + j,
                 padded_start[:, None] + j * BLOCK_M, mask=j < full[:, None])
    # The idle blocks past the used rows.
    used_blocks = tl.sum(num_blocks_s, axis=0)
    for b0 in range(used_blocks, num_blocks, S_PAD * BLOCK_STEP):
        blocks = b0 + tl.arange(0, S_PAD * BLOCK_STEP)
        tl.store(block_expert_ids_ptr + blocks, tl.full(blocks.shape, -1, tl.int32),
                 mask=blocks < num_blocks)
    tl.store(num_tiles_ptr, num_full)
    tl.store(num_tiles_ptr + 1, tl.sum(half.to(tl.int32), axis=0))

    tl.store(num_padded_rows_ptr, tl.sum(padded, axis=0))


@triton.jit
def align_scatter_kernel(
    ids_ptr,  # int32/int64 [R]
    base_ptr,  # int32 [C, S_PAD] from the scan
    sorted_ids_ptr,  # int32 [P] out: flat routed id at its padded, expert-sorted row
    num_routed,
    num_experts,
    S_PAD: tl.constexpr,
    CHUNK: tl.constexpr,
):
    chunk = tl.program_id(0)
    pos = tl.arange(0, CHUNK)
    seg = _segments(ids_ptr, chunk * CHUNK + pos, num_routed, num_experts, S_PAD)
    # Sorting (segment, position) keys ranks each row among the chunk's rows stably.
    keys = tl.sort(seg * CHUNK + pos)
    seg_sorted = keys // CHUNK
    row = chunk * CHUNK + keys % CHUNK
    dest = tl.load(base_ptr + chunk * S_PAD + seg_sorted) + pos
    tl.store(sorted_ids_ptr + dest, row, mask=seg_sorted < S_PAD - 1)


# Launch through the compiled handles: three launches per ubatch and layer (moe.kernels.launch).
_COUNT = FastLauncher(align_count_kernel)
_SCAN = FastLauncher(align_scan_kernel)
_SCATTER = FastLauncher(align_scatter_kernel)


def align_routing_triton(
    topk_ids_NK: torch.Tensor,
    num_experts: int,
    block_m: int,
    *,
    workspace: Workspace | None = None,
    chunk: int | None = None,
    compiled: bool = True,
) -> AlignedRouting:
    """`moe.kernels.fused_moe.align.align_routing` in three Triton launches; identical output.

    Args and returns as there (CUDA tensors, or CPU under TRITON_INTERPRET=1), plus
    `chunk`: rows per count/scatter program, a power of two (by default SMALL_CHUNK up to
    that many rows, else CHUNK; tests pass small chunks to cover many programs cheaply)
    and `compiled`: launch through the compiled handles (`moe.kernels.launch`).
    Queued on the current stream, no host sync.
    """
    check_align_args(topk_ids_NK, num_experts, block_m)
    device = topk_ids_NK.device
    num_routed = topk_ids_NK.numel()
    num_rows = max_padded_rows(num_routed, num_experts, block_m)
    num_blocks = num_rows // block_m
    sorted_ids_P = empty_from(workspace, "triton.align.sorted_ids", (num_rows,), torch.int32,
                              device)
    block_expert_ids_B = empty_from(workspace, "triton.align.block_expert_ids", (num_blocks,),
                                    torch.int32, device)
    num_padded_rows = empty_from(workspace, "triton.align.num_padded_rows", (1,), torch.int32,
                                 device)
    tile_rows_B = empty_from(workspace, "triton.align.tile_rows", (num_blocks,), torch.int32,
                             device)
    num_tiles = empty_from(workspace, "triton.align.num_tiles", (2,), torch.int32, device)
    if num_routed == 0:
        num_padded_rows.zero_()
        num_tiles.zero_()
        return AlignedRouting(sorted_ids_P, block_expert_ids_B, num_padded_rows, block_m, 0,
                              tile_rows_B, num_tiles)

    if chunk is None:
        chunk = SMALL_CHUNK if num_routed <= SMALL_CHUNK else CHUNK
    if chunk < 16 or chunk & (chunk - 1):
        raise ValueError(f"chunk must be a power of two >= 16, got {chunk}")
    s_pad = next_power_of_2(num_experts + 2)
    num_chunks = cdiv(num_routed, chunk)
    counts_CS = empty_from(workspace, "triton.align.counts", (num_chunks, s_pad), torch.int32,
                           device)
    ids_R = topk_ids_NK.reshape(-1)
    per_seg = max(1, _SCAN_TILE // s_pad)
    _COUNT((num_chunks,), ids_R, counts_CS, num_routed, num_experts, S_PAD=s_pad, CHUNK=chunk,
           compiled=compiled)
    _SCAN(
        (1,),
        counts_CS, sorted_ids_P, block_expert_ids_B, num_padded_rows, tile_rows_B, num_tiles,
        num_routed, num_experts, num_chunks, num_blocks,
        BLOCK_M=block_m, S_PAD=s_pad, FILL_COLS=min(_FILL_COLS, block_m),
        CHUNK_STEP=min(_CHUNK_STEP, per_seg), BLOCK_STEP=min(_BLOCK_STEP, per_seg), num_warps=4,
        compiled=compiled,
    )
    _SCATTER((num_chunks,), ids_R, counts_CS, sorted_ids_P, num_routed, num_experts,
             S_PAD=s_pad, CHUNK=chunk, num_warps=8, compiled=compiled)
    return AlignedRouting(sorted_ids_P, block_expert_ids_B, num_padded_rows, block_m,
                          num_routed, tile_rows_B, num_tiles)
