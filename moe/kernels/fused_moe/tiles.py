"""Tile candidates and the autotuners of the two fused-MoE GEMM kernels
(`moe.kernels.fused_moe.gemm_triton`, `moe.kernels.fused_moe.persistent_triton`).

`autotune_configs` lists the GPU tiles per BLOCK_M regime; `tile_fits` drops the ones a
GEMM cannot use (wider than the GEMM, over the shared memory or the register file) before
anything compiles; `tuned_launcher` launches the autotuner's pick per key without its
per-call work. `persistent_configs` and `persistent_launcher` do the same for the
persistent kernel. On CPU (the interpreter) small fixed tiles (`INTERPRETER_TILE`,
`INTERPRETER_PERSISTENT_TILE`) run instead. Why these tiles: `moe/kernels/fused_moe/KERNELS.md`.
Nothing is compiled at import.
"""
from __future__ import annotations

import functools
from typing import Any

import triton

from moe.kernels.fused_moe.persistent_triton import fused_moe_persistent_kernel
from moe.kernels.fused_moe.gemm_triton import fused_moe_kernel
from moe.kernels.launch import AutotunedLauncher, next_power_of_2

# Fixed tiles for CPU tensors (the interpreter): autotuning there would take minutes.
INTERPRETER_TILE = {"BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 2}
INTERPRETER_PERSISTENT_TILE = {"BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 2, "FLATTEN": False}
INTERPRETER_PROGRAMS = 3
_SMEM_BYTES = 220 * 1024  # H100/H200 allow 227 KiB per block; keep a margin.


# (BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages) per regime: few rows per block (decode)
# is weight-bandwidth bound (wide loads, 4 warps, deep pipelines), full blocks are
# tensor-core bound. The large-block list is the winners of `python -m moe.bench.tune`.
_SMALL_M_TILES = ((64, 64, 8, 4, 4), (64, 128, 8, 4, 4), (128, 64, 8, 4, 4), (128, 128, 8, 8, 3))
_LARGE_M_TILES = (
    (64, 64, 1, 4, 3),
    (64, 64, 8, 8, 3),
    (64, 64, 16, 4, 3),
    (128, 64, 8, 4, 3),
    (128, 64, 8, 4, 5),
    (128, 64, 16, 8, 3),
    (128, 64, 16, 8, 4),
    (128, 64, 32, 8, 3),
    (128, 64, 32, 8, 4),
    (256, 64, 8, 4, 4),
    (256, 64, 8, 8, 4),
    (256, 64, 16, 8, 3),
    (256, 64, 32, 8, 4),
    (128, 64, 8, 8, 3),
    (256, 64, 8, 8, 3),
    (256, 64, 32, 8, 3),
)


def autotune_configs(block_m: int | None = None) -> list[triton.Config]:
    """GPU tile candidates for `block_m` (BLOCK_M is picked by the host from the row
    count); all regimes when None. `_prune_configs` then drops the ones that do not fit
    the GEMM, the shared memory or the register file, before anything compiles."""
    if block_m is None:
        tiles = dict.fromkeys(_SMALL_M_TILES + _LARGE_M_TILES)
    else:
        tiles = _SMALL_M_TILES if block_m <= 32 else _LARGE_M_TILES
    return [
        triton.Config(
            {"BLOCK_N": block_n, "BLOCK_K": block_k, "GROUP_M": group_m},
            num_warps=num_warps,
            num_stages=num_stages,
        )
        for block_n, block_k, group_m, num_warps, num_stages in tiles
    ]


def tile_fits(
    *, block_m: int, block_n: int, block_k: int, num_warps: int, num_stages: int,
    gated: bool, elem_bytes: int, n: int, k: int, tail_m: int = 0,
) -> bool:
    """Whether a tile suits a GEMM of output width `n` and depth `k`: no wider than the
    GEMM, its pipeline stages of A and B tiles within shared memory, and its fp32
    accumulators (two when gated) within the register file. `tail_m`: the rows of a
    second tile on the same weight loads (`TAIL_M`); its accumulator may take the
    total to 160 registers per thread (a 32-row tail fits without spills, a 64-row one
    spills: `moe/kernels/fused_moe/KERNELS.md`)."""
    if block_n > max(16, next_power_of_2(n)) or block_k > max(16, next_power_of_2(k)):
        return False
    num_b = 2 if gated else 1
    smem = num_stages * ((block_m + tail_m) * block_k + num_b * block_n * block_k) * elem_bytes
    threads = num_warps * 32
    acc_regs = num_b * block_m * block_n // threads
    tail_regs = tail_m * block_n // threads
    return smem <= _SMEM_BYTES and acc_regs <= 128 and acc_regs + tail_regs <= 160


def _prune_configs(
    configs: list[triton.Config], named_args: dict[str, Any], **kwargs: Any
) -> list[triton.Config]:
    """Keep the configs of this BLOCK_M regime that `tile_fits` the GEMM."""
    block_m = kwargs["BLOCK_M"]
    regime = set(map(str, autotune_configs(block_m)))
    kept = [
        config
        for config in configs
        if str(config) in regime
        and tile_fits(
            block_m=block_m, block_n=config.kwargs["BLOCK_N"], block_k=config.kwargs["BLOCK_K"],
            num_warps=config.num_warps, num_stages=config.num_stages, gated=kwargs["GATED"],
            elem_bytes=named_args["a_ptr"].element_size(), n=named_args["N"], k=named_args["K"],
            tail_m=kwargs["TAIL_M"],
        )
    ]
    return kept or [min(configs, key=lambda c: c.kwargs["BLOCK_N"] * c.kwargs["BLOCK_K"])]


@functools.cache
def _tuned_kernel() -> Any:
    """The autotuned kernel, built on first GPU use (the interpreter never needs it)."""
    return triton.autotune(
        configs=autotune_configs(),
        # rows_bucket: the best tile at 256 tokens is not the best at 16384, yet keying on
        # the exact row count would re-tune for every batch size.
        key=["N", "K", "BLOCK_M", "ROUTE_BLOCK_M", "GATED", "A_SORTED", "USE_TMA", "HALF_TAIL",
             "TAIL_M", "rows_bucket"],
        prune_configs_by={"early_config_prune": _prune_configs},
    )(fused_moe_kernel)


@functools.cache
def tuned_launcher() -> AutotunedLauncher:
    """Launches `_tuned_kernel`'s pick for a key without the autotuner's per-call work
    (`moe.kernels.launch`)."""
    return AutotunedLauncher(_tuned_kernel())


def tuned_configs() -> dict[str, str]:
    """The autotuner's picks so far: tuning key (N, K, BLOCK_M, GATED, dtypes) -> config."""
    return {str(key): str(config) for key, config in _tuned_kernel().cache.items()}


# The persistent kernel's (BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages, FLATTEN) on
# 128-row tiles: GEMM2 wide and flattened, GEMM1 (one dot of gate and up) not flattened.
_PERSISTENT_GEMM2_TILES = (
    (256, 64, 8, 8, 3, True),
    (256, 64, 16, 8, 3, True),
    (256, 64, 8, 8, 3, False),
    (128, 64, 8, 8, 4, True),
)
_PERSISTENT_GEMM1_TILES = (
    (128, 64, 8, 8, 3, False),
    (128, 64, 16, 8, 3, False),
    (64, 64, 8, 8, 4, False),
)


def persistent_configs(*, gated: bool | None = None) -> list[triton.Config]:
    """GPU tile candidates of the persistent kernel for GEMM1 (`gated`), GEMM2, or both."""
    if gated is None:
        tiles = _PERSISTENT_GEMM1_TILES + _PERSISTENT_GEMM2_TILES
    else:
        tiles = _PERSISTENT_GEMM1_TILES if gated else _PERSISTENT_GEMM2_TILES
    return [
        triton.Config({"BLOCK_N": block_n, "BLOCK_K": block_k, "GROUP_M": group_m,
                       "FLATTEN": flatten}, num_warps=num_warps, num_stages=num_stages)
        for block_n, block_k, group_m, num_warps, num_stages, flatten in tiles
    ]


def _prune_persistent(configs: list[triton.Config], named_args: dict[str, Any],
                      **kwargs: Any) -> list[triton.Config]:
    """Keep the configs of this GEMM (gated or not) that are no wider than it."""
    regime = set(map(str, persistent_configs(gated=kwargs["GATED"])))
    width = max(16, next_power_of_2(named_args["N"]))
    kept = [c for c in configs if str(c) in regime and c.kwargs["BLOCK_N"] <= width]
    return kept or [min(configs, key=lambda c: c.kwargs["BLOCK_N"])]


@functools.cache
def persistent_launcher() -> AutotunedLauncher:
    """The autotuned persistent kernel, built on first GPU use, launched as
    `tuned_launcher`'s."""
    kernel = triton.autotune(
        configs=persistent_configs(),
        key=["N", "K", "BLOCK_M", "GATED", "A_SORTED", "HALF_TAIL", "rows_bucket"],
        prune_configs_by={"early_config_prune": _prune_persistent},
    )(fused_moe_persistent_kernel)
    return AutotunedLauncher(kernel)
