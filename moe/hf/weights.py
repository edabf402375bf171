"""A checkpoint's tensors into a transformers model, as transformers itself maps them, this
rank's experts only (`moe.hf.load`).

Shape legend: E experts of a block's tensor, n = stop - first of them read here.

transformers renames checkpoint names when it loads a checkpoint (`WeightRenaming`: e.g.
Mixtral's `block_sparse_moe` to `mlp`) and converts tensors (`WeightConverter`: e.g. the
per-expert `experts.{e}.gate_proj.weight` [I, H] and `experts.{e}.up_proj.weight` [I, H]
stacked and joined into `experts.gate_up_proj` [E, 2I, H]), and undoes both when it saves
(`conversion_mapping`). `WeightReader` maps every checkpoint name to its model name with
transformers' own rules (`rename_source_key`), so a checkpoint loads as from_pretrained
would load it, whatever names its family's checkpoints use. For an expert tensor only
experts [first, stop) are read:

- per-expert sources (the conversion starts by stacking a list, `MergeModulelist(dim=0)`):
  the tensors of those experts only;
- a tensor over all experts [E, ...] (renamed, or converted along other dimensions): its
  rows first..stop-1 only (`Checkpoint.read_rows`).

The rest of such a conversion must act on each expert alone (`Concatenate`, `Chunk`,
`Interleave`, `Split` past the expert dimension, `Transpose` of two others); any other
operation is refused naming the family and the tensor. Checkpoint names the model has no
tensor for are not read, as transformers ignores them. Every refusal is one line naming
the tensor; where a checkpoint lacks one, it is named as transformers' save_pretrained
names it (its conversions reverted on a meta copy of the model's state dict).
"""
from __future__ import annotations

import re
from copy import deepcopy
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

import torch
from torch import Tensor, nn

from moe.hf.checkpoint import Checkpoint
from moe.hf.deps import require

__all__ = ["ExpertRows", "WeightReader"]

#: Conversion operations that act on each expert alone when their dimension is past the
#: expert one (dimension 0 of the stacked or fused tensor).
_PER_EXPERT_OPS = ("Concatenate", "Chunk", "Interleave", "Split")
_REREAD = "re-save it with save_pretrained"


@dataclass(frozen=True, kw_only=True)
class ExpertRows:
    """The rows of a model's expert tensor this rank reads."""

    block: str
    """The MoE block's module path (for messages)."""
    first: int
    stop: int
    """Experts [first, stop)."""
    per_expert: int = 1
    """The tensor's rows per expert: experts [first, stop) are rows [first * per_expert,
    stop * per_expert) (a tensor [E * I, H] of experts stacked along its rows:
    `moe.hf.stored_experts`)."""

    @property
    def rows(self) -> tuple[int, int]:
        """[first, stop) of the tensor's rows."""
        return self.first * self.per_expert, self.stop * self.per_expert


@dataclass
class _Target:
    """The checkpoint tensors transformers makes one model tensor (or a group) of."""

    key: str
    """The model tensor's name (a converter's first target)."""
    transform: Any
    """A fresh `WeightRenaming` or `WeightConverter` of transformers."""
    sources: dict[str, list[str]] = field(default_factory=dict)
    """Source pattern -> checkpoint names, in transformers' order (`dot_natural_key`)."""
    renamed: dict[str, str] = field(default_factory=dict)
    """Checkpoint name -> the name after the renamings (what the converter matches)."""


class _WeightMap:
    """Names (of a checkpoint) grouped by the model tensor transformers loads them into."""

    def __init__(self, model: nn.Module, names: Iterable[str]) -> None:
        require("transformers")
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (WeightConverter, WeightRenaming,
                                                     dot_natural_key, rename_source_key)
        conversions = get_model_conversion_mapping(model)
        renamings = [t for t in conversions if isinstance(t, WeightRenaming)]
        converters = [t for t in conversions if isinstance(t, WeightConverter)]
        by_pattern = {p: c for c in converters for p in c.source_patterns}
        keys = dict.fromkeys(model.state_dict(), True)
        prefix = model.base_model_prefix
        self.targets: dict[str, _Target] = {}
        for name in sorted(names, key=dot_natural_key):
            key, pattern = rename_source_key(name, renamings, converters, prefix, keys)
            if key not in keys and name in keys:
                key, pattern = rename_source_key(name, [], [], prefix, keys)
            if key not in keys:
                continue  # a tensor the model has no place for: not read (transformers' way)
            target = self.targets.get(key)
            if target is None:
                transform = (deepcopy(by_pattern[pattern]) if pattern is not None
                             else WeightRenaming(name, key))
                target = self.targets[key] = _Target(key=key, transform=transform)
            elif pattern is None:
                continue  # a second name for a renamed tensor: the first one is read
            target.sources.setdefault(pattern or name, []).append(name)
            target.renamed[name] = _renamed(name, renamings)


