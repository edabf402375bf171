"""`save_pretrained` of a converted model: the checkpoint the unconverted model would write.

    model = moe.hf.convert(model, group=ep_group)     # or moe.hf.load(path, group=ep_group)
    model.save_pretrained("out/")                     # on every rank of the EP group

Shape legend: E routed experts, E_loc = E / W of them on this rank, W ranks in the EP
group, J the rows of the up projection (2I with a gate, I without), H hidden, I width.

A converted block names its tensors as dbo does (`moe.w13` [E_loc, 2I, H], `experts.w13`
[E_loc, J, H], ...). `moe.hf.convert` records, per converted module, the names and shapes
of the module it replaced (`record_layout`), and gives the model a `save_pretrained`
(`save_in_transformers_names`) that writes the state dict of the unconverted model: every
converted tensor under its transformers name and layout, the routed experts of all ranks
gathered ([E, ...]), checked against that record, then transformers' own
`save_pretrained`, which converts names to its checkpoint format as for any model of the
family. `transformers.AutoModelForCausalLM.from_pretrained(dir)` and `moe.hf.load(dir)`
read it back. Experts stored in another layout than the interface's (DBRX's ``mlp.w1`` /
``v1`` / ``w2`` [E * I, H], `moe.hf.stored_experts`) are written back in it.

Under expert parallelism (W > 1) every rank of the group calls `save_pretrained`: rank 0
of the group gathers the experts and writes the files, the others send theirs and write
nothing. A rank calling it alone waits for the others (the group's timeout).
"""
from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from moe.hf.block import HFMoEBlock, hf_param_name
from moe.hf.generic import HFExperts
from moe.hf.stored_experts import StoredExperts

__all__ = ["HFLayout", "hf_state_dict", "record_layout", "save_in_transformers_names"]

_CONVERTED = (HFMoEBlock, HFExperts)


@dataclass(frozen=True, kw_only=True)
class HFLayout:
    """How a converted module's tensors were named and laid out before `moe.hf.convert`."""

    shapes: dict[str, tuple[int, ...]]
    """The replaced module's state dict: name (relative to it) -> shape."""
    experts: dict[str, tuple[str, ...]]
    """The converted module's expert tensors ([E_loc, ...]) -> the replaced module's
    tensors they hold (one each; a stored layout's w13: its gate and up tensors)."""
    transposed: bool
    """The replaced module stored `w13` / `w2` transposed ([E, H, J] / [E, I, H])."""
    stored: Optional[StoredExperts] = None
    """The replaced module's stored layout (`moe.hf.stored_experts`), else None."""

    def unconverted(self, inner: str, tensor: Tensor) -> dict[str, Tensor]:
        """Converted expert tensor `inner` ("w13", ...) over all experts [E, ...] as the
        replaced module holds it: its names -> tensors in its layout."""
        names = self.experts[inner]
        if self.stored is not None:
            parts = (self.stored.gate_up_to_stored(tensor) if inner == "w13"
                     else (self.stored.down_to_stored(tensor),))
            return dict(zip(names, parts, strict=True))
        if self.transposed and inner in ("w13", "w2"):
            tensor = tensor.transpose(1, 2)
        return {names[0]: _with_zero_compute_rows(tensor, self.shapes.get(names[0]))}


def record_layout(module: nn.Module, replaced: nn.Module, *, transposed: bool,
                  names: tuple[str, ...], stored: Optional[StoredExperts] = None) -> None:
    """Record on converted `module` (`HFMoEBlock` or `HFExperts`) the names and shapes of
    `replaced`, the transformers module it takes the place of (its tensors may be on the
    meta device): `names` are replaced's expert tensors (relative to it) that the converted
    module's w13, w2, bias13, bias2 hold, in that order (`moe.hf.rows.expert_tensor_names`,
    "experts."-prefixed for a whole block); with a `stored` layout, its gate, up and down
    tensors, which w13 (gate, up) and w2 (down) hold."""
    shapes = {name: tuple(t.shape) for name, t in replaced.state_dict().items()}
    ours = ("moe.w13", "moe.w2") if isinstance(module, HFMoEBlock) else (
        "w13", "w2", "bias13", "bias2")
    experts = ({"w13": names[:2], "w2": names[2:]} if stored is not None
               else {inner: (name,) for inner, name in zip(ours, names)})
    module.dbo_hf_layout = HFLayout(shapes=shapes, experts=experts, transposed=transposed,
                                    stored=stored)


def save_in_transformers_names(model: nn.Module) -> None:
    """Give converted `model` (a transformers `PreTrainedModel`) a `save_pretrained` that
    writes the unconverted model's checkpoint (`save_pretrained` here)."""
    if callable(getattr(type(model), "save_pretrained", None)):
        model.save_pretrained = types.MethodType(save_pretrained, model)


