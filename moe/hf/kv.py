"""Per-ubatch KV caches of `moe.hf.generate`: join two row groups' caches, part them again.

Shape legend: B rows (sequences), b rows of group 0, L cached positions, N heads, D head
width. Every layer of a transformers `DynamicCache` holds `keys` / `values` [B, N, L, D].

Both groups' caches always hold the same positions (left padding makes every row of the
batch as long as the longest, and every step appends one position to every row), so
joining them is a concatenation along dim 0, and parting the joined cache gives each
group views of its rows. `DynamicLayer.update` concatenates the whole layer on every
step already, so a join costs about one step's cache traffic more.
"""
from __future__ import annotations

import copy
import inspect
from typing import Any

import torch

__all__ = ["cache_keyword", "join_caches", "part_cache"]

# The layer classes whose whole state is keys / values [B, N, L, D] plus row-independent
# fields (a sliding window's length and counter): a shallow copy with new tensors is a
# valid layer of the joined (or parted) batch.
_ROW_LAYERS = ("DynamicLayer", "DynamicSlidingWindowLayer")


def cache_keyword(model: Any) -> str:
    """The keyword a transformers causal LM's forward takes its KV cache by: "cache" from
    transformers 5.24 on (where the old name warns), "past_key_values" before (5.17)."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def join_caches(cache0: Any, cache1: Any) -> Any:
    """One DynamicCache holding cache0's rows, then cache1's (new tensors; the inputs are
    not changed). Layers never written (before the first step) stay empty."""
    joined = copy.copy(cache0)
    joined.layers = [_with_rows(a, _cat(a, b, "keys"), _cat(a, b, "values"))
                     for a, b in zip(cache0.layers, cache1.layers, strict=True)]
    return joined


def part_cache(cache: Any, b: int) -> tuple[Any, Any]:
    """(rows [0, b), rows [b, B)) of a DynamicCache, as two caches viewing its tensors."""
    parts = []
    for rows in (slice(0, b), slice(b, None)):
        part = copy.copy(cache)
        part.layers = [_with_rows(layer, _rows(layer, "keys", rows), _rows(layer, "values", rows))
                       for layer in cache.layers]
        parts.append(part)
    return parts[0], parts[1]


def _with_rows(layer: Any, keys: Any, values: Any) -> Any:
    name = type(layer).__name__
    if name not in _ROW_LAYERS:
        raise ValueError(f"moe.hf.generate: the model's KV cache has a {name} layer, whose "
                         f"state dbo cannot join and part by rows (it handles "
                         f"{', '.join(_ROW_LAYERS)}): generate with a model whose cache is a "
                         f"DynamicCache of these")
    new = copy.copy(layer)
    if layer.is_initialized:
        new.keys, new.values = keys, values
    return new


def _cat(a: Any, b: Any, name: str) -> Any:
    if not a.is_initialized:
        assert not b.is_initialized, "the two groups' caches ran different steps"
        return None
    x, y = getattr(a, name), getattr(b, name)
    assert x.shape[1:] == y.shape[1:], f"the groups' {name} differ: {x.shape} vs {y.shape}"
    return torch.cat([x, y], dim=0)


def _rows(layer: Any, name: str, rows: slice) -> Any:
    return getattr(layer, name)[rows] if layer.is_initialized else None
