"""`ExpertForm`: what one expert computes, for experts other than dbo's SwiGLU default, and
`ExpertExtras`, the tensors and callables such a form needs on each call.

Shape legend: M rows, E local experts, H hidden, I one expert's width, J the rows of w13:
2I for a gated expert (gate rows, then up rows; or interleaved), I without a gate.

dbo's default expert (`ExpertForm()`) is ``W2 (silu(Wg x) * (Wu x))``. A form changes it:

==================  =====================================================================
field               the expert computes
==================  =====================================================================
``gated=False``     ``W2 act(Wu x)``: w13 holds the I up rows only
``activation``      act, one of `ACTIVATIONS` ("silu", "gelu", ...), "swiglu_oai" (GPT-OSS:
                    ``gate * sigmoid(alpha * gate) * (up + 1)``), or "custom": the callable
                    `ExpertExtras.gate_fn` maps the first GEMM's [M, J] to [M, I]
``swiglu_limit``    gate clamped to <= limit and up to [-limit, limit] before the gate
``swiglu_alpha``    the alpha of "swiglu_oai"
``interleaved``     w13's rows alternate gate, up, gate, up, ... (GPT-OSS)
``bias``            b13 [E, J] added after the first GEMM, b2 [E, H] after the second
``post_norm``       `ExpertExtras.post_norm` ([M, H] -> [M, H]) on each expert's output,
                    before the routing weight
==================  =====================================================================

`activate` is the one implementation of the gate the torch kernels (`reference`,
`grouped`) share; the Triton kernels compute every form but "custom" in their GEMM
epilogues (`moe.kernels.fused_moe.form`, `TritonExperts.supports`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["ACTIVATIONS", "DEFAULT_FORM", "ExpertExtras", "ExpertForm", "activate",
           "apply_activation", "form_activation"]

#: Activations by name (float32 in, float32 out).
ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "relu2": lambda x: torch.square(F.relu(x)),
    "sigmoid": torch.sigmoid,
}
_GATE_ONLY = ("swiglu_oai",)
_CUSTOM = "custom"


@dataclass(frozen=True, kw_only=True)
class ExpertForm:
    """What each routed expert computes (module doc); the default is dbo's SwiGLU."""

    gated: bool = True
    """act(gate) * up with w13 = [gate; up] rows (2I); False: act(up), w13 the I up rows."""
    activation: str = "silu"
    """A name of `ACTIVATIONS`, "swiglu_oai" (gated only, needs swiglu_alpha), or "custom"
    (the callable `ExpertExtras.gate_fn`)."""
    swiglu_limit: Optional[float] = None
    """Gated only: clamp the gate to <= limit and up to [-limit, limit] first; None: none."""
    swiglu_alpha: Optional[float] = None
    """"swiglu_oai" only: the gate is gate * sigmoid(alpha * gate), up is up + 1."""
    interleaved: bool = False
    """Gated only: w13's rows alternate gate, up (GPT-OSS) instead of all gate rows first."""
    bias: bool = False
    """Biases b13 [E, J] and b2 [E, H] (`ExpertExtras`)."""
    post_norm: bool = False
    """A norm over H on each expert's output (`ExpertExtras.post_norm`)."""

    def __post_init__(self) -> None:
        for name in ("gated", "interleaved", "bias", "post_norm"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise TypeError(f"ExpertForm.{name}={value!r}: must be True or False")
        names = (*ACTIVATIONS, *_GATE_ONLY, _CUSTOM)
        if self.activation not in names:
            raise ValueError(f"ExpertForm.activation={self.activation!r}: use one of {names}")
        if not self.gated:
            for name in ("swiglu_limit", "swiglu_alpha", "interleaved"):
                if getattr(self, name) not in (None, False):
                    raise ValueError(f"ExpertForm.{name}={getattr(self, name)!r} needs a gated "
                                     f"expert (gated=True): an expert without a gate has no "
                                     f"gate/up pair")
            if self.activation in _GATE_ONLY:
                raise ValueError(f"ExpertForm.activation={self.activation!r} needs gated=True")
        for name in ("swiglu_limit", "swiglu_alpha"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not math.isfinite(value) or value <= 0):
                raise ValueError(f"ExpertForm.{name}={value!r}: must be a finite number > 0, "
                                 f"or None")
        if (self.activation == "swiglu_oai") != (self.swiglu_alpha is not None):
            raise ValueError(f"ExpertForm: swiglu_alpha={self.swiglu_alpha!r} goes with "
                             f"activation 'swiglu_oai' and only with it (got "
                             f"{self.activation!r})")
        if self.activation == _CUSTOM and (self.swiglu_limit is not None or self.interleaved):
            raise ValueError("ExpertForm: a 'custom' activation takes the first GEMM's rows as "
                             "they are: its callable clamps and splits them itself (drop "
                             "swiglu_limit / interleaved)")

    @property
    def is_default(self) -> bool:
        """Whether this is dbo's SwiGLU expert, which every kernel computes."""
        return self == DEFAULT_FORM

    def rows_per_width(self) -> int:
        """J / I: the rows of w13 per unit of expert width (2 gated, 1 without a gate)."""
        return 2 if self.gated else 1

    def describe(self) -> str:
        """A short human description, e.g. "silu(gate) * up" or "relu2(up), bias"."""
        act = self.activation
        text = f"{act}(gate) * up" if self.gated else f"{act}(up)"
        if self.activation == "swiglu_oai":
            text = f"gate * sigmoid({self.swiglu_alpha:g} * gate) * (up + 1)"
        if self.activation == _CUSTOM:
            text = "the model's own gate" if self.gated else "the model's own activation"
        extras = [f"limit {self.swiglu_limit:g}" if self.swiglu_limit is not None else "",
                  "interleaved" if self.interleaved else "", "bias" if self.bias else "",
                  "post-expert norm" if self.post_norm else ""]
        return ", ".join([text, *(e for e in extras if e)])

    def differences(self) -> list[str]:
        """The fields that differ from the default, as "name=value" (for refusals)."""
        return [f"{f.name}={getattr(self, f.name)!r}" for f in fields(self)
                if getattr(self, f.name) != getattr(DEFAULT_FORM, f.name)]


DEFAULT_FORM = ExpertForm()


@dataclass(frozen=True, kw_only=True)
class ExpertExtras:
    """A form and what it needs beyond w13 and w2 on each call (this rank's experts).

    `bias13_EJ` [E, J] and `bias2_EH` [E, H] (x's dtype or float32) with `form.bias`;
    `gate_fn` ([M, J] -> [M, I]) with activation "custom"; `post_norm` ([M, H] -> [M, H])
    with `form.post_norm`.
    """

    form: ExpertForm
    bias13_EJ: Optional[Tensor] = None
    bias2_EH: Optional[Tensor] = None
    gate_fn: Optional[Callable[[Tensor], Tensor]] = None
    post_norm: Optional[Callable[[Tensor], Tensor]] = None

    def __post_init__(self) -> None:
        form = self.form
        if not isinstance(form, ExpertForm):
            raise TypeError(f"ExpertExtras.form={form!r}: pass a moe.experts.form.ExpertForm")
        for name, wanted in (("bias13_EJ", form.bias), ("bias2_EH", form.bias),
                             ("gate_fn", form.activation == _CUSTOM),
                             ("post_norm", form.post_norm)):
            if (getattr(self, name) is not None) != wanted:
                raise ValueError(f"ExpertExtras.{name} must be {'given' if wanted else 'None'} "
                                 f"for the form {form.describe()!r}")

    def check(self, w13_EJH: Tensor, w2_EHI: Tensor) -> None:
        """ValueError when the biases do not match the weights' shapes."""
        if not self.form.bias:
            return
        e, j = w13_EJH.shape[:2]
        h = w2_EHI.shape[1]
        assert self.bias13_EJ is not None and self.bias2_EH is not None
        for name, tensor, shape in (("bias13", self.bias13_EJ, (e, j)),
                                    ("bias2", self.bias2_EH, (e, h))):
            if tuple(tensor.shape) != shape:
                raise ValueError(f"experts: {name} has shape {tuple(tensor.shape)}, expected "
                                 f"{shape} to match w13 {tuple(w13_EJH.shape)} / w2 "
                                 f"{tuple(w2_EHI.shape)}")


def apply_activation(name: str, x: Tensor) -> Tensor:
    """`ACTIVATIONS[name](x)`; KeyError naming the valid names otherwise."""
    return ACTIVATIONS[name](x)


def activate(h_MJ: Tensor, extras: Optional[ExpertExtras]) -> Tensor:
    """The expert's activation on the first GEMM's output (biases already added): [M, J]
    float32 -> [M, I] float32. `extras` None: the default, silu(gate) * up."""
    if extras is None:
        return form_activation(h_MJ, DEFAULT_FORM)
    return form_activation(h_MJ, extras.form, gate_fn=extras.gate_fn)


def form_activation(h_MJ: Tensor, form: ExpertForm, *,
                    gate_fn: Optional[Callable[[Tensor], Tensor]] = None) -> Tensor:
    """`activate` for a form and, for activation "custom", its callable."""
    if form.activation == _CUSTOM:
        if gate_fn is None:
            raise ValueError("ExpertForm(activation='custom') needs its gate_fn")
        return gate_fn(h_MJ).float()
    if not form.gated:
        return apply_activation(form.activation, h_MJ)
    if form.interleaved:
        gate_MI, up_MI = h_MJ[:, 0::2], h_MJ[:, 1::2]
    else:
        inter = h_MJ.shape[1] // 2
        gate_MI, up_MI = h_MJ[:, :inter], h_MJ[:, inter:]
    if form.swiglu_limit is not None:
        gate_MI = gate_MI.clamp(max=form.swiglu_limit)
        up_MI = up_MI.clamp(min=-form.swiglu_limit, max=form.swiglu_limit)
    if form.activation == "swiglu_oai":
        assert form.swiglu_alpha is not None
        return gate_MI * torch.sigmoid(gate_MI * form.swiglu_alpha) * (up_MI + 1)
    return apply_activation(form.activation, gate_MI) * up_MI
