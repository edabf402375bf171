"""The static KV cache of `moe.hf.generate(..., static_cache=True)` (and `cuda_graph=True`):
one transformers `StaticCache` for the whole batch, each ubatch's cache a view of its rows.

Shape legend: B rows (sequences), b rows of ubatch 0, S prompt positions, M cache slots
(`max_cache_len`), L layers, N heads, D head width.

Every layer of a `StaticCache` holds keys / values [B, N, M, D] (DeepSeek-V3 caches its
compressed latents there: N = 1, D the latent widths), allocated once. Ubatch u's cache
is a shallow copy of it whose layers hold row views [rows] of those tensors: a step of
the ubatch writes into the one cache, and a step on the whole batch uses the one cache
itself, so no step joins, parts or reallocates anything, and every decode step sees the
same tensors at the same addresses (what a CUDA graph replays).

How a `StaticLayer` is used by transformers (the same in 5.17 and 5.24): `update` writes
the step's keys and values in place (`index_copy_`) at slots `cumulative_length +
arange(q)` and returns the whole [., N, M, D] tensors; `cumulative_length` is a device
tensor of the layer, advanced in place by `update`. The mask builder takes the query's
slot from the first layer's `cumulative_length` (`get_query_offset`, a tensor: no host
read) and sizes the mask to M (`get_mask_sizes` = (M, 0)), padding the 2D mask with
zeros up to M. The three caches here (the batch's, each ubatch's) advance on different
steps, so each step sets the slot of the cache it uses from the step's `cache_position`
instead (`StaticKV.set_slot`): the layers' `cumulative_length` are views of one [L]
tensor per cache, set by one copy.

A sliding-window layer (`StaticSlidingWindowLayer`: sliding-window or chunked attention)
whose window holds all M slots never rolls and writes as a `StaticLayer` does, in place
at `cumulative_length + arange(q)`; its mask spans M slots from offset 0, and a chunked
mask over positions below the chunk size is the causal one. Such a layer is taken; one
whose window is smaller than M (it would roll its tensors, reading a host counter that a
replayed graph never advances) is refused.

The layers allocate their tensors lazily on the first `update`, from its keys' shape,
dtype and device. The prompt runs on the ubatches' `DynamicCache`s (`moe.hf.kv`; its
split or not as the runner decides), and the static cache is made from the joined
result: each layer initialised from the prompt's keys and values, which it then holds
in slots [0, S).
"""
from __future__ import annotations

import copy
import dataclasses
import functools
from typing import Any, Optional

import torch
from torch import Tensor

from moe.hf.deps import require

__all__ = ["StaticKV", "check_static_cache", "static_cache_from_prompt"]

STATIC_LAYER = "StaticLayer"
"""The layer class of full attention over every slot."""
SLIDING_LAYER = "StaticSlidingWindowLayer"
"""Taken where its window holds every slot (module doc)."""
MASKED_ATTENTION = ("sdpa", "eager")
"""Attention implementations whose mask covers the cache's empty slots (the mask
builder sizes it to M from the 2D mask); others build none or another kind."""


@dataclasses.dataclass(eq=False)
class StaticKV:
    """A `StaticCache` (the batch's, or a view of some of its rows) and its layers' slot
    counters. Equal and hashed by identity: a `GraphedRunner` keys its graphs on it, and
    a graph reads this cache's tensors, no other's.

    `parts`: the two ubatches' caches (rows [0, b) and [b, B)), on the batch's cache
    only and only when B >= 2."""

    cache: Any
    lengths_L: Tensor
    """[L] int64 on the cache's device: layer i's `cumulative_length` is a view of [i]."""
    rows: slice
    parts: Optional[tuple["StaticKV", "StaticKV"]] = None

    def set_slot(self, cache_position: Tensor) -> None:
        """Make this step write at slot `cache_position` ([1] int64 on the cache's
        device) and the mask put the query there; queued on the current stream."""
        self.lengths_L.copy_(cache_position)


