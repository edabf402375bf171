"""`convert`: replace every MoE block of a loaded transformers causal LM by an `HFMoEBlock`.

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    model = moe.hf.convert(model, group=ep_group, backend="a2a")   # this rank's experts only
    # or, with no host read in the MoE layers: a capacity of B * S rows per rank and call
    # model = moe.hf.convert(model, group=ep_group, backend="a2a_ll", max_tokens_per_rank=B * S)
    config = DBOConfig(split="batch", split_kwargs=("attention_mask",))  # [B, S] mask
    logits = DBORunner(model, config, group=ep_group)(
        input_ids, attention_mask=mask, use_cache=False).logits

Shape legend: E routed experts, E_loc = E / W experts on this rank, W ranks in the EP
group, H hidden, I one expert's width, B sequences and S positions of one call.

Two paths, recorded per block in `model.dbo_conversion` and summed up in one line,
`model.dbo_conversion_summary` (also logged):

- fused (the architectures of `moe.hf.arch`): the whole block becomes an `HFMoEBlock`,
  dbo's routing kernel, and its shared experts overlapped with the combine. The block's
  contract ([B, S, H] in, a tensor out) is the same in transformers 5.17 and 5.24.
- experts (every other block whose experts module goes through transformers' experts
  interface, and a block of those architectures the fused path does not fit, or every
  block with `conversion="experts"`): the block keeps its own router, gating, shared
  experts and scaling; its `experts` child becomes an `HFExperts` (`moe.hf.generic`),
  dispatch -> this rank's experts -> combine on the routing the block hands it.

Everything is checked before anything changes: on any error the model is as it was.
"""
from __future__ import annotations

import dataclasses
import logging
import re
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from moe.backend_options import BackendOptions
from moe.backends.a2a_ll import A2ALLOptions
from moe.config import SUPPORTED_DTYPES, MoEConfig
from moe.hf.arch import ARCHITECTURES, SILU_NAMES, ArchSpec
from moe.hf.block import HFMoEBlock, HFRouter, HFSharedExperts
from moe.hf.deps import require
from moe.hf.generic import ExpertsPlan, HFExperts, build_experts, module_tensor, plan_experts
from moe.hf.input_scaled import InputScaledBlock
from moe.hf.logits_routed import build_logits_routed, plan_logits_routed, takes_router_logits
from moe.hf.router_logits import record_router_logits
from moe.hf.rows import copy_rows, expert_tensor_names, local_tensors
from moe.hf.save import record_layout, save_in_transformers_names
from moe.layer import MoELayer

_logger = logging.getLogger(__name__)
_CONVERSIONS = ("auto", "experts")

__all__ = ["BlockPlan", "check_capacity_argument", "convert", "convert_blocks",
           "find_moe_blocks", "ubatch_capacity"]

# Experts-module flags of `use_experts_implementation` (transformers 5.x) and the value
# dbo's expert kernels need, with what a different value means.
_EXPERT_FLAGS = (
    ("has_bias", False, "biased experts (gate_up_proj_bias / down_proj_bias)"),
    ("is_transposed", False, "transposed expert weights ([E, H, 2I])"),
    ("is_concatenated", True, "interleaved gate/up rows"),
    ("has_gate", True, "experts without a gate projection"),
    ("has_post_expert_norm", False, "a norm after each expert"),
)


@dataclass(frozen=True, kw_only=True)
class BlockPlan:
    """One MoE block to convert, checked."""

    path: str
    """Module path of the block, e.g. "model.layers.3.mlp"."""
    spec: ArchSpec
    config: MoEConfig
    layer_id: int
    """The decoder layer's index (trace names)."""


