"""`TritonExperts`: the fused MoE Triton kernel (`moe.kernels.fused_moe`) as an expert path.

Shape legend: N rows (tokens), K top-k, E local experts, H hidden, I intermediate.

Triton is imported lazily, on the first `apply`, so that importing `moe` never needs it and
so that TRITON_INTERPRET (read by Triton when the kernel is defined) is settled by then.
On CPU the kernel runs only under TRITON_INTERPRET=1 (tests at small shapes).

Where kernels of other streams run beside the experts (in a DBO step, and wherever
`sharing_sms()` says so), the GEMMs never take the persistent kernel: its one program per
SM holds every SM until the GEMM ends, so communication kernels queued meanwhile on
another stream wait for it (the figures: `moe/kernels/KERNELS.md`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import os
import sys
from contextvars import ContextVar
from typing import ClassVar, Iterator, Optional

import torch
from torch import Tensor

from dbo.compiling import compiling, eager_twin
from dbo.yield_points import dbo_enabled
from moe.experts.base import Experts
from moe.experts.form import ExpertExtras, ExpertForm
from moe.kernels.fused_moe_form import unsupported_reason
from moe.kernels.policy import KernelPolicy
from moe.workspace import Workspace

__all__ = ["TritonExperts", "sharing_sms"]

_SHARING_SMS: ContextVar[bool] = ContextVar("moe_experts_sharing_sms", default=False)


@contextlib.contextmanager
def sharing_sms() -> Iterator[None]:
    """Within: kernels of other streams may run beside the experts (the ceiling probe's
    overlapped steps say so; a DBO step needs no marking), so they use no persistent GEMM."""
    token = _SHARING_SMS.set(True)
    try:
        yield
    finally:
        _SHARING_SMS.reset(token)


def _sms_shared() -> bool:
    return _SHARING_SMS.get() or dbo_enabled()

_INSTALL_HINT = "pip install triton"


class TritonExperts(Experts):
    """Align rows by expert, then two grouped Triton GEMMs (the expert's biases and
    activation, SiLU-gate by default, and the routing weight fused into their epilogues)
    and a deterministic fp32 sum over k.

    Args:
        policy: the kernel paths (`moe.kernels.policy.KernelPolicy`); where SMs are shared
            its `persistent` is taken as False.
    """

    name: ClassVar[str] = "triton"

    def __init__(self, *, policy: KernelPolicy = KernelPolicy()) -> None:
        self.policy = policy

    @classmethod
    def is_available(cls, device: torch.device) -> tuple[bool, str]:
        """CUDA with triton installed, or CPU with TRITON_INTERPRET=1 (tests)."""
        device = torch.device(device)
        if importlib.util.find_spec("triton") is None:
            return False, f"triton is not installed: {_INSTALL_HINT}"
        if device.type == "cuda":
            if not torch.cuda.is_available():
                return False, "CUDA is not available in this torch build or machine"
            return True, ""
        if device.type == "cpu":
            kernels = sys.modules.get("moe.kernels.fused_moe_triton")
            if kernels is not None and not _is_interpreted(kernels.fused_moe_kernel):
                return False, (
                    "moe.kernels.fused_moe_triton was imported before TRITON_INTERPRET=1 was "
                    "set, so its kernel is compiled for the GPU: set it before the first import"
                )
            if os.environ.get("TRITON_INTERPRET") == "1":
                return True, ""
            return False, (
                "the Triton experts need a CUDA device; on CPU they run only under the "
                "interpreter (set TRITON_INTERPRET=1 before importing the kernel, for tests; "
                f"{_INSTALL_HINT})"
            )
        return False, f"device type {device.type!r} is not supported: use CUDA ({_INSTALL_HINT})"

    @classmethod
    def supports(cls, form: ExpertForm) -> str | None:
        """Every form but a "custom" activation (the model's own callable): interleaved
        gate/up, biases and the named activations (GPT-OSS's clamped SwiGLU too) run in the
        GEMMs' epilogues, a post-expert norm on GEMM2's rows (`moe.kernels.fused_moe_form`)."""
        return unsupported_reason(form)

    def apply(
        self,
        x_NH: Tensor,
        w13_EIH: Tensor,
        w2_EHI: Tensor,
        topk_ids_NK: Tensor,
        topk_weights_NK: Tensor,
        *,
        workspace: Workspace | None = None,
        extras: ExpertExtras | None = None,
    ) -> Tensor:
        """See `Experts.apply`. Routing, the expert-sorted [P, I] activation and the
        [N*K, H] weighted rows (sharing memory with the sorted x where that path is taken)
        come from ``workspace`` when given; ids are not range-checked (no host sync).
        No persistent GEMMs where SMs are shared (module doc). ValueError, before anything
        runs, for an `extras` form the kernels do not compute (`supports`)."""
        if extras is not None:
            reason = self.supports(extras.form)
            if reason is not None:
                raise ValueError(reason)
        if compiling() and extras is not None:
            # A form's biases, norm and limits cannot enter an op's arguments: the kernels
            # run eagerly, a graph break (`dbo.compiling`).
            return _kernels_eagerly(self, x_NH, w13_EIH, w2_EHI, topk_ids_NK, topk_weights_NK,
                                    workspace, extras)
        if compiling():  # one opaque op of the graph (`_fused_experts_op`)
            p = self.policy
            return _fused_experts_op(x_NH, w13_EIH, w2_EHI, topk_ids_NK, topk_weights_NK,
                                     p.implementation, p.compiled_launches, p.tma, p.sorted_x,
                                     p.persistent)
        return self._kernels(x_NH, w13_EIH, w2_EHI, topk_ids_NK, topk_weights_NK,
                             workspace, extras)

    def _kernels(self, x_NH: Tensor, w13_EIH: Tensor, w2_EHI: Tensor, topk_ids_NK: Tensor,
                 topk_weights_NK: Tensor, workspace: Workspace | None,
                 extras: ExpertExtras | None) -> Tensor:
        """The fused-MoE kernels (`apply` without its checks)."""
        from moe.kernels.fused_moe import fused_moe  # lazy: imports triton

        policy = self.policy
        if _sms_shared():
            policy = dataclasses.replace(policy, persistent=False)
        return fused_moe(x_NH, w13_EIH, w2_EHI, topk_ids_NK, topk_weights_NK,
                         workspace=workspace, policy=policy, extras=extras)


_kernels_eagerly = eager_twin(TritonExperts._kernels)


@torch.library.custom_op("moe::fused_experts", mutates_args=())
def _fused_experts_op(x_NH: Tensor, w13_EIH: Tensor, w2_EHI: Tensor, topk_ids_NK: Tensor,
                      topk_weights_NK: Tensor, implementation: str, compiled_launches: bool,
                      tma: Optional[bool], sorted_x: Optional[bool],
                      persistent: Optional[bool]) -> Tensor:
    """`TritonExperts.apply` as one op of a graph that `torch.compile` traced: dynamo cannot
    trace the fused-MoE host code (tiles, autotuning, compiled-handle launches), so the
    compiler sees an opaque kernel with a fresh [N, H] output in x's dtype, and when the
    graph runs the op runs the eager path, which decides as it does eagerly (no
    persistent kernel in a DBO step included). The policy comes as scalars (an op takes
    no dataclass); no workspace (the compiler plans the buffers around the op)."""
    policy = KernelPolicy(implementation=implementation, compiled_launches=compiled_launches,
                          tma=tma, sorted_x=sorted_x, persistent=persistent)
    return TritonExperts(policy=policy).apply(x_NH, w13_EIH, w2_EHI, topk_ids_NK,
                                              topk_weights_NK)


@_fused_experts_op.register_fake
def _fused_experts_fake(x_NH: Tensor, *args: object) -> Tensor:
    return x_NH.new_empty(x_NH.shape)


def _is_interpreted(kernel: object) -> bool:
    """Whether Triton defined `kernel` under TRITON_INTERPRET=1."""
    return type(kernel).__name__ == "InterpretedFunction"