def check_static_cache(model: Any, max_cache_len: int) -> None:
    """ValueError naming the fix where the static path cannot decode `model`: a cache
    layer other than full attention (sliding window, chunked, linear), or an attention
    implementation whose mask does not cover the empty slots."""
    transformers = require("transformers")
    cache = transformers.StaticCache(config=model.config, max_cache_len=max_cache_len)
    kinds = sorted({type(layer).__name__ for layer in cache.layers}
                   - {STATIC_LAYER, SLIDING_LAYER})
    if kinds:
        raise ValueError(
            f"moe.hf.generate(static_cache=True / cuda_graph=True): the model's static KV "
            f"cache has {', '.join(kinds)} layers, which the static path cannot view by rows "
            f"(it takes {STATIC_LAYER}, and {SLIDING_LAYER} whose window holds every slot); "
            f"generate with static_cache=False and cuda_graph=False")
    windows = [layer.max_cache_len for layer in cache.layers if _rolls(layer, max_cache_len)]
    if windows:
        raise ValueError(
            f"moe.hf.generate(static_cache=True / cuda_graph=True): the model attends over "
            f"a window of {min(windows)} tokens (sliding or chunked attention), fewer than "
            f"the {max_cache_len} the prompt and the new tokens take, and a static window "
            f"that rolls cannot be replayed; keep the prompt plus the new tokens within "
            f"{min(windows)}, or generate with static_cache=False and cuda_graph=False")
    attention = getattr(model.config, "_attn_implementation", None)
    if attention not in MASKED_ATTENTION:
        raise ValueError(
            f"moe.hf.generate(static_cache=True / cuda_graph=True): the model attends "
            f"through {attention!r}, whose mask does not cover a static cache's empty "
            f"slots; call model.set_attn_implementation('sdpa') first, or generate with "
            f"static_cache=False and cuda_graph=False")


def static_cache_from_prompt(model: Any, prompt_cache: Any, *, max_cache_len: int,
                             split_at: Optional[int]) -> StaticKV:
    """The batch's static cache holding the prompt's keys and values in slots [0, S).

    Args:
        model: the transformers model (its config sizes the cache).
        prompt_cache: a `DynamicCache` of the whole batch after the prompt (layers [B, N,
            S, D]).
        max_cache_len: M >= S, the slots of every layer.
        split_at: b, where ubatch 1's rows start (its `parts` made), or None (B < 2).
    """
    transformers = require("transformers")
    cache = transformers.StaticCache(config=model.config, max_cache_len=max_cache_len)
    assert len(cache.layers) == len(prompt_cache.layers), "the prompt ran other layers"
    num_rows = 0
    for static, layer in zip(cache.layers, prompt_cache.layers, strict=True):
        assert not _rolls(static, max_cache_len), type(static)  # check_static_cache
        keys, values = layer.keys, layer.values
        num_rows, prompt_len = keys.shape[0], keys.shape[2]
        assert prompt_len <= max_cache_len, (prompt_len, max_cache_len)
        if type(static).__name__ == SLIDING_LAYER:
            static.__class__ = _full_window(type(static))
        static.lazy_initialization(keys, values)
        static.keys[:, :, :prompt_len].copy_(keys)
        static.values[:, :, :prompt_len].copy_(values)
    whole = StaticKV(cache, _bind_lengths(cache), slice(0, num_rows))
    if split_at is not None:
        whole.parts = (_rows_of(whole, slice(0, split_at)),
                       _rows_of(whole, slice(split_at, num_rows)))
    return whole


@functools.lru_cache(maxsize=None)
def _full_window(sliding: type) -> type:
    """A subclass of transformers' `StaticSlidingWindowLayer` that writes, counts and
    sizes its mask as its base `StaticLayer` does (module doc): for a window of every slot."""
    full = next(c for c in sliding.__mro__ if c.__name__ == STATIC_LAYER)
    return type(f"FullWindow{sliding.__name__}", (sliding,), {
        "update": full.update, "get_seq_length": full.get_seq_length,
        "get_mask_sizes": full.get_mask_sizes,
        "__doc__": "A sliding-window layer whose window holds every slot (moe.hf.static_kv)."})


def _rolls(layer: Any, max_cache_len: int) -> bool:
    """Whether `layer` is not a full-attention layer of `max_cache_len` slots: another
    class, or a sliding-window one whose window is smaller (module doc)."""
    kind = type(layer).__name__
    if kind.startswith("FullWindow"):
        return False
    return kind != STATIC_LAYER and not (kind == SLIDING_LAYER
                                         and layer.max_cache_len >= max_cache_len)


def _rows_of(whole: StaticKV, rows: slice) -> StaticKV:
    """A cache whose layers view `rows` of `whole`'s tensors, with counters of its own."""
    part = copy.copy(whole.cache)
    part.layers = []
    for layer in whole.cache.layers:
        new = copy.copy(layer)
        new.keys, new.values = layer.keys[rows], layer.values[rows]
        new.batch_size = new.keys.shape[0]
        part.layers.append(new)
    return StaticKV(part, _bind_lengths(part), rows)


def _bind_lengths(cache: Any) -> Tensor:
    """One [L] counter tensor for `cache`, its layers' `cumulative_length` views of it."""
    lengths_L = torch.zeros(len(cache.layers), dtype=torch.long,
                            device=cache.layers[0].keys.device)
    for i, layer in enumerate(cache.layers):
        layer.cumulative_length = lengths_L[i]
    return lengths_L
