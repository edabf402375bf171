"""What each fused-MoE GEMM computes for an expert form (`moe.experts.form.ExpertForm`,
read through the fields named by `KernelForm`: the kernels import nothing of the
experts), host side: the constexpr flags of its epilogue and its role in the pair. Pure
Python: no Triton, nothing launched (`TritonExperts.supports` reads
`unsupported_reason`).

=====================  ================================================================
form                   the kernels (`moe.kernels.fused_moe.epilogue_triton`)
=====================  ================================================================
``interleaved``        GEMM1 loads gate row 2n and up row 2n + 1 (INTERLEAVED)
``bias``               b13 added in GEMM1's epilogue before the activation, b2 in
                       GEMM2's before the routing weight (HAS_BIAS)
``gated=False``        GEMM1 on the I up rows, act(h) in its epilogue (GATED False)
``activation``         silu, gelu, gelu_tanh, relu, relu2, sigmoid, swiglu_oai in GEMM1's
                       epilogue (ACTIVATION, ALPHA), in fp32
``swiglu_limit``       the gate and up clamped first in GEMM1's epilogue (LIMIT)
``post_norm``          GEMM2 writes the unweighted fp32 rows; the host runs the norm on
                       them, then weights and sums (`moe.kernels.fused_moe.host`)
"custom" activation    refused: the model's own callable cannot run in a kernel
=====================  ================================================================
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol

import torch

__all__ = ["GEMM1", "GEMM2", "GemmEpilogue", "GemmRole", "KernelExtras", "KernelForm",
           "epilogues", "gemm_role", "unsupported_reason"]


class KernelForm(Protocol):
    """What the kernels read of an expert form (`moe.experts.form.ExpertForm`)."""

    @property
    def activation(self) -> str: ...
    @property
    def gated(self) -> bool: ...
    @property
    def interleaved(self) -> bool: ...
    @property
    def swiglu_limit(self) -> Optional[float]: ...
    @property
    def swiglu_alpha(self) -> Optional[float]: ...


class KernelExtras(Protocol):
    """What the kernels read of an expert form's tensors (`moe.experts.form.ExpertExtras`):
    the form, the [E, rows] biases of GEMM1 and GEMM2 (or None) and the post-expert norm
    (or None)."""

    @property
    def form(self) -> KernelForm: ...
    @property
    def bias13_EJ(self) -> Optional[torch.Tensor]: ...
    @property
    def bias2_EH(self) -> Optional[torch.Tensor]: ...
    @property
    def post_norm(self) -> Optional[Callable[[torch.Tensor], torch.Tensor]]: ...


#: The activations the kernels' epilogue computes (`epilogue_triton.activation`).
KERNEL_ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "relu", "relu2", "sigmoid", "swiglu_oai")


@dataclass(frozen=True)
class GemmEpilogue:
    """One GEMM's part of the expert form (the kernels' flags of the same names)."""

    first: bool
    """GEMM1: writes the [P, I] activation in the sorted row order; else GEMM2: writes
    rows by routed id."""
    gated: bool = False
    """B holds gate and up rows (2N), the epilogue multiplies act(gate) by up."""
    activation: str = "none"
    """A name of `KERNEL_ACTIVATIONS`, or "none" (GEMM2)."""
    interleaved: bool = False
    limit: float = 0.0
    """> 0: clamp the gate and up first (gated only)."""
    alpha: float = 0.0
    """swiglu_oai's alpha."""

    def flags(self, *, bias: bool) -> dict[str, Any]:
        """The kernels' constexpr flags of this epilogue (`bias`: HAS_BIAS)."""
        return {"GATED": self.gated, "INTERLEAVED": self.interleaved,
                "ACTIVATION": self.activation, "HAS_BIAS": bias, "LIMIT": self.limit,
                "ALPHA": self.alpha}


#: dbo's default expert: silu(gate) * up, then the plain down GEMM.
GEMM1 = GemmEpilogue(first=True, gated=True, activation="silu")
GEMM2 = GemmEpilogue(first=False)


def unsupported_reason(form: KernelForm) -> str | None:
    """None when the Triton kernels compute experts of `form`, else why not (one line)."""
    if form.activation not in KERNEL_ACTIVATIONS:
        names = ", ".join(KERNEL_ACTIVATIONS)
        return (f"the triton experts compute the named activations ({names}) in their "
                f"GEMM epilogue, not the model's own activation callable "
                f"(activation={form.activation!r}): use experts 'grouped' or 'reference'")
    return None


def epilogues(form: KernelForm) -> tuple[GemmEpilogue, GemmEpilogue]:
    """GEMM1's and GEMM2's epilogues for `form` (the biases and post-norm are the host's:
    `fused_moe`). ValueError for a form the kernels do not compute."""
    reason = unsupported_reason(form)
    if reason is not None:
        raise ValueError(reason)
    first = GemmEpilogue(first=True, gated=form.gated, activation=form.activation,
                         interleaved=form.interleaved,
                         limit=float(form.swiglu_limit or 0.0),
                         alpha=float(form.swiglu_alpha or 0.0))
    return first, GEMM2  # the default form's GEMM1 equals `GEMM1`


@dataclass(frozen=True)
class GemmRole:
    """What makes a launch GEMM1 or GEMM2 of the pair, in both kernels' terms."""

    weights: torch.Tensor
    """The routing weights' pointer argument (C when unused)."""
    weights_top_k: int
    stride_wn: int
    bias: torch.Tensor
    """The biases' pointer argument (C when unused)."""
    flags: dict[str, Any]
    """A_ROWS_DIV, A_SORTED, C_SORTED, MUL_ROUTED_WEIGHT, INPUT_PRECISION and the
    epilogue's flags (`GemmEpilogue.flags`)."""


def gemm_role(a: torch.Tensor, c: torch.Tensor, weights_NK: torch.Tensor | None, *,
              a_rows_div: int, a_sorted: bool, epilogue: GemmEpilogue | None = None,
              bias: torch.Tensor | None = None) -> GemmRole:
    """A launch's role: `epilogue` (None: dbo's default GEMM1 when `weights_NK` is None,
    else its GEMM2), weighted by float32 [N, K] routing weights when given (made
    unit-stride in their last dim if needed), with the [E, rows] `bias` when given
    (made contiguous). `a_sorted`: A is in the sorted row order."""
    if epilogue is None:
        epilogue = GEMM1 if weights_NK is None else GEMM2
    if weights_NK is not None and weights_NK.stride(1) != 1:
        weights_NK = weights_NK.contiguous()
    # Follow torch's matmul: exact fp32 unless the user allowed TF32 (16-bit: unused).
    ieee = a.dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32
    flags = {"A_ROWS_DIV": a_rows_div, "A_SORTED": a_sorted, "C_SORTED": epilogue.first,
             "MUL_ROUTED_WEIGHT": weights_NK is not None,
             "INPUT_PRECISION": "ieee" if ieee else "tf32",
             **epilogue.flags(bias=bias is not None)}
    bias_arg = c if bias is None else bias.contiguous()
    if weights_NK is None:
        return GemmRole(c, 1, 1, bias_arg, flags)
    return GemmRole(weights_NK, weights_NK.shape[1], weights_NK.stride(0), bias_arg, flags)
