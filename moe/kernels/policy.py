"""`KernelPolicy`: the choices between kernel paths, passed in (never read from a module
global), shared by every kernel room (fused MoE, the backends' row and slot kernels,
routing, rotary). Pure Python: no Triton, nothing launched. The rules the fused-MoE host
applies per GEMM when the policy leaves a choice open are `moe.kernels.fused_moe.rules`.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType

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
    `moe.kernels.fused_moe.rules.prefer_tma` where the GPU and operands allow it, since
    TMA wins on deep GEMMs and pointer loads on shallow ones; True (both GEMMs) raises
    ValueError where TMA cannot load the operands; False: pointer loads only."""
    sorted_x: bool | None = None
    """Fused MoE: copy x into the sorted row order first, so GEMM1 loads A by TMA too
    (needs GEMM1 on TMA). None: `prefer_sorted_x`, since it pays only for the
    one-program-per-tile GEMM1 with x well over L2."""
    persistent: bool | None = None
    """Fused MoE: run a GEMM as the persistent kernel (one program per SM over the tile
    table, TMA loads). None: per GEMM by `prefer_persistent`, since it wins on large
    batches outside DBO and loses where few rows per expert or other streams' kernels
    share the SMs; True (both GEMMs) raises ValueError where TMA cannot load the
    operands; False: never. Where the caller says other streams' kernels share the SMs
    (`fused_moe(..., sms_shared=True)`: a DBO step) the kernel is never taken, True or
    None."""

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