def save_pretrained(model: nn.Module, save_directory: Any, *, is_main_process: bool = True,
                    state_dict: Optional[dict[str, Tensor]] = None, **kwargs: Any) -> None:
    """transformers' `save_pretrained(save_directory, **kwargs)` of the unconverted model's
    state dict (`hf_state_dict`). Under expert parallelism every rank of the group calls
    it and rank 0 of the group writes (with `is_main_process`: set it False on all but one
    of several EP groups sharing a folder).

    Raises:
        ValueError: `state_dict=` or `distributed_checkpoint=True` (not for a converted
            model); a converted block whose tensors no longer match the module it replaced.
    """
    if state_dict is not None or kwargs.get("distributed_checkpoint"):
        what = "state_dict=" if state_dict is not None else "distributed_checkpoint=True"
        raise ValueError(f"moe.hf: save_pretrained({what}) of a converted model is not "
                         f"supported: call model.save_pretrained(save_directory) on every rank "
                         f"of the EP group, which writes the unconverted model's checkpoint")
    tensors = hf_state_dict(model)  # a collective under expert parallelism
    if tensors is None:
        return  # not rank 0 of the EP group: its experts were sent there
    type(model).save_pretrained(model, save_directory, is_main_process=is_main_process,
                                state_dict=tensors, **kwargs)


def hf_state_dict(model: nn.Module) -> Optional[dict[str, Tensor]]:
    """The state dict the unconverted `model` would have: transformers' names, the experts
    of every rank gathered ([E, ...]). Under expert parallelism every rank of the group
    calls it; it returns None on all but the group's rank 0.

    ValueError naming the tensor where a converted module's tensors do not give exactly
    the names and shapes of the module it replaced (`HFLayout`)."""
    converted = {path: m for path, m in model.named_modules() if isinstance(m, _CONVERTED)}
    writer = all(_rank(m) == 0 for m in converted.values())
    out: dict[str, Tensor] = {}
    made: dict[str, dict[str, tuple[int, ...]]] = {path: {} for path in converted}
    for name, tensor in model.state_dict().items():
        path = next((p for p in converted if name.startswith(p + ".")), None)
        if path is None:
            out[name] = tensor
            continue
        module, inner = converted[path], name[len(path) + 1:]
        layout: HFLayout = module.dbo_hf_layout
        if inner in layout.experts:
            tensor = _all_experts(tensor, module)
            held = {} if tensor is None else layout.unconverted(inner, tensor)
        else:
            held = {(hf_param_name(inner) if isinstance(module, HFMoEBlock)
                     else _owned_name(module, inner)): tensor}
        for hf_name, value in held.items():
            made[path][hf_name] = tuple(value.shape)
            out[f"{path}.{hf_name}"] = value
    if not writer:
        return None
    for path, module in converted.items():
        _check_layout(path, module.dbo_hf_layout, made[path])
    return out


def _owned_name(module: HFExperts, inner: str) -> str:
    """The replaced module's name of tensor `inner` of converted experts `module`: what a
    child that stands for the replaced module (`HFExperts.OWNERS`) holds, under the
    replaced module's name."""
    for owner in module.OWNERS:
        if inner.startswith(owner + "."):
            return inner[len(owner) + 1:]
    return inner


def _rank(module: nn.Module) -> int:
    backend = module.moe.backend if isinstance(module, HFMoEBlock) else module.backend
    return backend.placement.rank


def _all_experts(local: Tensor, module: nn.Module) -> Optional[Tensor]:
    """[E, ...]: this rank's rows [E_loc, ...] and every other rank's, gathered on the
    group's rank 0 (None elsewhere); `local` itself on one rank."""
    backend = module.moe.backend if isinstance(module, HFMoEBlock) else module.backend
    world, group = backend.world_size, backend.group
    if world == 1:
        return local
    local = local.detach().contiguous()
    root = dist.get_global_rank(group, 0)
    if backend.placement.rank != 0:
        dist.gather(local, None, dst=root, group=group)
        return None
    parts = [torch.empty_like(local) for _ in range(world)]
    dist.gather(local, parts, dst=root, group=group)
    return torch.cat(parts)


def _with_zero_compute_rows(tensor: Tensor, shape: Optional[tuple[int, ...]]) -> Tensor:
    """`tensor` [E, ...] padded with zero rows to the replaced tensor's [E + Z, ...]: the
    rows of Z zero-compute experts (LongCat-Flash's `gate_up_proj`), which the model never
    reads (`HFExperts.identity_experts`) and the converted block does not hold."""
    if shape is None or len(shape) != tensor.dim() or shape[0] <= tensor.shape[0] \
            or tuple(shape[1:]) != tuple(tensor.shape[1:]):
        return tensor
    pad = tensor.new_zeros((shape[0] - tensor.shape[0], *tensor.shape[1:]))
    return torch.cat([tensor, pad])


def _check_layout(path: str, layout: HFLayout, made: dict[str, tuple[int, ...]]) -> None:
    """ValueError naming the first tensor of the replaced module that `made` lacks or
    shapes otherwise, or that it has in excess."""
    for name, shape in layout.shapes.items():
        found = made.get(name)
        if found != shape:
            what = "lacks it" if found is None else f"makes it {list(found)}"
            raise ValueError(f"moe.hf: cannot save {path + '.' + name!r} {list(shape)} of the "
                             f"unconverted model: the converted block {what}; save the model "
                             f"before converting it (model.save_pretrained(dir), then "
                             f"moe.hf.convert)")
    extra = [name for name in made if name not in layout.shapes]
    if extra:
        raise ValueError(f"moe.hf: cannot save {path + '.' + extra[0]!r}: the unconverted model "
                         f"has no such tensor; save the model before converting it "
                         f"(model.save_pretrained(dir), then moe.hf.convert)")
