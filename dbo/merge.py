"""Merge the per-ubatch outputs of a split step into the output of the whole step.

    out = merge_outputs([out0, out1])            # tensors: torch.cat(dim=0)

Walks tuples (named ones too), lists, dicts and dataclasses recursively and rebuilds
them with the same types. Tensor leaves are concatenated along dim 0 (the token or
sequence dim, ubatch 0 first); None stays None; any other leaf (ints, strings, configs)
must be equal on every ubatch and is passed through. Anything else — a 0-dim tensor such
as a loss, a leaf that differs between ubatches, a tensor whose dim 0 is not the
ubatch's rows — raises an error naming where it sits in the output, because no generic
rule merges it right: give the runner a `DBOConfig(merge=fn)` for such outputs.
"""
from __future__ import annotations

import copy
import dataclasses
from typing import Any, Mapping, Optional, Sequence

import torch

_CUSTOM_MERGE_HINT = ("pass DBOConfig(merge=fn), where fn([out0, out1]) merges the two "
                      "ubatches' outputs")


def merge_outputs(outputs: Sequence[Any], *, rows: Optional[Sequence[int]] = None) -> Any:
    """Merge one output per ubatch (same structure on each) into one output.

    Args:
        outputs: the ubatches' outputs in ubatch order.
        rows: when given, the rows (dim 0) each ubatch's tensors must have — the
            ubatch's token count, or its sequence count in "batch" mode. A tensor with
            other rows is not row-major and cannot be concatenated correctly.

    Returns:
        The merged output: tensors [sum of rows, ...] on the ubatches' device.

    Raises:
        TypeError: a 0-dim tensor, or structures of different types.
        ValueError: different keys/lengths/leaves, or tensors that are not row-major.
    """
    if isinstance(outputs, (str, bytes)) or not isinstance(outputs, Sequence) or not outputs:
        raise TypeError(f"merge_outputs takes a non-empty list with one output per ubatch, "
                        f"got {outputs!r}")
    if rows is not None and len(rows) != len(outputs):
        raise ValueError(f"rows={list(rows)} gives {len(rows)} row counts for "
                         f"{len(outputs)} ubatch outputs: pass one per ubatch")
    if len(outputs) == 1:
        return outputs[0]
    return _merge(list(outputs), "output", rows)


def _merge(values: list[Any], path: str, rows: Optional[Sequence[int]]) -> Any:
    first = values[0]
    if first is None or any(v is None for v in values):
        if all(v is None for v in values):
            return None
        raise ValueError(f"{path} is None on some ubatches and not on others "
                         f"({_kinds(values)}): {_CUSTOM_MERGE_HINT}")
    if isinstance(first, torch.Tensor) or any(isinstance(v, torch.Tensor) for v in values):
        return _merge_tensors(values, path, rows)
    _check_same_type(values, path)
    if dataclasses.is_dataclass(first) and not isinstance(first, type):
        merged = {f.name: _merge([getattr(v, f.name) for v in values], f"{path}.{f.name}", rows)
                  for f in dataclasses.fields(first) if f.init}
        return dataclasses.replace(first, **merged)
    if isinstance(first, Mapping):
        return _merge_mapping(values, path, rows)
    if isinstance(first, (tuple, list)):
        _check_same_len(values, path)
        items = [_merge([v[i] for v in values], f"{path}[{i}]", rows) for i in range(len(first))]
        if isinstance(first, tuple) and hasattr(first, "_fields"):  # namedtuple
            return type(first)(*items)
        return type(first)(items)
    return _merge_leaf(values, path)


def _merge_tensors(values: list[Any], path: str, rows: Optional[Sequence[int]]) -> torch.Tensor:
    if not all(isinstance(v, torch.Tensor) for v in values):
        raise TypeError(f"{path} is a tensor on some ubatches only ({_kinds(values)}): "
                        f"{_CUSTOM_MERGE_HINT}")
    for i, v in enumerate(values):
        if v.dim() == 0:
            raise TypeError(
                f"{path} is a 0-dim tensor (e.g. a loss or a count) on ubatch {i}: it has no "
                f"dim 0 to concatenate, and summing or averaging it depends on what it "
                f"means: {_CUSTOM_MERGE_HINT}")
        if rows is not None and v.shape[0] != rows[i]:
            raise ValueError(
                f"{path} has shape {list(v.shape)} on ubatch {i}, which holds {rows[i]} rows: "
                f"its dim 0 is not the token/sequence dim, so concatenating it would be "
                f"wrong; {_CUSTOM_MERGE_HINT}")
    try:
        return torch.cat(values, dim=0)
    except RuntimeError as exc:
        shapes = ", ".join(f"{list(v.shape)} {v.dtype} {v.device}" for v in values)
        raise ValueError(f"cannot concatenate {path} along dim 0: the ubatches give {shapes}; "
                         f"{_CUSTOM_MERGE_HINT}") from exc


def _merge_mapping(values: list[Any], path: str, rows: Optional[Sequence[int]]) -> Any:
    first = values[0]
    keys = list(first.keys())
    for i, v in enumerate(values[1:], start=1):
        if set(v.keys()) != set(keys):
            raise ValueError(f"{path} has keys {keys!r} on ubatch 0 but "
                             f"{list(v.keys())!r} on ubatch {i}: return the same "
                             f"keys from every ubatch, or {_CUSTOM_MERGE_HINT}")
    merged = {k: _merge([v[k] for v in values], f"{path}[{k!r}]", rows) for k in keys}
    if type(first) is dict:
        return merged
    try:  # keeps the subclass and its extra state (OrderedDict, defaultdict's factory, ...)
        out = copy.copy(first)
        out.clear()
        out.update(merged)
        return out
    except (AttributeError, TypeError):
        return type(first)(merged)


def _merge_leaf(values: list[Any], path: str) -> Any:
    first = values[0]
    for i, v in enumerate(values[1:], start=1):
        if v is first:
            continue
        try:
            equal = bool(v == first)
        except Exception:  # noqa: BLE001 - e.g. arrays whose == is elementwise
            equal = False
        if not equal:
            raise ValueError(
                f"{path} differs between ubatches ({first!r} on ubatch 0, {v!r} on ubatch "
                f"{i}): only tensors are concatenated, other leaves must be equal; "
                f"{_CUSTOM_MERGE_HINT}")
    return first


def _check_same_type(values: list[Any], path: str) -> None:
    kinds = {type(v) for v in values}
    if len(kinds) > 1:
        raise TypeError(f"{path} has different types on the ubatches ({_kinds(values)}): "
                        f"return the same structure from every ubatch, or {_CUSTOM_MERGE_HINT}")


def _check_same_len(values: list[Any], path: str) -> None:
    lens = [len(v) for v in values]
    if len(set(lens)) > 1:
        raise ValueError(f"{path} has lengths {lens} on the ubatches: return the same "
                         f"structure from every ubatch, or {_CUSTOM_MERGE_HINT}")


def _kinds(values: list[Any]) -> str:
    return ", ".join(f"ubatch {i}: {type(v).__name__}" for i, v in enumerate(values))
