"""The `IMPLEMENTATION` switch shared by the modules that have a Triton kernel and a torch
version of the same op (`moe.kernels.rows`, `moe.kernels.slots`, `moe.router`).

    "auto"    Triton for CUDA tensors, torch otherwise (the default)
    "triton"  Triton everywhere: on CPU only under TRITON_INTERPRET=1, for tests
    "torch"   the torch ops (the reference)

The Triton module is imported on first use (`triton_module`), so importing the op's
module never needs Triton, and TRITON_INTERPRET is read only then.
"""
from __future__ import annotations

import importlib
from types import ModuleType

from torch import Tensor

IMPLEMENTATIONS = ("auto", "triton", "torch")


def use_triton(implementation: str, owner: str, t: Tensor) -> bool:
    """Whether `owner`'s op on tensor `t` takes its Triton kernel under `implementation`
    (`owner` names the module in the error for an unknown value)."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"{owner}.IMPLEMENTATION={implementation!r}: use one of "
                         f"{IMPLEMENTATIONS}")
    if implementation == "auto":
        return t.device.type == "cuda"
    return implementation == "triton"


def triton_module(name: str) -> ModuleType:
    """The Triton kernels' module `name` (e.g. "moe.kernels.rows_triton"), imported now."""
    return importlib.import_module(name)
