"""MoE layers are inference-only: their output is exact, a backward through them raises.

Shape legend: T tokens, H hidden.

Nothing between an MoE layer's input and its output has a backward: the backends move
tokens with their routing as packed bytes through collectives (`moe.row_layout`),
into workspaces reused from call to call; the `grouped` experts write into buffers with
`out=` ops; the `triton` experts, the router's and the combine's Triton kernels have no
backward at all. Recording an autograd graph there gives either a crash deep inside torch
(`index_select(): functions with out=... arguments don't support automatic
differentiation`) or, worse, a silently wrong gradient (the routed experts' share missing,
the router's and experts' weights without a gradient).

So `MoELayer.forward` never records its inner graph. When autograd would record one
(grad mode on, and the input or a parameter of the layer requires grad), the layer runs
under `torch.no_grad()` and `detach_with_error` ties the output to those tensors with a
node whose backward raises `RuntimeError` naming the layer. The forward output is the same
as under `torch.inference_mode()`; a gradient that does not pass through an MoE layer
(e.g. only the LM head's, from `torch.autograd.grad`) is computed as usual; one that does
raises instead of coming out wrong.
"""
from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import Tensor, nn

__all__ = ["detach_with_error", "needs_graph"]


def needs_graph(x: Tensor, module: nn.Module) -> bool:
    """Whether autograd would record a graph for `module` applied to `x` now: grad mode is
    on and `x` or a parameter of `module` requires grad. Under no_grad or inference_mode
    (serving) it reads the grad mode only: the parameters are not walked."""
    if not torch.is_grad_enabled():
        return False
    return x.requires_grad or any(p.requires_grad for p in module.parameters())


class _RaiseOnBackward(torch.autograd.Function):
    """Identity forward on an output computed without a graph; backward raises."""

    @staticmethod
    def forward(ctx: Any, message: str, out: Tensor, *inputs: Tensor) -> Tensor:
        ctx.message = message
        return out

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> Any:
        raise RuntimeError(ctx.message)


def detach_with_error(out_TH: Tensor, inputs: Iterable[Tensor], *, what: str) -> Tensor:
    """`out_TH` (computed under no_grad) tied to the `inputs` that require grad, so that a
    backward reaching it raises a RuntimeError naming `what`. Same values, dtype, device
    and stream as `out_TH`; returned unchanged when no input requires grad."""
    needed = [t for t in inputs if t.requires_grad]
    if not needed:
        return out_TH
    message = (f"{what} is inference-only: it has no backward (its dispatch, combine and "
               f"expert kernels record no autograd graph), so no gradient can flow through it "
               f"to its input, router or expert weights. Serve under torch.inference_mode() "
               f"or torch.no_grad(), or leave the MoE layers out of the loss.")
    return _RaiseOnBackward.apply(message, out_TH, *needed)
