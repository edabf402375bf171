"""How dispatched token rows are laid out, shared by the backends and their kernels.

`RowLayout`: token rows packed as bytes, so one collective moves tokens with their
routing. `destination_mask`: which ranks each token goes to.

A packed row is `[topk_ids (K x int64) | topk_weights (K x float32) | x (H x dtype) | pad]`
as uint8, its length rounded up to 16 bytes. The ids come first so every field starts
at an offset its dtype can be viewed at, and unpacking is a set of views (no copies).
A row whose ids are all -1 is padding: it routes to no expert.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class RowLayout:
    """Byte offsets of the fields in a packed row for hidden size H and top-k K."""

    hidden_size: int
    top_k: int
    dtype: torch.dtype

    @property
    def ids_bytes(self) -> int:
        return self.top_k * 8

    @property
    def weights_offset(self) -> int:
        return self.ids_bytes

    @property
    def x_offset(self) -> int:
        return self.ids_bytes + self.top_k * 4

    @property
    def row_bytes(self) -> int:
        used = self.x_offset + self.hidden_size * self.dtype.itemsize
        return -(-used // 16) * 16

    def pack_into(self, rows_NB: Tensor, x_NH: Tensor, topk_ids_NK: Tensor,
                  topk_weights_NK: Tensor) -> None:
        """Write N tokens into the uint8 rows `rows_NB` (N x row_bytes)."""
        ids, weights, x = self.unpack(rows_NB)
        ids.copy_(topk_ids_NK)
        weights.copy_(topk_weights_NK)
        x.copy_(x_NH)

    def unpack(self, rows_NB: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Views (topk_ids_NK int64, topk_weights_NK float32, x_NH) into packed rows."""
        k, h = self.top_k, self.hidden_size
        ids = rows_NB[:, :self.ids_bytes].view(torch.int64)
        weights = rows_NB[:, self.weights_offset:self.x_offset].view(torch.float32)
        x = rows_NB[:, self.x_offset:self.x_offset + h * self.dtype.itemsize].view(self.dtype)
        assert ids.shape[1] == k and weights.shape[1] == k and x.shape[1] == h
        return ids, weights, x


def destination_mask(topk_ids_TK: Tensor, num_local_experts: int, world_size: int) -> Tensor:
    """[T, W] bool: token t has at least one expert on rank w (ids of -1 go nowhere)."""
    num_tokens = topk_ids_TK.shape[0]
    dest_TK = torch.where(topk_ids_TK >= 0, topk_ids_TK // num_local_experts, world_size)
    mask = torch.zeros(num_tokens, world_size + 1, dtype=torch.bool, device=topk_ids_TK.device)
    mask.scatter_(1, dest_TK, True)
    return mask[:, :world_size]
