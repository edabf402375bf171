"""Which load path, schedule and tile heights each GEMM of `moe.kernels.fused_moe` runs.

Every rule here comes from timings on an H200 (the comments name the BENCHMARKS.md
entries). The module switches (PERSISTENT, SHORT_TILES, SKIP_DROPPED_ROWS) and limits are
read at call time, so that benchmarks and tests can set them on this module. Pure Python:
no Triton, nothing launched.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


def choose_block_m(num_routed: int, num_experts: int) -> int:
    """BLOCK_M from the mean rows per expert: small blocks waste less padding at decode.

    Blocks are at most about half the mean segment, so padding stays under ~25% of rows.
    """
    rows_per_expert = num_routed / max(num_experts, 1)
    for block_m, limit in ((16, 32), (32, 96), (64, 256)):
        if rows_per_expert < limit:
            return block_m
    return 128


# When the load paths pay, from `python -m moe.tune_experts --variants ptr,tma,sorted` on an
# H200 (BLOCK_M 128, best tile of each; BENCHMARKS.md section 2):
# - TMA weight tiles: 1-5% faster GEMMs at depth K >= 2048 (DeepSeek-V3 shapes, Qwen3's
#   GEMM1), 7% slower at K = 768 (Qwen3's GEMM2), where the in-kernel descriptor set-up
#   is a larger share of a short k-loop.
# - Sorting x first: GEMM1 11% faster at DeepSeek-V3 H = 7168, 16384 tokens (x is 235 MB,
#   about 4x L2), a net 0.8 ms of 21 ms after the gather; a net loss at 4096 tokens
#   (x 59 MB) and at Qwen3's 16384 tokens (x 67 MB). That was the one-program-per-tile
#   GEMM1. Before the persistent GEMM1, whose gate and up halves run as one dot, the
#   0.73 ms gather no longer pays: `fused_moe` end to end at DeepSeek-V3 shapes
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
# both kernels on an H200 (BENCHMARKS.md section 2, DeepSeek-V3 shapes with
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
# persistent kernel lacks) was 4% faster at ds-e128 and level at qwen-e128;
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
# H200 (DeepSeek-V3 and Qwen3 shapes, 2048-4096 tokens; BENCHMARKS.md section 2):
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
#   at 513. In GEMM1 a tail, swapped or not, took the kernel to 255
#   registers and was 5-20% slower.
# A module switch, so that benchmarks can compare against one tile height per call.
SHORT_TILES = True
SHORT_GEMM1_MAX_ROWS = 1024
GEMM2_TAIL_ROWS = 32


@dataclass(frozen=True)
class GemmTiles:
    """How one GEMM's tiles cover the routing's blocks (`fused_moe.kernel_launch`)."""

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


# Rows of ids routed elsewhere (-1): GEMM2 skips them and the k-sum
# (`fused_moe.sum_routed_rows`) reads only the rows it wrote. False: GEMM2 writes zero rows
# there and torch sums all K rows (the older path, kept for comparison).
SKIP_DROPPED_ROWS = True
