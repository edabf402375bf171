"""What an expert of a transformers experts module computes, read from the module itself
(`moe.hf.generic`'s experts path): its `moe.experts.form.ExpertForm`, found by running the
module's own gate (`_apply_gate`, or `act_fn`) on a probe and matching a named
activation, else "custom" with the module's callable.

Shape legend: M probe rows, J the rows of the up projection (2I with a gate, I without),
I one expert's width.
"""
from __future__ import annotations

import copy
import math
from typing import Callable, Optional

import torch
from torch import Tensor, nn

from moe.experts.form import ACTIVATIONS, ExpertForm, form_activation

__all__ = ["gate_owner", "identify_form", "owner_gate"]

#: The expert tensors (dropped from the module kept for a custom gate: dbo holds them).
_WEIGHT_NAMES = ("gate_up_proj", "up_proj", "down_proj", "gate_up_proj_bias", "up_proj_bias",
                 "down_proj_bias")

def identify_form(module: nn.Module, options: dict[str, bool], *,
                  refuse: Callable[[str], ValueError], up: Optional[Tensor] = None,
                  gate_fn: Optional[Callable[[Tensor], Tensor]] = None
                  ) -> tuple[ExpertForm, Optional[Callable[[Tensor], Tensor]]]:
    """The module's form, and for a "custom" one the callable it runs (the module's
    `_apply_gate` gated, its `act_fn` without a gate; `gate_fn` where given). A named
    activation is taken when it computes what the module computes on a probe (values
    well past any clamp limit); ValueError when the module's own gate cannot run on the
    probe either. `up`: the up projection as the interface holds it (None: the module's
    `gate_up_proj` / `up_proj`), for its width and device."""
    gated = options["has_gate"]
    base = dict(gated=gated, bias=options["has_bias"], post_norm=options["has_post_expert_norm"])
    rows = getattr(module, "gate_up_proj" if gated else "up_proj") if up is None else up
    j = rows.shape[1 if not options["is_transposed"] else 2]
    limit = _scalar(module, ("limit", "swiglu_limit"))
    alpha = _scalar(module, ("alpha", "swiglu_alpha"))
    owner_fn = owner_gate(module, gated=gated) if gate_fn is None else gate_fn
    if owner_fn is None:
        raise refuse("no activation: the experts module has neither `_apply_gate` nor `act_fn`")
    probe_MJ = _probe(j, limit, device=rows.device if not rows.is_meta else torch.device("cpu"))
    try:
        with torch.no_grad():
            want = owner_fn(probe_MJ).float()
    except Exception as exc:  # noqa: BLE001 - any failure of the model's code is the reason
        raise refuse(f"its activation ({type(module).__name__}."
                     f"{'_apply_gate' if gated else 'act_fn'}) fails on a probe: "
                     f"{type(exc).__name__}: {exc}") from exc
    for form in _candidates(base, gated=gated, concatenated=options["is_concatenated"],
                            limit=limit, alpha=alpha):
        got = form_activation(probe_MJ, form)
        if got.shape == want.shape and torch.allclose(got, want, rtol=1e-5, atol=1e-6):
            return form, None
    return ExpertForm(**base, activation="custom"), owner_fn


def _candidates(base: dict[str, bool], *, gated: bool, concatenated: bool,
                limit: Optional[float], alpha: Optional[float]) -> list[ExpertForm]:
    """The named forms to try, most likely first."""
    if not gated:
        return [ExpertForm(**base, activation=name) for name in ACTIVATIONS]
    limits = [None] if limit is None else [limit, None]
    forms = []
    for interleaved in (not concatenated, concatenated):
        if alpha is not None:
            forms += [ExpertForm(**base, activation="swiglu_oai", swiglu_alpha=alpha,
                                 swiglu_limit=lim, interleaved=interleaved) for lim in limits]
        forms += [ExpertForm(**base, activation=name, swiglu_limit=lim, interleaved=interleaved)
                  for name in ACTIVATIONS for lim in limits]
    return forms


def _scalar(module: nn.Module, names: tuple[str, ...]) -> Optional[float]:
    """The first of `names` on the module that is a finite positive number."""
    for name in names:
        value = getattr(module, name, None)
        if isinstance(value, Tensor) and value.numel() == 1:
            value = float(value)
        if isinstance(value, (int, float)) and not isinstance(value, bool) \
                and math.isfinite(value) and value > 0:
            return float(value)
    return None


def _probe(width: int, limit: Optional[float], *, device: torch.device) -> Tensor:
    """[64, width] float32, spread over +-(2 * limit + 8), the same values every call."""
    gen = torch.Generator().manual_seed(0)
    span = 8.0 + 2.0 * (limit or 0.0)
    return ((torch.rand(64, width, generator=gen) * 2 - 1) * span).to(device)


def owner_gate(module: nn.Module, *, gated: bool) -> Optional[Callable[[Tensor], Tensor]]:
    """The module's gate ([M, J] -> [M, I]) gated, its activation without a gate."""
    if gated:
        fn = getattr(module, "_apply_gate", None)
        if fn is None and callable(getattr(module, "act_fn", None)):
            act = module.act_fn

            def fn(h_MJ: Tensor) -> Tensor:
                gate, up = h_MJ.chunk(2, dim=-1)
                return act(gate) * up
        return fn
    act = getattr(module, "act_fn", None)
    return act if callable(act) else None


def gate_owner(module: nn.Module) -> nn.Module:
    """A shallow copy of the experts module without its expert tensors or its post-expert
    norm: what its `_apply_gate` / `act_fn` read (limits, activations), and no more."""
    owner = copy.copy(module)
    owner._parameters = {k: v for k, v in module._parameters.items() if k not in _WEIGHT_NAMES}
    owner._buffers = dict(module._buffers)
    owner._modules = {k: v for k, v in module._modules.items() if k != "post_expert_norm"}
    return owner