def find_moe_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(path, module) of every module with an `experts` child (the MoE blocks), outermost
    only, in module order; converted blocks (`HFMoEBlock`) are listed too."""
    found: list[tuple[str, nn.Module]] = []
    for path, module in model.named_modules():
        if any(path.startswith(p + ".") for p, _ in found):
            continue
        if isinstance(module, HFMoEBlock) or isinstance(getattr(module, "experts", None),
                                                         nn.Module):
            found.append((path, module))
    return found


def convert(model: nn.Module, *, group: Optional[dist.ProcessGroup] = None,
            backend: str = "auto", experts: str = "auto",
            max_tokens_per_rank: Optional[int] = None,
            max_tokens_per_ubatch: Optional[int] = None,
            conversion: str = "auto",
            backend_options: Optional[BackendOptions] = None) -> nn.Module:
    """Convert every MoE block of `model` (a loaded transformers model) to hold this rank's
    experts and run them over dbo's backends; return `model` (changed in place), with the
    path each block took in `model.dbo_conversion` / `model.dbo_conversion_summary`.

    Args:
        model: a transformers MoE model with its weights loaded (not on the meta device):
            an architecture of `moe.hf.arch.ARCHITECTURES` (fused blocks), or any whose
            experts go through transformers' experts interface (the experts path).
        group: the expert-parallel group; rank r of W keeps experts [r E/W, (r+1) E/W).
            None: EP size 1, every expert here.
        backend: dispatch/combine backend (`moe.backends`); "auto": local for EP size 1,
            else a2a.
        experts: expert kernel (`moe.experts`); "auto": the fastest available.
        max_tokens_per_rank: the most rows one rank sends through an MoE block in one
            model call (a [B, S] call: B * S, padding included), set as every converted
            layer's `MoEConfig.max_tokens_per_rank`. Needed by the backends that never
            read counts on the host (a2a_ll, symm_mem, deepep_ll: their buffers or
            padded slots are sized by it); a call with more rows raises (under DBO, on
            every rank at the vote). None: no capacity.
        max_tokens_per_ubatch: backend a2a_ll: the capacity of one ubatch of a DBO step
            (every layer's `backend_options=A2ALLOptions(max_tokens_per_ubatch=...)`;
            each ubatch then sends slots of this size, not of max_tokens_per_rank).
            None: max_tokens_per_rank.
        conversion: "auto": the fused block where `moe.hf.arch` knows the architecture and
            the block fits it, else the experts path; "experts": the experts path for
            every block.
        backend_options: the backend's own options for every converted layer
            (`MoEConfig.backend_options`, e.g. `A2ALLOptions(combine_groups=4)` for
            backend a2a_ll); None: the backend's defaults. With `max_tokens_per_ubatch`
            too, give that inside them instead (`A2ALLOptions(max_tokens_per_ubatch=)`).

    Raises:
        ImportError: transformers older than 5.17 (`moe.hf.deps.MIN_TRANSFORMERS`).
        ValueError: an unsupported architecture or block (naming the block and what is
            unsupported), a routing setting dbo cannot express, an expert count the EP
            size does not divide, a block already converted, a backend that needs
            `max_tokens_per_rank` without it, a `max_tokens_per_rank` that is not a
            positive int. Nothing is changed then.
    """
    return convert_blocks(model, group=group, backend=backend, experts=experts,
                          max_tokens_per_rank=max_tokens_per_rank,
                          max_tokens_per_ubatch=max_tokens_per_ubatch, conversion=conversion,
                          backend_options=backend_options)


def convert_blocks(model: nn.Module, *, group: Optional[dist.ProcessGroup], backend: str,
                   experts: str, max_tokens_per_rank: Optional[int],
                   max_tokens_per_ubatch: Optional[int] = None, conversion: str = "auto",
                   plans: Optional[list[BlockPlan | ExpertsPlan]] = None,
                   backend_options: Optional[BackendOptions] = None) -> nn.Module:
    """`convert`; with `plans` (`plan_blocks(model, check_weights=False)`) the blocks' own
    expert tensors are not read (`moe.hf.load` builds the model with them on the meta
    device): the new blocks are built on the CPU, their experts left uninitialised
    (`moe.hf.rows.fill_experts` fills them)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"moe.hf.convert takes a transformers model (an nn.Module), got "
                        f"{type(model).__name__}")
    require("transformers")  # one line naming the version where it is too old
    if conversion not in _CONVERSIONS:
        raise ValueError(f"moe.hf.convert: conversion={conversion!r}: use one of {_CONVERSIONS}")
    world = 1 if group is None else dist.get_world_size(group)
    rank = 0 if group is None else dist.get_rank(group)
    check_capacity_argument(backend, max_tokens_per_rank, world=world, where="moe.hf.convert")
    options = layer_options(max_tokens_per_ubatch, backend_options)
    from_blocks = plans is None
    if plans is None:
        plans = plan_blocks(model, world=world, check_weights=True, backend=backend,
                            experts=experts, conversion=conversion)
    new_blocks: list[nn.Module] = []
    last = len(plans) - 1
    for i, plan in enumerate(plans):
        old = model.get_submodule(plan.path)
        names = expert_tensor_names(plan)
        device = (module_tensor(old.experts, names[0]).device if from_blocks
                  else torch.device("cpu"))
        if isinstance(plan, ExpertsPlan):
            build = build_logits_routed if plan.routing else build_experts
            new = build(plan, old.experts, device=device, group=group,
                        capacity=max_tokens_per_rank, backend_options=options,
                        last_layer=i == last)
            record_layout(new, old.experts, transposed=plan.transposed, names=names,
                          stored=plan.stored)
        else:
            new = _build_block(plan, old, device=device, group=group, backend=backend,
                               experts=experts, capacity=max_tokens_per_rank,
                               backend_options=options, last_layer=i == last)
            record_layout(new, old, transposed=False,
                          names=tuple(f"experts.{name}" for name in names))
        if from_blocks:
            copy_rows(plan, new, local_tensors(plan, old.experts, rank=rank, world=world))
        new_blocks.append(InputScaledBlock(old, new) if isinstance(plan, ExpertsPlan)
                          and plan.input_scaled else new)
    for plan, block in zip(plans, new_blocks):  # nothing above changed the model
        path = (plan.path + ".experts" if isinstance(plan, ExpertsPlan) and not plan.input_scaled
                else plan.path)
        parent_path, _, name = path.rpartition(".")
        setattr(model.get_submodule(parent_path), name, block)
    record_router_logits(model, [block.moe.router for block in new_blocks
                                 if isinstance(block, HFMoEBlock)])
    _logger.info(record_conversion(model, getattr(model.config, "model_type", None),
                                   [_record(plan) for plan in plans]))
    # A transformers model takes padded [B, S] batches: DBORunner's default split
    # (DBOConfig(split=None)) cuts them between sequences.
    model.dbo_split_mode = "batch"
    save_in_transformers_names(model)
    return model


