"""The rules the fused-MoE host applies per GEMM where its `KernelPolicy` leaves a choice
open (load paths, sorted x, persistent kernel, block and tile heights), and the one
place that applies them to a call (`choose_paths`). Pure Python: no Triton, nothing
launched.

The rules' thresholds come from timings on an H200; `moe/kernels/fused_moe/KERNELS.md`
gives the figures and what was tried and lost.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from moe.kernels.policy import KernelPolicy

# ----------------------------------------------------------------- fused-MoE GEMM rules
# Rows per expert below are routed rows (dropped ids included) over local experts.

TMA_MIN_K = 1024
SORTED_X_MIN_BYTES = 128 * 2**20
PERSISTENT_GEMM1_MIN_K = 4096
PERSISTENT_GEMM1_MIN_ROWS = 512
PERSISTENT_GEMM2_MIN_ROWS = 512
WEIGHT_BOUND_MIN_ROWS = 48
SHORT_GEMM1_MIN_ROWS = 256
SHORT_GEMM1_MAX_ROWS = 1024
GEMM2_TAIL_ROWS = 32


def choose_block_m(num_routed: int, num_experts: int) -> int:
    """BLOCK_M from the mean rows per expert.

    Few rows per expert (decode) take 16- and 32-row blocks, at most about half the mean
    segment, so padding stays small. From `WEIGHT_BOUND_MIN_ROWS` on, 128-row blocks:
    with up to a few hundred rows per expert the GEMMs are bound by reading the expert
    weights, and a block that holds all of an expert's rows reads each weight tile once
    (shorter blocks read it once per block); its padded rows cost tensor-core time the
    weight reads hide.
    """
    rows_per_expert = num_routed / max(num_experts, 1)
    for block_m, limit in ((16, 32), (32, WEIGHT_BOUND_MIN_ROWS)):
        if rows_per_expert < limit:
            return block_m
    return 128


def prefer_tma(k: int) -> bool:
    """Whether a GEMM of depth `k` loads its tiles by TMA (where TMA can load them): the
    in-kernel descriptor set-up is too large a share of a short k-loop."""
    return k >= TMA_MIN_K


def prefer_sorted_x(x_NH: torch.Tensor, *, persistent_gemm1: bool) -> bool:
    """Whether to gather x into the sorted order for GEMM1 (GEMM1 on TMA): only when x is
    well over L2 and GEMM1 runs one program per tile (`persistent_gemm1` False)."""
    return not persistent_gemm1 and x_NH.numel() * x_NH.element_size() >= SORTED_X_MIN_BYTES


def prefer_persistent(block_m: int, *, gated: bool, k: int, rows_per_expert: float) -> bool:
    """Whether a GEMM of depth `k` (`gated`: GEMM1) on `block_m`-row blocks runs the
    persistent kernel (where TMA can load its operands). Its tiles were tuned on 128-row
    blocks only; below the row limits the other kernel's shorter tiles and GEMM2 tails
    win, and a shallow GEMM1 loses to it."""
    if block_m != 128:
        return False
    if not gated:
        return rows_per_expert >= PERSISTENT_GEMM2_MIN_ROWS
    return k >= PERSISTENT_GEMM1_MIN_K and rows_per_expert >= PERSISTENT_GEMM1_MIN_ROWS


@dataclass(frozen=True)
class GemmTiles:
    """How one GEMM's tiles cover the routing's blocks (`host.kernel_launch`)."""

    rows: int | None = None
    """Rows per tile, dividing the routing's block; None: the block."""
    half_tail: bool = False
    """Half-height tiles for half-used blocks (tiles of >= 32 rows)."""
    tail_rows: int = 0
    """> 0: an expert's last block with at most this many used rows rides on the block
    before it (GEMM2 on whole-block tiles; a power of two from 16 to half the block)."""


