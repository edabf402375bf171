"""`BoundExperts`: an expert kernel with one layer's `ExpertExtras` bound to it.

The modular kernel (`moe.modular_kernel`) hands its experts the weights w13 and w2 of each
call and nothing else; a layer whose experts need more (biases, a custom gate, a
post-expert norm: `moe.experts.form`) wraps its kernel in a `BoundExperts`, which adds
the layer's extras to every call. The extras are read through a callable on each call, so
they follow the layer's parameters (moved, reloaded) instead of a copy taken once.
"""
from __future__ import annotations

from typing import Callable, ClassVar

import torch
from torch import Tensor

from moe.experts.base import Experts
from moe.experts.form import ExpertExtras
from moe.workspace import Workspace

__all__ = ["BoundExperts"]


class BoundExperts(Experts):
    """`inner`'s `apply` with `extras()` passed on every call.

    Args:
        inner: the kernel (built for the extras' form: `make_experts(..., form=)`).
        extras: returns the layer's extras (its form and this rank's tensors).
    """

    name: ClassVar[str] = "bound"

    def __init__(self, inner: Experts, extras: Callable[[], ExpertExtras]) -> None:
        self.inner = inner
        self.extras = extras
        self.name = inner.name  # type: ignore[misc]  # the kernel's name, as callers report it

    @classmethod
    def is_available(cls, device: torch.device) -> tuple[bool, str]:
        return True, ""

    def apply(self, x_NH: Tensor, w13_EIH: Tensor, w2_EHI: Tensor, topk_ids_NK: Tensor,
              topk_weights_NK: Tensor, *, workspace: Workspace | None = None,
              extras: ExpertExtras | None = None, sms_shared: bool = False) -> Tensor:
        """`Experts.apply` of the inner kernel with the bound extras (`extras` must be None:
        a bound kernel takes its layer's)."""
        if extras is not None:
            raise ValueError("BoundExperts: the extras are bound already: call apply without "
                             "extras=")
        return self.inner.apply(x_NH, w13_EIH, w2_EHI, topk_ids_NK, topk_weights_NK,
                                workspace=workspace, extras=self.extras(),
                                sms_shared=sms_shared)
