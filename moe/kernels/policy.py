"""`KernelPolicy`: the choices between kernel paths, passed in (never read from a module
global), and the rules the fused-MoE host applies per GEMM when the policy leaves a
choice open. Pure Python: no Triton, nothing launched.

The rules' thresholds come from timings on an H200; `moe/kernels/KERNELS.md` gives the
figures and what was tried and lost.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType

import torch
from torch import Tensor

from dbo.compiling import compiling

IMPLEMENTATIONS = ("auto", "triton", "torch")


@dataclass(frozen=True, kw_only=True)
class KernelPolicy:
    """Which path each kernel takes; the defaults are the shipped choices."""

    implementation: str = "auto"
    """The routing, row packing / sums, `a2a_ll` slots and rotary ops: "auto" (Triton for
    CUDA tensors, torch otherwise), "triton" (everywhere: on CPU only under
    TRITON_INTERPRET=1, for tests) or "torch" (the reference ops). Inside a graph that
    `torch.compile` traces, always the torch ops (`use_triton`)."""
    compiled_launches: bool = True
    """Launch Triton kernels through their compiled handles (`moe.kernels.launch`); False:
    through `kernel[grid](...)`, which costs more host time per launch and is kept so that
    `moe.bench.host` can measure the difference."""
    tma: bool | None = None
    """Fused MoE: load weight tiles (and sorted A tiles) by TMA. None: per GEMM by
    `prefer_tma` where the GPU and operands allow it, since TMA wins on deep GEMMs and
    pointer loads on shallow ones; True (both GEMMs) raises ValueError where TMA cannot
    load the operands; False: pointer loads only."""
    sorted_x: bool | None = None
    """Fused MoE: copy x into the sorted row order first, so GEMM1 loads A by TMA too
    (needs GEMM1 on TMA). None: `prefer_sorted_x`, since it pays only for the
    one-program-per-tile GEMM1 with x well over L2."""
    persistent: bool | None = None
    """Fused MoE: run a GEMM as the persistent kernel (one program per SM over the tile
    table, TMA loads). None: per GEMM by `prefer_persistent`, since it wins on large
    batches outside DBO and loses where few rows per expert or other streams' kernels
    share the SMs; True (both GEMMs) raises ValueError where TMA cannot load the
    operands; False: never."""

    def __post_init__(self) -> None:
        if self.implementation not in IMPLEMENTATIONS:
            raise ValueError(f"KernelPolicy.implementation={self.implementation!r}: use one "
                             f"of {IMPLEMENTATIONS}")
        for name in ("compiled_launches",):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"KernelPolicy.{name}={getattr(self, name)!r}: must be a bool")
        for name in ("tma", "sorted_x", "persistent"):
            if getattr(self, name) not in (None, True, False):
                raise TypeError(f"KernelPolicy.{name}={getattr(self, name)!r}: must be None "
                                "(the host decides), True or False")


def use_triton(policy: KernelPolicy, t: Tensor) -> bool:
    """Whether an op with a Triton kernel and a torch version takes the kernel for `t`.
    Never inside a graph that `torch.compile` traces: there the torch version is what the
    compiler fuses with its neighbours (the kernels launch through host code it cannot
    trace)."""
    if compiling():
        return False
    if policy.implementation == "auto":
        return t.device.type == "cuda"
    return policy.implementation == "triton"


def triton_module(name: str) -> ModuleType:
    """The Triton kernels' module `name` (e.g. "moe.kernels.rows_triton"), imported now:
    importing an op's module never needs Triton, and TRITON_INTERPRET is read only then."""
    return importlib.import_module(name)


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
    """How one GEMM's tiles cover the routing's blocks (`fused_moe.kernel_launch`)."""

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
