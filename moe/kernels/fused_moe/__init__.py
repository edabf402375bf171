"""The fused-MoE expert GEMMs: the host (`host.fused_moe`), which takes its paths by
its own rules (`rules`, on a `moe.kernels.policy.KernelPolicy` and the caller's word on
whether other streams' kernels share the SMs), the routing's alignment into expert
blocks (`align`, `align_triton`), the Triton kernels (`gemm_triton`,
`persistent_triton`, `epilogue_triton`), their tiles and autotuners (`tiles`) and an
expert form's flags per GEMM (`form`). What the tuning learned: `KERNELS.md`.

Importing this package imports no Triton (the host and kernel modules do, when
imported themselves). The names the tools use are re-exported below (`__all__`,
tests/test_layers.py): the rules at once, the host's and the kernels' lazily, on first
use. `launch_gemm` is the host's one-GEMM launch (`host._launch`).
"""
from __future__ import annotations

import importlib
from typing import Any

from moe.kernels.fused_moe.rules import choose_block_m, gemm_tiles, prefer_tma

__all__ = [
    "align_routing_triton",
    "autotune_configs",
    "choose_block_m",
    "fused_moe",
    "fused_moe_kernel",
    "gather_rows",
    "gemm_tiles",
    "kernel_launch",
    "launch_gemm",
    "prefer_tma",
    "sum_routed_rows",
    "tile_fits",
    "tma_unsupported_reason",
    "tuned_configs",
    "use_tma_scratch",
]

# Re-exported on first use ("module:attribute"): their modules import Triton.
_LAZY = {
    "align_routing_triton": "moe.kernels.fused_moe.align_triton:align_routing_triton",
    "autotune_configs": "moe.kernels.fused_moe.tiles:autotune_configs",
    "fused_moe": "moe.kernels.fused_moe.host:fused_moe",
    "fused_moe_kernel": "moe.kernels.fused_moe.gemm_triton:fused_moe_kernel",
    "gather_rows": "moe.kernels.fused_moe.host:gather_rows",
    "kernel_launch": "moe.kernels.fused_moe.host:kernel_launch",
    "launch_gemm": "moe.kernels.fused_moe.host:_launch",
    "sum_routed_rows": "moe.kernels.fused_moe.host:sum_routed_rows",
    "tile_fits": "moe.kernels.fused_moe.tiles:tile_fits",
    "tma_unsupported_reason": "moe.kernels.fused_moe.host:tma_unsupported_reason",
    "tuned_configs": "moe.kernels.fused_moe.tiles:tuned_configs",
    "use_tma_scratch": "moe.kernels.fused_moe.host:use_tma_scratch",
}


def __getattr__(name: str) -> Any:
    """The lazily re-exported names of `_LAZY`, imported on first use."""
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module_name, _, attribute = _LAZY[name].partition(":")
    return getattr(importlib.import_module(module_name), attribute)
