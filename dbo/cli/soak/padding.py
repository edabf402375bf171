"""Padding each soak step up to one of a few capture sizes, as serving engines pad a batch
to their CUDA-graph batch sizes: graphs are keyed by shape, so random token counts would
otherwise capture a graph per count.

Shape legend: T real tokens of this rank, P >= T the padded rows, H hidden.

Padding rows are zeros appended after the real rows. They are real work to the model:
the router scores them (all logits 0, so they tie and take the lowest expert ids), they
are dispatched, computed and combined like any row, and they count against
`MoEConfig.max_tokens_per_rank` (P never exceeds it: the largest size is --max-tokens).
Every step of the soak model computes each row on its own (per-row routing, expert rows,
combine sums per source row, a per-row Linear + GELU), and the fixed-capacity backends
reserve --max-tokens rows per source rank, so padding rows take no real row's place:
the outputs of the real rows are those of the unpadded step, and only they are checked.

The smallest size is 2: a step of 2 or more rows on every rank always splits (split
"tokens"), so each size needs one graph, never an unsplit one beside it, and a rank with
no real tokens still runs (and splits) a step of 2 padding rows.
"""
from __future__ import annotations

from torch import Tensor

#: The smallest capture size: a one-row step cannot split (module doc).
MIN_GRAPH_SIZE = 2


def default_graph_sizes(max_tokens: int) -> tuple[int, ...]:
    """Powers of two from MIN_GRAPH_SIZE below `max_tokens`, then `max_tokens` itself
    (e.g. 64 -> (2, 4, 8, 16, 32, 64); 100 -> (2, ..., 64, 100))."""
    sizes = []
    size = MIN_GRAPH_SIZE
    while size < max_tokens:
        sizes.append(size)
        size *= 2
    return (*sizes, max_tokens)


def padded_size(num_tokens: int, sizes: tuple[int, ...]) -> int:
    """The smallest of `sizes` (increasing) that holds `num_tokens` rows."""
    for size in sizes:
        if size >= num_tokens:
            return size
    raise AssertionError(f"{num_tokens} tokens exceed the largest graph size {sizes[-1]}")


def pad_rows(x_TH: Tensor, size: int) -> Tensor:
    """x_TH [T, H] -> [size, H]: the T rows, then size - T zero rows (same dtype and
    device; a new contiguous tensor, also when size == T)."""
    assert size >= x_TH.shape[0], (size, tuple(x_TH.shape))
    x_PH = x_TH.new_zeros(size, x_TH.shape[1])
    x_PH[: x_TH.shape[0]] = x_TH
    return x_PH


def capture_sweep_tokens(step: int, sizes: tuple[int, ...]) -> int | None:
    """Tokens every rank takes at `step` of the capture sweep (the first len(sizes) steps,
    largest size first), or None after it. Every rank runs the same size at the same
    step, so each size is captured once and together on every rank; afterwards every
    rank holds a graph for every size, and no step captures again."""
    if step < len(sizes):
        return sizes[len(sizes) - 1 - step]
    return None


def real_rows(out: tuple[Tensor, ...], num_tokens: int) -> tuple[Tensor, ...]:
    """The first `num_tokens` rows of every output tensor (views)."""
    return tuple(t[:num_tokens] for t in out)


__all__ = ["MIN_GRAPH_SIZE", "capture_sweep_tokens", "default_graph_sizes", "pad_rows",
           "padded_size", "real_rows"]