def _renamed(name: str, renamings: list) -> str:
    """`name` after every `WeightRenaming` in turn (what transformers 5.24's
    `apply_renamings` does; 5.17 has no such function, each renaming the method)."""
    for renaming in renamings:
        name, _ = renaming.rename_source_key(name)
    return name


class WeightReader:
    """Reads a checkpoint into `model` (an unconverted transformers model, its expert
    tensors possibly on the meta device), in two steps: `read_model` fills every tensor
    but the expert tensors named in `experts` (model name -> the rows this rank reads);
    `read_experts`, later (the model may be converted by then), returns those rows.

    Every rank of an EP group fails `read_model` alike (the same files and names); only
    `read_experts` reads what differs per rank, so `moe.hf.load` calls it after the
    collectives of the conversion, and a rank that cannot read its own experts fails
    alone instead of leaving the others waiting in a collective.
    """

    def __init__(self, model: nn.Module, checkpoint: Checkpoint,
                 experts: dict[str, ExpertRows]) -> None:
        self.model, self.checkpoint, self.experts = model, checkpoint, experts
        self._found = _WeightMap(model, checkpoint.names())
        tensors = model.state_dict(keep_vars=True)
        self._shapes = {k: tuple(tensors[k].shape) for k in experts}
        self._dtypes = {k: tensors[k].dtype for k in experts}
        self.expected = _saved_shapes(model)
        self._expected_map = _WeightMap(model, self.expected)

    def read_model(self) -> None:
        """Fill every parameter and persistent buffer of the model but the experts' (a meta
        tensor is replaced by the one read; a tied tensor is filled through any of its
        names). ValueError naming the tensor the checkpoint lacks, or whose shape differs
        from the model's; an expert tensor the checkpoint has no tensor for at all."""
        for key, want in self.experts.items():
            if key not in self._found.targets:
                raise self.missing(key, want, None, want.first)
            family = self.model.config.model_type
            if _stacked(self._found.targets[key], family) and want.per_expert != 1:
                raise ValueError(f"moe.hf.load: {family} checkpoints: transformers stacks "
                                 f"{key!r} from per-expert tensors, but the model holds "
                                 f"{want.per_expert} rows of it per expert: load the model "
                                 f"with transformers and convert it, "
                                 f"moe.hf.convert(model, group=ep_group)")
        tensors = self.model.state_dict(keep_vars=True)
        self._refuse_absent(tensors, self._predicted())  # before reading anything
        loaded: set[str] = set()
        for key, target in self._found.targets.items():
            if key in self.experts:
                continue
            for name, value in self._whole(target).items():
                if name in self.experts or name not in tensors:
                    raise ValueError(f"moe.hf.load: the conversion of checkpoint tensor "
                                     f"{next(iter(target.sources.values()))[0]!r} makes "
                                     f"{name!r}, which this model cannot take: {_REREAD}")
                self._check_result(name, value, tuple(tensors[name].shape), target)
                _assign(self.model, name, value)
                loaded.add(name)
        self._refuse_absent(self.model.state_dict(keep_vars=True), loaded)

    def _predicted(self) -> set[str]:
        """The model tensors the checkpoint's tensors will make (a converter's other
        targets named as transformers names them)."""
        keys = set()
        for key, target in self._found.targets.items():
            keys.add(key)
            patterns = getattr(target.transform, "target_patterns", [])
            if getattr(target.transform, "operations", None) and patterns[0] in key:
                keys.update(key.replace(patterns[0], p) for p in patterns[1:])
        return keys

    def _refuse_absent(self, tensors: dict[str, Tensor], made: set[str]) -> None:
        """ValueError naming the first tensor of the model (but the experts) that none of
        `made` fills, through any of its names (tied tensors)."""
        filled = {id(tensors[k]) for k in made if k in tensors}
        absent = [k for k, t in tensors.items()
                  if k not in self.experts and id(t) not in filled]
        if absent:
            more = f" (and {len(absent) - 1} more)" if len(absent) > 1 else ""
            raise ValueError(f"moe.hf.load: checkpoint {self.checkpoint.path!r} has no tensor "
                             f"for {self._saved_name(absent[0])!r}{more}, which the model "
                             f"built from config.json needs: the checkpoint is incomplete or "
                             f"for another model; {_REREAD}")

    def read_experts(self) -> dict[str, Tensor]:
        """The expert rows: model name -> [n, ...] in the model tensor's dtype.
        ValueError naming a tensor of this rank's experts the checkpoint lacks or shapes
        otherwise."""
        rows = {}
        for key, want in self.experts.items():
            target = self._found.targets[key]
            out = self._rows(target, want)
            first, stop = want.rows
            shape = (stop - first, *self._shapes[key][1:])
            self._check_result(key, out, shape, target)
            rows[key] = out.to(self._dtypes[key])
        return rows

    def missing(self, key: str, want: ExpertRows, pattern: Optional[str], expert: int, *,
                found: Optional[_Target] = None) -> ValueError:
        """The refusal for expert `expert` of model tensor `key` (its `pattern` source),
        named as the checkpoint's other experts are (`found`), else as save_pretrained
        names it."""
        name = None
        if found is not None and pattern is not None:
            name = _by_expert(found, pattern)[0].get(expert)
        if name is None:
            target = self._expected_map.targets.get(key)
            if target is not None:
                pattern = pattern if pattern in target.sources else next(iter(target.sources))
                name = (_by_expert(target, pattern)[0].get(expert)
                        or target.sources[pattern][0])
        name = name or f"expert {expert} of {key}"
        return ValueError(f"moe.hf.load: checkpoint {self.checkpoint.path!r} has no tensor "
                          f"{name!r} (expert {expert} of block {want.block!r}): the checkpoint "
                          f"is incomplete or was saved from another model; {_REREAD}")

    # ---------------------------------------------------------------- internals
    def _saved_name(self, key: str) -> str:
        """The name transformers saves model tensor `key` under (else `key`)."""
        target = self._expected_map.targets.get(key)
        return next(iter(target.sources.values()))[0] if target is not None else key

    def _whole(self, target: _Target) -> dict[str, Tensor]:
        """Every model tensor `target` makes, read whole."""
        for names in target.sources.values():
            for name in names:
                self._check_saved_shape(name)
        if not hasattr(target.transform, "operations"):  # a renaming
            return {target.key: self.checkpoint.read(next(iter(target.sources.values()))[0])}
        for pattern, names in target.sources.items():
            for name in names:
                target.transform.add_tensor(target.key, name, pattern,
                                            _later(self.checkpoint.read, name))
        return self._convert(target, self.model)

    def _rows(self, target: _Target, want: ExpertRows) -> Tensor:
        """Experts [first, stop) of expert tensor `target.key`: [n, ...]."""
        full = self._shapes[target.key]
        transform = target.transform
        ops = list(getattr(transform, "operations", []))
        stacked = _stacked(target, self.model.config.model_type)
        patterns = list(getattr(transform, "source_patterns", target.sources))
        for pattern in patterns:
            names = target.sources.get(pattern, [])
            if stacked:
                by_index, _ = _by_expert(target, pattern)
                for e in range(want.first, want.stop):
                    if e not in by_index:
                        raise self.missing(target.key, want, pattern, e, found=target)
                    self._check_saved_shape(by_index[e])
                    transform.add_tensor(target.key, by_index[e], pattern,
                                         _later(self.checkpoint.read, by_index[e]))
                continue
            if len(names) != 1:
                raise self.missing(target.key, want, pattern, want.first, found=target)
            name = names[0]
            self._check_saved_shape(name)
            shape = self.checkpoint.shape(name)
            if not shape or shape[0] != full[0]:
                raise ValueError(f"moe.hf.load: tensor {name!r} has shape {list(shape)} in the "
                                 f"checkpoint, but {target.key!r} of block {want.block!r} "
                                 f"holds {full[0] // want.per_expert} experts: config.json and the weights "
                                 f"disagree (fix config.json, or re-save the checkpoint)")
            if not ops:  # a renaming
                return self.checkpoint.read_rows(name, *want.rows)
            transform.add_tensor(target.key, name, pattern,
                                 _later(self.checkpoint.read_rows, name, *want.rows))
        first, stop = want.rows
        local = torch.empty((stop - first, *full[1:]), device="meta")
        out = self._convert(target, _LocalShapes(self.model, {target.key: local}))
        return out[target.key]

    def _check_result(self, key: str, value: Tensor, shape: tuple[int, ...],
                     target: _Target) -> None:
        if tuple(value.shape) != shape:
            names = [n for ns in target.sources.values() for n in ns]
            more = f" and {len(names) - 1} more" if len(names) > 1 else ""
            raise ValueError(f"moe.hf.load: {key!r} read from checkpoint tensor {names[0]!r}"
                             f"{more} has shape {list(value.shape)}, but the model built from "
                             f"config.json needs {list(shape)}: config.json and the weights "
                             f"disagree (fix config.json, or re-save the checkpoint)")

    def _check_saved_shape(self, name: str) -> None:
        shape = self.expected.get(name)
        if shape is not None:
            self.checkpoint.check_shape(name, shape, "a model weight")

    def _convert(self, target: _Target, model: Any) -> dict[str, Tensor]:
        try:
            out = target.transform.convert(target.key, model=model, config=self.model.config)
        except (RuntimeError, ValueError, IndexError, KeyError) as exc:
            first = next(iter(target.sources.values()))[0]
            text = str(exc).strip().splitlines()
            raise ValueError(f"moe.hf.load: transformers cannot convert checkpoint tensor "
                             f"{first!r} into {target.key!r} ({type(exc).__name__}: "
                             f"{text[0] if text else ''}): config.json and the weights "
                             f"disagree, or the checkpoint is of another model") from exc
        return {k: v[0] if isinstance(v, list) else v for k, v in out.items()}


