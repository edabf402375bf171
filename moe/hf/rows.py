"""This rank's routed experts of a converted block: which rows of the replaced module's
expert tensors it holds, and copying them into dbo's layout (`moe.hf.convert` from a
loaded model, `moe.hf.load` from a checkpoint).

Shape legend: E routed experts, E_loc = E / W of them on this rank, W ranks in the EP
group, J the rows of the up projection (2I with a gate, I without), H hidden, I width, R
rows of a replaced tensor per expert (1, or I for a stored layout's [E * I, H] tensors:
`moe.hf.stored_experts`).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from moe.backends.base import ExpertPlacement
from moe.hf.generic import ExpertsPlan, module_tensor

__all__ = ["copy_rows", "expert_tensor_names", "fill_experts", "local_rows", "local_tensors",
           "rows_per_expert"]


def expert_tensor_names(plan: Any) -> tuple[str, ...]:
    """The expert tensors (names in the block's `experts` module, each [E, ...], dotted
    where a child holds them: "fc1.weight") of which a converted block holds this rank's
    rows, in the order w13, w2, bias13, bias2: `plan` a `BlockPlan` (fused) or an
    `ExpertsPlan`."""
    if not isinstance(plan, ExpertsPlan):
        return ("gate_up_proj", "down_proj")
    if plan.tensor_names is not None:  # a module of its own names (no bias: not served)
        return plan.tensor_names
    up = "gate_up_proj" if plan.form.gated else "up_proj"
    return (up, "down_proj") + ((f"{up}_bias", "down_proj_bias") if plan.form.bias else ())


def local_rows(plan: Any, *, rank: int, world: int) -> tuple[int, int]:
    """[first, stop): the experts rank `rank` of `world` holds (`ExpertPlacement`)."""
    placement = ExpertPlacement(rank, world, plan.config.num_experts)
    return placement.first_expert, placement.first_expert + placement.num_local_experts


def rows_per_expert(plan: Any) -> int:
    """R: the rows of each of the replaced module's expert tensors that one expert holds
    (I for a stored layout's [E * I, H] tensors, else 1: [E, ...] tensors)."""
    stored = getattr(plan, "stored", None)
    return 1 if stored is None else plan.config.intermediate_size


def local_tensors(plan: Any, module: nn.Module, *, rank: int, world: int) -> dict[str, Tensor]:
    """`expert_tensor_names` -> this rank's rows of each of experts `module`'s tensors,
    [E_loc * R, ...] (views), in its layout: what `copy_rows` takes."""
    first, stop = local_rows(plan, rank=rank, world=world)
    per = rows_per_expert(plan)
    return {name: module_tensor(module, name)[first * per:stop * per]
            for name in expert_tensor_names(plan)}


def copy_rows(plan: Any, new: nn.Module, rows: dict[str, Tensor]) -> None:
    """This rank's experts (`rows`: `expert_tensor_names` -> [E_loc * R, ...], in the
    replaced module's layout) into converted module `new` (an `HFMoEBlock` for a fused
    plan, an `HFExperts` for an `ExpertsPlan`), in dbo's layout."""
    if isinstance(plan, ExpertsPlan) and plan.stored is not None:
        with torch.no_grad():
            w13, w2 = plan.stored.to_interface(rows, width=plan.config.intermediate_size)
            new.w13.copy_(w13)
            new.w2.copy_(w2)
        return
    if isinstance(plan, ExpertsPlan):
        targets = [(new.w13, plan.transposed), (new.w2, plan.transposed), (new.bias13, False),
                   (new.bias2, False)]
    else:
        targets = [(new.moe.w13, False), (new.moe.w2, False)]
    with torch.no_grad():
        for name, (target, transposed) in zip(expert_tensor_names(plan), targets):
            target.copy_(rows[name].transpose(1, 2) if transposed else rows[name])


def fill_experts(model: nn.Module, plans: list[Any], rows: dict[str, dict[str, Tensor]]) -> None:
    """Copy this rank's experts into the blocks `convert_blocks(model, plans=plans)` made:
    `rows` maps a block's path to its `expert_tensor_names` -> [E_loc * R, ...]."""
    for plan in plans:
        block = model.get_submodule(plan.path)
        copy_rows(plan, block.experts if isinstance(plan, ExpertsPlan) else block,
                  rows[plan.path])
