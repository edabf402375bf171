"""The sizes of a transformers experts module, read from its tensors, its block and the
model config (`moe.hf.generic`'s checks): (E, J, H, I), its zero-compute experts, the
sizes it declares, and the block's top-k.

Shape legend: E routed experts, J the rows of the up projection (2I with a gate, I
without), H hidden, I one expert's width, K top-k.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

from torch import Tensor, nn

__all__ = ["check_declared_sizes", "count_identity_experts", "expert_sizes", "find_top_k"]

#: Where blocks and routers keep K, then the model-config fields that hold it.
_TOP_K_ATTRS = ("top_k", "num_experts_per_tok", "topk", "num_selected_experts")
_TOP_K_FIELDS = ("num_experts_per_tok", "moe_k", "moe_topk", "top_k_experts",
                 "num_experts_per_token", "moe_top_k", "n_activated_experts", "top_k")


def expert_sizes(up: Tensor, down: Tensor, *, transposed: bool,
                 refuse: Callable[[str], ValueError], up_name: str) -> tuple[int, int, int, int]:
    """(E, J, H, I) from the module's tensors (ValueError when they disagree)."""
    if up.dim() != 3 or down.dim() != 3:
        raise refuse(f"experts.{up_name} {list(up.shape)} / down_proj {list(down.shape)} are "
                     f"not 3-D [E, ., .] tensors")
    if transposed:
        (e, h, j), (e2, i, h2) = up.shape, down.shape
    else:
        (e, j, h), (e2, h2, i) = up.shape, down.shape
    if e != e2 or h != h2:
        raise refuse(f"experts.{up_name} {list(up.shape)} and down_proj {list(down.shape)} "
                     f"disagree on the expert count or hidden size"
                     f"{' (is_transposed=True)' if transposed else ''}")
    return e, j, h, i


def count_identity_experts(module: nn.Module, up: Tensor, down: Tensor, *, transposed: bool) -> int:
    """Z: the experts `gate_up_proj` holds past `down_proj`'s, where the module computes
    them as identity (an `identity_expert` nn.Identity: zero-compute experts); else 0."""
    extra = up.shape[0] - down.shape[0]
    if extra > 0 and isinstance(getattr(module, "identity_expert", None), nn.Identity):
        return extra
    return 0


def check_declared_sizes(module: nn.Module, *, e: int, h: int, i: int,
                          refuse: Callable[[str], ValueError]) -> None:
    """The sizes the module was built for (its num_experts / hidden_dim /
    intermediate_dim, where it keeps them) against its tensors: weights of another model
    loaded into it differ."""
    for names, value, what in ((("num_experts",), e, "experts"),
                               (("hidden_dim", "hidden_size"), h, "hidden size"),
                               (("intermediate_dim", "intermediate_size"), i, "expert width")):
        for name in names:
            declared = getattr(module, name, None)
            if isinstance(declared, int) and not isinstance(declared, bool) and declared != value:
                raise refuse(f"its tensors hold {value} for the {what} but the module was built "
                             f"for {name}={declared}: the weights do not match the model config "
                             f"(a checkpoint of another model?)")


def find_top_k(block: nn.Module, module: nn.Module, model_config: Any) -> Optional[int]:
    """K: the block's (or one of its non-expert children's) `top_k`, else the model
    config's field; None when neither says."""
    owners = [block, *(child for child in block.children() if child is not module)]
    for owner in owners:
        for name in _TOP_K_ATTRS:
            value = getattr(owner, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    for name in _TOP_K_FIELDS:
        value = getattr(model_config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None
