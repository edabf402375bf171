"""Router logits of a converted model for `output_router_logits=True` (the aux loss).

Shape legend: T tokens of the call, E routed experts.

transformers 5 collects router logits with forward hooks: the model class declares
`_can_record_outputs = {"router_logits": OutputRecorder(<Router class>, index=0)}`, the
base model's forward (`capture_outputs`) installs a hook on every module of that class
the first time an output is asked for, and each hook appends element 0 of its module's
output (the logits [T, E]) to the collector of the running call (a context variable:
each greenlet of a DBO step has its own, so each ubatch collects its own logits).
`HFRouter` is not of the router's class, so `convert` installs the same hook on it with
transformers' own installer; its output is the logits, computed as the model's router
computes them (in float32 for DeepSeek-V3), so `router_logits` and `aux_loss` are the
unconverted model's. Where transformers lacks that installer the converted model refuses
`output_router_logits` rather than return no logits.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

from torch import nn

__all__ = ["ROUTER_LOGITS", "record_router_logits"]

ROUTER_LOGITS = "router_logits"


def record_router_logits(model: nn.Module, routers: list[nn.Module]) -> None:
    """Make `routers` (the converted blocks' `HFRouter`s) feed `router_logits` wherever
    the model's classes record it; nothing for a model that records none."""
    if not _records_router_logits(model):
        return
    install = _hook_installer()
    if install is None:
        model.register_forward_pre_hook(_refuse_router_logits, with_kwargs=True)
        return
    for router in routers:
        install(router, ROUTER_LOGITS, 0)


def _records_router_logits(model: nn.Module) -> bool:
    return any(ROUTER_LOGITS in (getattr(type(m), "_can_record_outputs", None) or {})
               for m in model.modules())


def _hook_installer() -> Optional[Callable[[nn.Module, str, int], None]]:
    """transformers' `install_output_capuring_hook` (5.17 to 5.24 spell it so), or None."""
    try:
        from transformers.utils import output_capturing
    except ImportError:
        return None
    return getattr(output_capturing, "install_output_capuring_hook", None)


def _refuse_router_logits(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
    wanted = kwargs.get("output_router_logits")
    if wanted is None:
        wanted = getattr(getattr(module, "config", None), "output_router_logits", False)
    if wanted:
        raise NotImplementedError(
            "moe.hf: this transformers version has no output-capturing hook installer "
            "(transformers.utils.output_capturing.install_output_capuring_hook), so the "
            "converted model cannot return router_logits: call it with "
            "output_router_logits=False, or use transformers 5.17 to 5.24")
