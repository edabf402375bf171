"""Per-ubatch KV caches of `moe.hf.generate`: join two row groups' caches, part them again.

Shape legend: B rows (sequences), b rows of group 0, L cached positions, N heads, D head
width. Every layer of a transformers `DynamicCache` holds `keys` / `values` [B, N, L, D];
a linear-attention / state-space layer (5.24's `LinearAttentionLayer`, also inside the
hybrid layer classes) holds conv and recurrent states [B, ...] per state index; an indexed
layer (DeepSeek-V3.2's sparse attention) its indexer keys [B, L, D] too.

Both groups' caches always hold the same positions (left padding makes every row of the
batch as long as the longest, and every step appends one position to every row), so
joining them is a concatenation along the batch dim, and parting the joined cache gives
each group views of its rows. `DynamicLayer.update` concatenates the whole layer on every
step already, so a join costs about one step's cache traffic more; a linear-attention
layer writes its states in place, so a group's part writes its own rows of the joined
tensors.
"""
from __future__ import annotations

import copy
import inspect
from typing import Any, Callable

import torch
from torch import Tensor

__all__ = ["cache_keyword", "join_caches", "part_cache"]

# Caches whose whole state is their layers (a subclass with state of its own, e.g.
# MiniMax's `MiniMaxCache.linear_cache`, cannot be joined here).
_ROW_CACHES = ("DynamicCache",)
# The layer classes whose whole state is batch-major tensors plus row-independent fields
# (a sliding window's length and counter, a conv kernel size, which states exist): a
# shallow copy with new tensors is a valid layer of the joined (or parted) batch. Exact
# classes: a model's own subclass may keep more (DeepSeek-V4's compressed KV buffers).
_KEY_VALUE_LAYERS = ("DynamicLayer", "DynamicSlidingWindowLayer", "DynamicIndexedLayer",
                     "LinearAttentionAndFullAttentionLayer",
                     "LinearAttentionAndSlidingWindowAttentionLayer")
_STATE_LAYERS = ("LinearAttentionLayer", "LinearAttentionAndFullAttentionLayer",
                 "LinearAttentionAndSlidingWindowAttentionLayer")
_EMPTY_LAYERS = ("DummyLayer",)

#: (tensors of the groups, in row order, and the batch dim) -> the joined or parted tensor.
_Rows = Callable[[list[Tensor], int], Tensor]


def cache_keyword(model: Any) -> str:
    """The keyword a transformers causal LM's forward takes its KV cache by: "cache" from
    transformers 5.24 on (where the old name warns), "past_key_values" before (5.17)."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def join_caches(cache0: Any, cache1: Any) -> Any:
    """One cache holding cache0's rows, then cache1's (new tensors; the inputs are not
    changed). Layers never written (before the first step) stay empty."""
    _check_cache(cache0)
    joined = copy.copy(cache0)
    joined.layers = [_with_rows([a, b], lambda ts, dim: torch.cat(ts, dim=dim))
                     for a, b in zip(cache0.layers, cache1.layers, strict=True)]
    return joined


def part_cache(cache: Any, b: int) -> tuple[Any, Any]:
    """(rows [0, b), rows [b, B)) of a cache, as two caches viewing its tensors."""
    _check_cache(cache)
    parts = []
    for rows in (slice(0, b), slice(b, None)):
        part = copy.copy(cache)
        part.layers = [_with_rows([layer], lambda ts, dim, rows=rows: _narrow(ts[0], dim, rows))
                       for layer in cache.layers]
        parts.append(part)
    return parts[0], parts[1]


def _check_cache(cache: Any) -> None:
    """ValueError for a cache with per-row state beyond its layers: a class of the model's
    own, or tensors a model binds to the cache (transformers 5.17's Qwen4-Exp keeps its
    positions there)."""
    name = type(cache).__name__
    own = [key for key, value in vars(cache).items()
           if key not in _base_attributes(cache) and isinstance(value, Tensor)]
    if name not in _ROW_CACHES or own:
        what = f"a {name}" if not own else f"a {name} holding {', '.join(own)}"
        raise ValueError(f"moe.hf.generate: the model's KV cache is {what}, whose state "
                         f"beyond its layers dbo cannot join and part by rows (it handles "
                         f"{', '.join(_ROW_CACHES)} layers): generate where every step splits "
                         f"(DBOConfig(min_prefill_tokens=1, min_decode_tokens=1)), so each "
                         f"ubatch keeps its own cache")


def _base_attributes(cache: Any) -> set[str]:
    """The attributes every DynamicCache has (a fresh one's)."""
    from transformers import DynamicCache
    return set(vars(DynamicCache()))


def _is(layer: Any, names: tuple[str, ...]) -> bool:
    return type(layer).__name__ in names


def _with_rows(layers: list[Any], rows: _Rows) -> Any:
    """A shallow copy of layers[0] whose batch-major tensors are `rows` of the layers'."""
    first = layers[0]
    known = _is(first, _KEY_VALUE_LAYERS + _STATE_LAYERS + _EMPTY_LAYERS)
    if not known:
        raise ValueError(f"moe.hf.generate: the model's KV cache has a {type(first).__name__} "
                         f"layer, whose state dbo cannot join and part by rows (it handles "
                         f"{', '.join(dict.fromkeys(_KEY_VALUE_LAYERS + _STATE_LAYERS + _EMPTY_LAYERS))}"
                         f"): generate where every step splits (DBOConfig(min_prefill_tokens=1, "
                         f"min_decode_tokens=1)), so each ubatch keeps its own cache")
    new = copy.copy(first)
    if _is(first, _KEY_VALUE_LAYERS) and first.is_initialized:
        _assert_same(layers, "is_initialized")
        new.keys = rows([layer.keys for layer in layers], 0)
        new.values = rows([layer.values for layer in layers], 0)
    if getattr(first, "is_indexer_initialized", False):
        _assert_same(layers, "is_indexer_initialized")
        new.indexer_keys = rows([layer.indexer_keys for layer in layers], 0)
        if getattr(first, "indexer_position_ids", None) is not None:
            # [., B, L]: the rows are dim 1 (`DynamicIndexedLayer.batch_select_indices`)
            new.indexer_position_ids = rows([layer.indexer_position_ids for layer in layers], 1)
    if _is(first, _STATE_LAYERS):
        for name, flags in (("conv_states", "is_conv_states_initialized"),
                            ("recurrent_states", "is_recurrent_states_initialized")):
            states = {i: (rows([getattr(layer, name)[i] for layer in layers], 0)
                          if getattr(first, flags)[i] else None)
                      for i in getattr(first, name)}
            setattr(new, name, states)
        # The per-state flags are the group's own from here on (a later step sets them).
        for name in ("is_conv_states_initialized", "is_recurrent_states_initialized",
                     "has_previous_state", "conv_kernel_size"):
            setattr(new, name, dict(getattr(first, name)))
    return new


def _assert_same(layers: list[Any], flag: str) -> None:
    assert all(getattr(layer, flag) == getattr(layers[0], flag) for layer in layers), \
        f"the two groups' caches ran different steps ({flag} differs)"


def _narrow(tensor: Tensor, dim: int, rows: slice) -> Tensor:
    index = [slice(None)] * dim + [rows]
    return tensor[tuple(index)]
