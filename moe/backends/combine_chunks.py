"""Where the rows of a chunked combine go (`a2a_ll` in a single-batch-overlap step).

Shape legend: W ranks, C = `MoEConfig.max_tokens_per_rank` (slot rows per rank), n chunks,
c_i rows of chunk i per peer, N rows of one chunk, H hidden.

The dispatch leaves rank r a receive buffer of W slot blocks of C rows, block w from
source rank w. Chunk i is slot positions [lo_i, hi_i) (lo_i = i*C // n) of every other
rank's block, so its combine is one `all_to_all_single` of c_i = hi_i - lo_i rows per
peer (0 to itself): split sizes the host knows, as the slots are fixed-size. This rank's
own block is not sent at all; it is computed last and copied in.

The combine's receive buffer holds the chunks one after the other, then the own block:

    [ chunk 0: c_0 rows from each peer, in rank order | chunk 1 | ... | own block: C rows ]

so every chunk lands in one contiguous range (the collective's output), and the final
sum reads a token's rows through `slot_map_X1` (slot row -> row of this buffer) instead
of the slot rows themselves. It sums the same rows in the same rank order as the
unchunked combine.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class CombineChunk:
    """One chunk: `rows_N`, the receive-buffer rows the experts run on (int64, peers in rank
    order, each peer's positions [lo, hi)); `out_rows`, where its combine lands in the
    chunked buffer; `splits`, rows to and from each rank (0 for this rank)."""

    rows_N: Tensor
    out_rows: slice
    splits: list[int]


@dataclass(frozen=True)
class CombineChunks:
    """The n chunks of rank `rank`'s combine and the slot remap of its final sum."""

    chunks: tuple[CombineChunk, ...]
    own_rows: slice
    """This rank's own block in the receive buffer (the rows it sent itself)."""
    own_out_rows: slice
    """The same block in the chunked buffer: its last C rows."""
    slot_map_X1: Tensor
    """[W*C + 1] int64: slot row -> row of the chunked buffer; the last entry (-1) is
    where slot -1 (no row) lands, so the remap is one gather."""

    def remap(self, slot_TW: Tensor) -> Tensor:
        """slot_TW (int64 [T, W], -1 = none) as rows of the chunked buffer."""
        return self.slot_map_X1[slot_TW]


def plan_combine_chunks(*, world_size: int, rank: int, capacity: int, num_chunks: int,
                        device: torch.device) -> CombineChunks:
    """The chunks of `rank`'s combine; index tensors on `device` (built once per layer and
    device, before any capture: the caller caches them)."""
    assert world_size > 1 and 1 <= num_chunks <= capacity, (world_size, num_chunks, capacity)
    peers = [w for w in range(world_size) if w != rank]
    num_peers = len(peers)
    bounds = [i * capacity // num_chunks for i in range(num_chunks + 1)]
    slot_map = [0] * (world_size * capacity) + [-1]
    chunks = []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        size, start = hi - lo, num_peers * lo
        rows = []
        for j, w in enumerate(peers):
            rows.extend(range(w * capacity + lo, w * capacity + hi))
            for p in range(lo, hi):
                slot_map[w * capacity + p] = start + j * size + p - lo
        splits = [0 if w == rank else size for w in range(world_size)]
        chunks.append(CombineChunk(torch.tensor(rows, dtype=torch.int64, device=device),
                                   slice(start, start + num_peers * size), splits))
    own_start = num_peers * capacity
    for p in range(capacity):
        slot_map[rank * capacity + p] = own_start + p
    return CombineChunks(tuple(chunks),
                         own_rows=slice(rank * capacity, (rank + 1) * capacity),
                         own_out_rows=slice(own_start, own_start + capacity),
                         slot_map_X1=torch.tensor(slot_map, dtype=torch.int64, device=device))