def layer_options(max_tokens_per_ubatch: Optional[int],
                  backend_options: Optional[BackendOptions] = None) -> Optional[BackendOptions]:
    """Every converted layer's backend options: `backend_options` as given, or those that
    give each DBO ubatch `max_tokens_per_ubatch` rows of capacity (`A2ALLOptions`: the
    backend that takes one), or None: the defaults. ValueError for both at once."""
    if backend_options is not None and not isinstance(backend_options, BackendOptions):
        raise TypeError(f"moe.hf.convert: backend_options={backend_options!r}: pass a "
                        f"backend's options object (e.g. A2ALLOptions(...)) or None")
    if max_tokens_per_ubatch is None:
        return backend_options
    if backend_options is not None:
        raise ValueError(f"moe.hf.convert: max_tokens_per_ubatch={max_tokens_per_ubatch} and "
                         f"backend_options={backend_options!r}: give the ubatch capacity "
                         f"inside the options (A2ALLOptions(max_tokens_per_ubatch=...))")
    return A2ALLOptions(max_tokens_per_ubatch=max_tokens_per_ubatch)


def ubatch_capacity(batch_size: int, seq_len: int) -> int:
    """The rows of the larger ubatch when a DBO step splits a [B, S] call between its
    sequences (`DBOConfig(split="batch")`, balanced: ceil(B / 2) sequences): the
    `max_tokens_per_ubatch` that every such step fits."""
    return -(-batch_size // 2) * seq_len


def check_capacity_argument(backend: str, max_tokens_per_rank: Any, *, world: int,
                            where: str) -> None:
    """ValueError, before anything is built, for a `max_tokens_per_rank` that is not a
    positive int, or None where `backend` needs one (`PrepareFinalize.needs_capacity`);
    the message names the keyword and `where`, the caller ("moe.hf.convert")."""
    from moe.backends import backend_class, resolve_backend_name
    if max_tokens_per_rank is not None:
        if (isinstance(max_tokens_per_rank, bool) or not isinstance(max_tokens_per_rank, int)
                or max_tokens_per_rank < 1):
            raise ValueError(f"{where}: max_tokens_per_rank={max_tokens_per_rank!r} must be a "
                             f"positive int (the most rows one rank sends through an MoE "
                             f"block in one call, B * S of a [B, S] batch) or None")
        return
    name = resolve_backend_name(backend, world)
    if backend_class(name, world).needs_capacity:
        raise ValueError(f"{where}: backend {name!r} needs max_tokens_per_rank (its buffers "
                         f"are sized for the most rows one rank sends in one call): pass "
                         f"max_tokens_per_rank=N, N the largest B * S a rank calls the model "
                         f"with, padding included (or use backend 'a2a', which reads its "
                         f"counts on the host)")


def plan_blocks(model: nn.Module, *, world: int, check_weights: bool, backend: str = "auto",
                experts: str = "auto", conversion: str = "auto"
                ) -> list[BlockPlan | ExpertsPlan]:
    """Check every MoE block of `model`; ValueError on the first one dbo cannot convert.
    A block the fused path refuses takes the experts path (`moe.hf.generic`); its error
    then names what the experts path lacks. `check_weights=False`: the expert tensors may
    be on the meta device (`moe.hf.load` reads them from the checkpoint)."""
    config = getattr(model, "config", None)
    blocks = find_moe_blocks(model)
    if config is None or not blocks:
        raise ValueError(f"moe.hf.convert: {type(model).__name__} has no MoE block (no module "
                         f"with an `experts` child) to convert: pass a transformers MoE "
                         f"model")
    model_type = getattr(config, "model_type", None)
    plans: list[BlockPlan | ExpertsPlan] = []
    for index, (path, block) in enumerate(blocks):
        if isinstance(block, HFMoEBlock) or isinstance(block.experts, HFExperts):
            raise ValueError(f"moe.hf.convert: block {path!r} is already converted: convert "
                             f"a model once")
        spec = ARCHITECTURES.get(model_type)
        layer_id = _layer_index(path, default=index)
        try:
            if conversion == "experts":
                raise ValueError("conversion='experts'")
            moe_config = _check_block(path, block, spec, config, check_weights=check_weights)
        except ValueError as fused_error:
            note = "" if spec is None else str(fused_error).split("): ", 1)[-1]
            plans.append(_experts_plan(path, block, config, world=world, backend=backend,
                                       experts=experts, layer_id=layer_id, note=note,
                                       check_weights=check_weights))
            continue
        assert spec is not None
        if moe_config.num_experts % world != 0:
            raise ValueError(
                f"moe.hf.convert: block {path!r} has num_experts={moe_config.num_experts}, "
                f"which is not divisible by the EP size {world}: use an expert-parallel group "
                f"whose size divides {moe_config.num_experts}")
        plans.append(BlockPlan(path=path, spec=spec, config=moe_config, layer_id=layer_id))
    return plans


def _experts_plan(path: str, block: nn.Module, config: Any, *, world: int, backend: str,
                  experts: str, layer_id: int, note: str, check_weights: bool) -> ExpertsPlan:
    """The block's experts-path plan (`moe.hf.logits_routed` for experts that take the
    router logits); its refusal says why the fused path was not taken too, where the
    architecture has one (`note`)."""
    plan = (plan_logits_routed if takes_router_logits(getattr(block, "experts", None))
            else plan_experts)
    try:
        return plan(path, block, model_config=config, world=world, backend=backend,
                    experts=experts, check_weights=check_weights, layer_id=layer_id,
                    note=note)
    except ValueError as exc:
        if note:
            raise ValueError(f"{exc} (not fused either: {note})") from None
        raise


def _record(plan: BlockPlan | ExpertsPlan) -> BlockConversion:
    if isinstance(plan, BlockPlan):
        return BlockConversion(path=plan.path, route="fused", detail=plan.spec.model_type)
    detail = plan.describe()
    return BlockConversion(path=plan.path, route="experts",
                           detail=detail + (f"; not fused: {plan.note}" if plan.note else ""))


def _check_block(path: str, block: nn.Module, spec: Optional[ArchSpec], config: Any, *,
                 check_weights: bool) -> MoEConfig:
    """The block's MoEConfig, or ValueError naming the block and what dbo cannot do
    (what its experts compute first, then whether dbo knows the architecture)."""
    def refuse(what: str) -> ValueError:
        return ValueError(f"moe.hf.convert: block {path!r} ({type(block).__name__}): {what}")

    experts = block.experts
    for flag, needed, meaning in _EXPERT_FLAGS:
        if getattr(experts, flag, needed) != needed:
            raise refuse(f"unsupported experts: {meaning}")
    for name in ("gate_up_proj_bias", "down_proj_bias"):
        if getattr(experts, name, None) is not None:
            raise refuse(f"unsupported experts: biased experts ({name})")
    if getattr(experts, "limit", None) is not None or getattr(experts, "alpha", None) is not None:
        raise refuse("unsupported experts: a clamped activation (limit / alpha)")
    act = getattr(config, "hidden_act", None)
    if act not in SILU_NAMES:
        raise refuse(f"unsupported experts activation hidden_act={act!r}: dbo's expert "
                     f"kernels compute silu(gate) * up")
    gate_up = getattr(experts, "gate_up_proj", None)
    down = getattr(experts, "down_proj", None)
    if not isinstance(gate_up, torch.Tensor) or not isinstance(down, torch.Tensor):
        raise refuse("unsupported experts: expected tensors experts.gate_up_proj [E, 2I, H] "
                     "and experts.down_proj [E, H, I] (as transformers >= 5.17 holds them)")
    if spec is None:
        raise refuse(f"unsupported architecture {config.model_type!r}: dbo converts "
                     f"{', '.join(sorted(ARCHITECTURES))} (add an ArchSpec to "
                     f"moe.hf.arch.ARCHITECTURES for a model built like one of them)")
    if type(block).__name__ != spec.block_class:
        raise refuse(f"unsupported block class for {spec.model_type!r} (dbo converts "
                     f"{spec.block_class})")
    if gate_up.dtype not in SUPPORTED_DTYPES:
        raise refuse(f"expert weights are {gate_up.dtype}: dbo's experts take "
                     f"{SUPPORTED_DTYPES} (load the model in one of them)")
    if check_weights and gate_up.is_meta:
        raise refuse("expert weights are on the meta device: load the weights first, or "
                     "use moe.hf.load(path) to load a checkpoint converted")
    if not isinstance(getattr(getattr(block, "gate", None), "weight", None), torch.Tensor):
        raise refuse("no router `gate` with a weight [E, H]")
    for name in spec.shared:
        if not isinstance(getattr(block, name, None), nn.Module):
            raise refuse(f"no shared-expert module {name!r}")
    try:
        moe_config = spec.moe_config(config, dtype=gate_up.dtype)
    except ValueError as exc:
        raise refuse(f"routing dbo cannot express: {exc}") from exc
    if check_weights:
        e, h, i = moe_config.num_experts, moe_config.hidden_size, moe_config.intermediate_size
        for name, tensor, shape in (("experts.gate_up_proj", gate_up, (e, 2 * i, h)),
                                    ("experts.down_proj", down, (e, h, i)),
                                    ("gate.weight", block.gate.weight, (e, h))):
            if tuple(tensor.shape) != shape:
                raise refuse(f"{name} has shape {list(tensor.shape)} but the config says "
                             f"{list(shape)}: the weights do not match the model config")
    return moe_config


def _build_block(plan: BlockPlan, old: nn.Module, *, device: torch.device,
                 group: Optional[dist.ProcessGroup], backend: str, experts: str,
                 capacity: Optional[int], backend_options: Optional[BackendOptions],
                 last_layer: bool) -> HFMoEBlock:
    """The new block for `old` on `device`, its experts uninitialised (`copy_rows`), the
    router's and shared experts' tensors taken over as they are."""
    spec = plan.spec
    config = dataclasses.replace(plan.config, backend=backend, experts=experts,
                                 max_tokens_per_rank=capacity,
                                 backend_options=backend_options)
    layer = MoELayer(config, group=group, layer_id=plan.layer_id, last_layer=last_layer,
                     device=device)
    gate = old.gate
    bias = gate.e_score_correction_bias.detach() if spec.grouped else None
    layer.router = HFRouter(gate.weight.detach(), correction_bias_E=bias,
                            fp32_logits=spec.router_fp32)
    if spec.shared:
        mlp_name, *gate_name = spec.shared
        layer.shared_experts = HFSharedExperts(
            mlp_name=mlp_name, mlp=getattr(old, mlp_name),
            gate_name=gate_name[0] if gate_name else None,
            gate=getattr(old, gate_name[0]) if gate_name else None)
    return HFMoEBlock(layer, path=plan.path)


def _layer_index(path: str, *, default: int) -> int:
    """The first integer component of a module path ("model.layers.3.mlp" -> 3)."""
    match = re.search(r"(?:^|\.)(\d+)(?:\.|$)", path)
    return int(match.group(1)) if match else default


@dataclasses.dataclass(frozen=True, kw_only=True)
class BlockConversion:
    """Which path one MoE block took (`model.dbo_conversion`)."""

    path: str
    """The block's module path."""
    route: str
    """"fused" (`HFMoEBlock`: dbo's router, shared experts overlapped with the combine) or
    "experts" (`HFExperts`: the block's own router, its experts module replaced)."""
    detail: str
    """The architecture (fused), or the experts class and form (experts path), and why a
    block of an architecture with a fused path took the experts path."""


def record_conversion(model: nn.Module, model_type: Any,
                      records: list[BlockConversion]) -> str:
    """Set `model.dbo_conversion` (the records) and `model.dbo_conversion_summary` (one
    line, e.g. "moe.hf.convert: olmoe: 2 MoE blocks, 2 on the experts path (OlmoeExperts:
    silu(gate) * up)"); return the line."""
    groups: dict[tuple[str, str], int] = {}
    for record in records:
        key = (record.route, record.detail)
        groups[key] = groups.get(key, 0) + 1
    parts = []
    for route in ("fused", "experts"):
        details = [(d, n) for (r, d), n in groups.items() if r == route]
        if details:
            count = sum(n for _, n in details)
            where = "fused" if route == "fused" else "on the experts path"
            parts.append(f"{count} {where} ({'; '.join(d for d, _ in details)})")
    line = (f"moe.hf.convert: {model_type}: {len(records)} MoE block"
            f"{'s' if len(records) != 1 else ''}, {', '.join(parts)}")
    model.dbo_conversion = tuple(records)
    model.dbo_conversion_summary = line
    return line
