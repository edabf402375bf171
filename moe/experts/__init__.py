"""Expert kernels, registered by name and imported lazily.

==============  ===================================================  =====================
name            class                                                runs on
==============  ===================================================  =====================
``reference``   `moe.experts.reference.ReferenceExperts`             anywhere (ground truth)
``grouped``     `moe.experts.grouped.GroupedExperts`                 anywhere (grouped GEMM
                                                                     where torch has it)
``triton``      `moe.experts.triton.TritonExperts`                   CUDA with triton
``auto``        triton on CUDA if available, else grouped, else reference
==============  ===================================================  =====================

Experts of another form than dbo's SwiGLU (`moe.experts.form`: activations, no gate,
biases, a post-expert norm) run on every kernel, the Triton one refusing only a "custom"
activation (the model's own callable); `make_experts(..., form=)` picks or refuses a
kernel by `Experts.supports`, and `moe.experts.bound.BoundExperts` binds a
layer's `ExpertExtras` to a kernel for callers that pass the weights only.
"""
from __future__ import annotations

import importlib

import torch

from moe.experts.base import Experts, check_expert_inputs, weighted_topk_sum
from moe.experts.form import DEFAULT_FORM, ExpertForm
from moe.kernels.policy import KernelPolicy
from moe.registry import EXPERTS

__all__ = [
    "EXPERTS",
    "Experts",
    "check_expert_inputs",
    "experts_class",
    "make_experts",
    "weighted_topk_sum",
]

# EXPERTS (`moe.registry`): name -> "module:Class"; modules are imported on first use
# (heavy optional deps).

_AUTO_ORDER = ("triton", "grouped", "reference")


def experts_class(name: str) -> type[Experts]:
    """Import and return the kernel class registered as ``name``.

    Raises:
        ValueError: unknown name (the message lists the valid ones).
        ImportError: the kernel's module (or a dependency of it) cannot be imported.
    """
    if name not in EXPERTS:
        valid = ", ".join(sorted([*EXPERTS, "auto"]))
        raise ValueError(f"unknown experts kernel {name!r}: use one of {valid}.")
    module_name, _, class_name = EXPERTS[name].partition(":")
    cls = getattr(importlib.import_module(module_name), class_name)
    assert issubclass(cls, Experts), f"{EXPERTS[name]} is not an Experts subclass"
    return cls


def _availability(name: str, device: torch.device) -> tuple[type[Experts] | None, str]:
    try:
        cls = experts_class(name)
    except ImportError as exc:
        hint = " (pip install triton)" if name == "triton" else ""
        return None, f"cannot import {EXPERTS[name]}: {exc}{hint}"
    ok, reason = cls.is_available(device)
    return (cls, "") if ok else (None, reason)


def make_experts(name: str, device: torch.device | str, *,
                 policy: KernelPolicy = KernelPolicy(),
                 form: ExpertForm = DEFAULT_FORM) -> Experts:
    """Instantiate the expert kernel ``name`` ("auto" picks the best available that computes
    ``form``) for ``device``; the Triton experts take ``policy``.

    Raises:
        ValueError: unknown name, the kernel cannot run on ``device``, or it does not
            compute experts of ``form`` (with the reason).
    """
    device = torch.device(device)
    if name == "auto":
        reasons = []
        for candidate in _AUTO_ORDER:
            if candidate == "triton" and device.type != "cuda":
                continue
            cls, reason = _availability(candidate, device)
            if cls is not None:
                reason = cls.supports(form) or ""
                if not reason:
                    return _instantiate(cls, policy)
            reasons.append(f"{candidate}: {reason}")
        raise ValueError(f"no experts kernel runs on {device}: " + "; ".join(reasons))
    if name not in EXPERTS:
        experts_class(name)  # raises the ValueError listing valid names
    cls, reason = _availability(name, device)
    if cls is None:
        raise ValueError(f"experts kernel {name!r} is not available on {device}: {reason}.")
    unsupported = cls.supports(form)
    if unsupported is not None:
        raise ValueError(f"experts kernel {name!r}: {unsupported}")
    return _instantiate(cls, policy)


def _instantiate(cls: type[Experts], policy: KernelPolicy) -> Experts:
    return cls(policy=policy) if cls.name == "triton" else cls()