def gemm_tiles(block_m: int, *, gated: bool, rows_per_expert: float) -> GemmTiles:
    """The tiles of GEMM1 (`gated`) or GEMM2 on `block_m`-row blocks. On 128-row blocks
    GEMM1 runs 64-row tiles from `SHORT_GEMM1_MIN_ROWS` to `SHORT_GEMM1_MAX_ROWS` rows
    per expert; with fewer (weight-bound: a 64-row tile would read each weight tile twice
    per block) or more rows (then each weight tile would be read twice as often), whole
    blocks. GEMM2 runs whole blocks with half tiles and tails (in GEMM1 those cost
    registers and time)."""
    if block_m != 128:
        return GemmTiles(block_m)
    if gated:
        short = SHORT_GEMM1_MIN_ROWS <= rows_per_expert <= SHORT_GEMM1_MAX_ROWS
        return GemmTiles(64 if short else 128)
    return GemmTiles(128, half_tail=True, tail_rows=GEMM2_TAIL_ROWS)


@dataclass(frozen=True, kw_only=True)
class GemmPaths:
    """The paths one `fused_moe` call takes (`choose_paths`)."""

    block_m: int
    """Rows per block of the aligned routing."""
    tma1: bool
    """GEMM1 loads its weight tiles (and a sorted A) by TMA."""
    tma2: bool
    sorted_x: bool
    """x is copied into the sorted row order before GEMM1."""
    persistent1: bool
    """GEMM1 runs as the persistent kernel."""
    persistent2: bool


def choose_paths(policy: KernelPolicy, x_NH: torch.Tensor, *, num_experts: int, inter: int,
                 num_routed: int, block_m: int | None, tma_reason: str | None,
                 sms_shared: bool) -> GemmPaths:
    """The paths of a `fused_moe` call on [N, H] `x_NH` with `num_routed` = N*K rows over
    `num_experts` local experts of width `inter`: the policy's fields where set, these
    rules where None. `tma_reason`: why TMA cannot load the operands (None: it can;
    `host.tma_unsupported_reason`). `sms_shared`: the caller runs other streams'
    kernels beside this call (a DBO step), so no persistent GEMM, whatever the policy
    says: its one program per SM holds every SM until it ends, and kernels queued
    meanwhile on the other streams wait for it (`KERNELS.md`). ValueError for a
    policy the operands cannot take (True `tma` / `persistent` without TMA, `sorted_x`
    without GEMM1 on TMA)."""
    hidden = x_NH.shape[1]
    tma, sorted_x = policy.tma, policy.sorted_x
    persistent = False if sms_shared else policy.persistent
    # Whether TMA can load the operands decides the load paths and the persistent kernel.
    tma_auto = x_NH.device.type == "cuda" and tma_reason is None
    if tma is None:
        tma1, tma2 = tma_auto and prefer_tma(hidden), tma_auto and prefer_tma(inter)
    elif tma and tma_reason is not None:
        raise ValueError(f"fused_moe(KernelPolicy(tma=True)): {tma_reason}")
    else:
        tma1 = tma2 = tma
    if sorted_x and not tma1:
        raise ValueError("fused_moe(KernelPolicy(sorted_x=True)) needs tma: the gather only "
                         "pays for TMA loads")

    block_m = block_m or choose_block_m(num_routed, num_experts)
    rows_per_expert = num_routed / num_experts
    if persistent is None:
        allowed = tma is not False and tma_auto
        persist1 = allowed and prefer_persistent(
            block_m, gated=True, k=hidden, rows_per_expert=rows_per_expert)
        persist2 = allowed and prefer_persistent(
            block_m, gated=False, k=inter, rows_per_expert=rows_per_expert)
    elif persistent and tma_reason is not None:
        raise ValueError(f"fused_moe(KernelPolicy(persistent=True)): {tma_reason}")
    else:
        persist1 = persist2 = persistent
    if sorted_x is None:
        sorted_x = tma1 and prefer_sorted_x(x_NH, persistent_gemm1=persist1)
    return GemmPaths(block_m=block_m, tma1=tma1, tma2=tma2, sorted_x=sorted_x,
                     persistent1=persist1, persistent2=persist2)
