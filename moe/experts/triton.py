"""`TritonExperts`: the fused MoE Triton kernels (`moe.kernels.fused_moe`) as an expert
path.

Shape legend: N rows (tokens), K top-k, E local experts, H hidden, I intermediate.

Triton is imported lazily, on the first `apply`, so that importing `moe` never needs it and
so that TRITON_INTERPRET (read by Triton when the kernel is defined) is settled by then.
On CPU the kernel runs only under TRITON_INTERPRET=1 (tests at small shapes).

Where the caller says kernels of other streams run beside the experts (`apply`'s
`sms_shared`: the modular kernel in a DBO step, and where the bench's probes mark a
model, `moe.modular_kernel.sharing_sms`), the GEMMs never take the persistent kernel:
its one program per SM holds every SM until the GEMM ends, so communication kernels
queued meanwhile on another stream wait for it (the fused-MoE host's own choice,
`moe.kernels.fused_moe.rules.choose_paths`; the figures:
`moe/kernels/fused_moe/KERNELS.md`).
"""
from __future__ import annotations

import importlib.util
import os
import sys
from typing import ClassVar, Optional

import torch
from torch import Tensor

from dbo.compiling import compiling, eager_twin
from moe.experts.base import Experts, check_expert_inputs
from moe.experts.form import ExpertExtras, ExpertForm
from moe.kernels.fused_moe.form import unsupported_reason
from moe.kernels.policy import KernelPolicy
from moe.workspace import Workspace

__all__ = ["TritonExperts"]

_INSTALL_HINT = "pip install triton"


class TritonExperts(Experts):
    """Align rows by expert, then two grouped Triton GEMMs (the expert's biases and
    activation, SiLU-gate by default, and the routing weight fused into their epilogues)
    and a deterministic fp32 sum over k.

    Args:
        policy: the kernel paths (`moe.kernels.policy.KernelPolicy`); where the caller
            says SMs are shared (`apply`'s `sms_shared`) no persistent GEMM, whatever its
            `persistent`.
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
            kernels = sys.modules.get("moe.kernels.fused_moe.gemm_triton")
            if kernels is not None and not _is_interpreted(kernels.fused_moe_kernel):
                return False, (
                    "moe.kernels.fused_moe.gemm_triton was imported before TRITON_INTERPRET=1 "
                    "was set, so its kernel is compiled for the GPU: set it before the first "
                    "import"
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
        GEMMs' epilogues, a post-expert norm on GEMM2's rows (`moe.kernels.fused_moe.form`)."""
        return unsupported_reason(form)

    def apply(self, x_NH: Tensor, w13_EIH: Tensor, w2_EHI: Tensor, topk_ids_NK: Tensor,
              topk_weights_NK: Tensor, *, workspace: Workspace | None = None,
              extras: ExpertExtras | None = None, sms_shared: bool = False) -> Tensor:
        """See `Experts.apply`. Routing, the expert-sorted [P, I] activation and the
        [N*K, H] weighted rows (sharing memory with the sorted x where that path is taken)
        come from ``workspace`` when given; ids are not range-checked (no host sync).
        No persistent GEMMs with `sms_shared` (module doc). ValueError, before anything
        runs, for an `extras` form the kernels do not compute (`supports`)."""
        if extras is not None:
            reason = self.supports(extras.form)
            if reason is not None:
                raise ValueError(reason)
        if compiling() and extras is not None:
            # A form's biases, norm and limits cannot enter an op's arguments: the kernels
            # run eagerly, a graph break (`dbo.compiling`).
            return _kernels_eagerly(self, x_NH, w13_EIH, w2_EHI, topk_ids_NK, topk_weights_NK,
                                    workspace, extras, sms_shared)
        if compiling():  # one opaque op of the graph (`_fused_experts_op`)
            p = self.policy
            return _fused_experts_op(x_NH, w13_EIH, w2_EHI, topk_ids_NK, topk_weights_NK,
                                     p.implementation, p.compiled_launches, p.tma, p.sorted_x,
                                     p.persistent, sms_shared)
        return self._kernels(x_NH, w13_EIH, w2_EHI, topk_ids_NK, topk_weights_NK,
                             workspace, extras, sms_shared)

    def _kernels(self, x_NH: Tensor, w13_EIH: Tensor, w2_EHI: Tensor, topk_ids_NK: Tensor,
                 topk_weights_NK: Tensor, workspace: Workspace | None,
                 extras: ExpertExtras | None, sms_shared: bool) -> Tensor:
        """The `Experts.apply` contract's checks, then the fused-MoE kernels."""
        from moe.kernels.fused_moe.host import fused_moe  # lazy: imports triton

        check_expert_inputs(x_NH, w13_EIH, w2_EHI, topk_ids_NK, topk_weights_NK, extras)
        return fused_moe(x_NH, w13_EIH, w2_EHI, topk_ids_NK, topk_weights_NK,
                         workspace=workspace, policy=self.policy, extras=extras,
                         sms_shared=sms_shared)


_kernels_eagerly = eager_twin(TritonExperts._kernels)


@torch.library.custom_op("moe::fused_experts", mutates_args=())
def _fused_experts_op(x_NH: Tensor, w13_EIH: Tensor, w2_EHI: Tensor, topk_ids_NK: Tensor,
                      topk_weights_NK: Tensor, implementation: str, compiled_launches: bool,
                      tma: Optional[bool], sorted_x: Optional[bool],
                      persistent: Optional[bool], sms_shared: bool) -> Tensor:
    """`TritonExperts.apply` as one op of a graph that `torch.compile` traced: dynamo cannot
    trace the fused-MoE host code (tiles, autotuning, compiled-handle launches), so the
    compiler sees an opaque kernel with a fresh [N, H] output in x's dtype, and when the
    graph runs the op runs the eager path, which decides as it does eagerly (no
    persistent kernel with `sms_shared` included). The policy comes as scalars (an op
    takes no dataclass); no workspace (the compiler plans the buffers around the op)."""
    policy = KernelPolicy(implementation=implementation, compiled_launches=compiled_launches,
                          tma=tma, sorted_x=sorted_x, persistent=persistent)
    return TritonExperts(policy=policy).apply(x_NH, w13_EIH, w2_EHI, topk_ids_NK,
                                              topk_weights_NK, sms_shared=sms_shared)


@_fused_experts_op.register_fake
def _fused_experts_fake(x_NH: Tensor, *args: object) -> Tensor:
    return x_NH.new_empty(x_NH.shape)


def _is_interpreted(kernel: object) -> bool:
    """Whether Triton defined `kernel` under TRITON_INTERPRET=1."""
    return type(kernel).__name__ == "InterpretedFunction"