def _saved_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor transformers' save_pretrained writes for `model`
    (its conversions reverted on meta copies; {} where they cannot be): what a
    checkpoint of this model holds, to name what one lacks and check shapes early."""
    from transformers.core_model_loading import revert_weight_conversion
    meta = {k: torch.empty(t.shape, dtype=t.dtype, device="meta")
            for k, t in model.state_dict().items()}
    try:
        reverted = revert_weight_conversion(model, meta)
    except Exception:  # noqa: BLE001 - only messages and early checks use it
        return {}
    return {k: tuple(v.shape) for k, v in reverted.items()}


class _LocalShapes:
    """The model as the conversion operations see it (`get_parameter(name).shape`), the
    expert tensor at this rank's size."""

    def __init__(self, model: nn.Module, local: dict[str, Tensor]) -> None:
        self._model, self._local = model, local

    def get_parameter(self, name: str) -> Tensor:
        return self._local[name] if name in self._local else self._model.get_parameter(name)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


def _stacked(target: _Target, family: str) -> bool:
    """Whether expert tensor `target` is stacked from per-expert checkpoint tensors (else
    read from tensors over all experts); ValueError where transformers converts it with
    an operation not known to act on each expert alone."""
    ops = list(getattr(target.transform, "operations", []))
    stacked = bool(ops) and type(ops[0]).__name__ == "MergeModulelist" and ops[0].dim == 0
    for op in ops[1:] if stacked else ops:
        if not _per_expert(op):
            raise ValueError(f"moe.hf.load: {family} checkpoints: transformers converts the "
                             f"tensors of {target.key!r} with {op!r}, which dbo cannot apply "
                             f"to one rank's experts alone (only {', '.join(_PER_EXPERT_OPS)} "
                             f"or Transpose past the expert dimension): load the model with "
                             f"transformers (AutoModelForCausalLM.from_pretrained(path)) and "
                             f"convert it, moe.hf.convert(model, group=ep_group)")
    return stacked


