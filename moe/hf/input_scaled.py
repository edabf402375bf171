"""Blocks whose experts scale their *input* by the routing weight (Llama-4), on the experts
path of `moe.hf.convert`.

Shape legend: T tokens, K top-k, E routed experts, H hidden, I one expert's width.

Llama-4's MoE block (`Llama4TextMoe`) does not call its experts as transformers' experts
interface does. Its router gives scores [T, E] (sigmoid of the top-k logits, 0 elsewhere)
and the block runs every expert on every token, densely, on ``x * score``:

    out = shared_expert(x) + sum_e expert_e(x * score_e)       (score_e = 0: expert_e(0) = 0)

With one expert per token (every Llama-4 checkpoint routes top-1) that is
``expert_k(x * w_k)`` for the token's routed expert k, which dbo's dispatch, experts and
combine compute with a weight of 1 on the pre-scaled row. `InputScaledBlock` replaces the
block: the model's own router and shared expert are kept, its experts become an
`HFExperts` (this rank's experts only; the module stores [E, H, 2I] / [E, I, H], the
interface's ``is_transposed``). Top-k > 1 would scale one token's input differently per
expert, which one dispatched row cannot carry: refused.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["INPUT_SCALED_BLOCKS", "InputScaledBlock", "input_scaled_options"]

#: Block classes whose experts take their input scaled by the routing weight, and the
#: names of their router and shared-expert children.
INPUT_SCALED_BLOCKS: dict[str, tuple[str, str]] = {
    "Llama4TextMoe": ("router", "shared_expert"),
}


def input_scaled_options(block: nn.Module, top_k: Any, refuse: Any) -> dict[str, bool]:
    """The experts-interface options of the block's experts module (gated, concatenated,
    transposed, no bias); ValueError (via `refuse`) for what dbo cannot run."""
    router_name, shared_name = INPUT_SCALED_BLOCKS[type(block).__name__]
    for name in (router_name, shared_name):
        if not isinstance(getattr(block, name, None), nn.Module):
            raise refuse(f"no {name!r} module (the block's router and shared expert)")
    if top_k != 1:
        raise refuse(f"its experts scale their input by the routing weight, and with "
                     f"top_k={top_k} one token's input differs per expert, which one "
                     f"dispatched row cannot carry: dbo runs such blocks at top-1 (as every "
                     f"Llama-4 checkpoint routes)")
    return {"is_concatenated": True, "is_transposed": True, "has_bias": False,
            "has_gate": True, "has_post_expert_norm": False}


class InputScaledBlock(nn.Module):
    """The converted block: the model's router and shared expert, dbo's experts on the
    routed rows scaled by their weight; returns what the replaced block returns,
    (out [T, H], router_logits [T, E]).

    Args:
        old: the replaced block (its router and shared expert are taken over).
        experts: the `moe.hf.generic.HFExperts` of its experts (top-1).
    """

    #: Which conversion path produced this block (`HFExperts.dbo_path` inside).
    dbo_path = "experts"

    def __init__(self, old: nn.Module, experts: nn.Module) -> None:
        super().__init__()
        router_name, shared_name = INPUT_SCALED_BLOCKS[type(old).__name__]
        self.router_name, self.shared_name = router_name, shared_name
        self.source = type(old).__name__
        self.hidden_dim = experts.config.hidden_size
        self.top_k = experts.config.top_k
        # The same child names as the replaced block: its state dict keeps their names.
        setattr(self, router_name, getattr(old, router_name))
        setattr(self, shared_name, getattr(old, shared_name))
        self.experts = experts

    def forward(self, hidden_states: Tensor) -> tuple[Tensor, Tensor]:
        x_TH = hidden_states.reshape(-1, self.hidden_dim)
        scores_TE, logits_TE = getattr(self, self.router_name)(x_TH)
        # The router's own choice (top-k of its logits); its score at that expert.
        ids_TK = torch.topk(logits_TE, self.top_k, dim=1).indices
        weight_TK = scores_TE.gather(1, ids_TK)
        routed_TH = self.experts(x_TH * weight_TK.to(x_TH.dtype), ids_TK,
                                 torch.ones_like(weight_TK, dtype=torch.float32))
        out_TH = getattr(self, self.shared_name)(x_TH)
        out_TH.add_(routed_TH)
        return out_TH, logits_TE

    def extra_repr(self) -> str:
        return f"{self.source}: routing weight on the experts' input, top-{self.top_k}"