def _per_expert(op: Any) -> bool:
    """Whether a conversion operation acts on each expert (dimension 0) alone."""
    kind = type(op).__name__
    if kind in _PER_EXPERT_OPS:
        return getattr(op, "dim", 0) >= 1
    if kind == "Transpose":
        return op.dim0 >= 1 and op.dim1 >= 1
    return False


def _by_expert(target: _Target, pattern: str) -> tuple[dict[int, str], Optional[str]]:
    """The checkpoint names of `pattern` by expert index (the `*` of the pattern), with a
    name template ("...experts.{}.w1.weight") for an index absent from them."""
    by_index: dict[int, str] = {}
    if "*." not in pattern:  # one tensor over all experts
        return by_index, None
    index = re.compile(pattern.replace("*.", r"(\d+)\."))
    template = None
    for name in target.sources.get(pattern, []):
        match = index.search(target.renamed.get(name, name))
        if match is None:
            continue
        expert, suffix = int(match.group(1)), target.renamed.get(name, name)[match.end(1):]
        by_index[expert] = name
        head = name[:len(name) - len(suffix)] if name.endswith(suffix) else ""
        if template is None and head.endswith(str(expert)):
            template = head[:len(head) - len(str(expert))] + "{}" + suffix
    if template is not None:
        return _Templated(by_index, template), template
    return by_index, template


class _Templated(dict):
    """Names by expert index; `get` of an absent index gives its name from the template."""

    def __init__(self, names: dict[int, str], template: str) -> None:
        super().__init__(names)
        self.template = template

    def get(self, expert: int, default: Any = None) -> Any:  # type: ignore[override]
        return super().get(expert) or self.template.format(expert)


def _later(fn: Any, *args: Any) -> Any:
    """A callable reading a tensor when transformers' conversion asks for it."""
    return lambda: fn(*args)


def _assign(model: nn.Module, name: str, value: Tensor) -> None:
    """Model tensor `name` := `value` (copied in its dtype; a meta tensor replaced)."""
    owner, _, attr = name.rpartition(".")
    module = model.get_submodule(owner)
    tensors = module._parameters if attr in module._parameters else module._buffers
    old = tensors[attr]
    assert old is not None, name
    with torch.no_grad():
        if not old.is_meta:
            old.copy_(value)
            return
        new = value.to(old.dtype)
        tensors[attr] = (nn.Parameter(new, requires_grad=old.requires_grad)
                         if isinstance(old, nn.Parameter) else new)
