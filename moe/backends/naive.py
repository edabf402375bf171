"""`naive`: all-gather every rank's tokens and routing, run the local experts on all of
them, reduce-scatter the partial outputs back (sum over ranks).

Shape legend: T tokens here, C rows per rank in the gathered buffer (the largest T of
the group, or `MoEConfig.max_tokens_per_rank` when set), H hidden, K top-k, W ranks.

Ranks may hold different token counts, so without a capacity the dispatch first
all-gathers the counts and reads them on the host (it yields before that, like `a2a`).
With `max_tokens_per_rank` set every rank pads to that capacity instead: no host sync,
static shapes. Padding rows carry ids of -1 and route to no expert.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from dbo.failures import note_collective
from dbo.yield_points import (
    ComputeWait,
    dbo_switch_to_compute_async,
    dbo_yield_and_switch_from_compute_to_comm,
)
from moe.backends.base import (Dispatched, OwnRows, Pending, PrepareFinalize, check_capacity,
                               check_process_group)
from moe.row_layout import RowLayout
from moe.workspace import Workspace
from streams.memory import record_on_current_stream


@dataclass(frozen=True)
class NaiveHandle:
    num_tokens: int
    rows_per_rank: int


class NaiveBackend(PrepareFinalize):
    """All-gather dispatch, reduce-scatter combine."""

    name = "naive"
    reads_counts_on_host = True  # the counts' maximum, without a capacity
    graph_safe_with_capacity = True
    comm_recordable = True

    @property
    def graph_safe(self) -> bool:  # type: ignore[override]
        """Capturable with a fixed capacity; without one it reads the counts' max."""
        return self.config.max_tokens_per_rank is not None

    def prepare_async(self, x_TH: Tensor, topk_weights_TK: Tensor, topk_ids_TK: Tensor, *,
                      workspace: Workspace) -> Pending[Dispatched]:
        layout = RowLayout(x_TH.shape[1], topk_ids_TK.shape[1], x_TH.dtype)

        def pack(capacity: int) -> Tensor:
            return self._padded_rows(layout, capacity, x_TH, topk_ids_TK, topk_weights_TK)

        wait, gathered_RB, handle = self._gather_async(x_TH.shape[0], pack, x_TH.device)

        def receiver() -> Dispatched:
            wait.wait(gathered_RB)
            return self.dispatched_from_rows(layout, gathered_RB, handle)

        return Pending(None, receiver)

    def _gather_async(self, num_tokens: int, pack: Callable[[int], Tensor],
                      device: torch.device) -> tuple[ComputeWait, Tensor, NaiveHandle]:
        """All-gather every rank's packed rows: `pack(capacity)` gives this rank's
        [capacity, row_bytes] uint8 rows (its tokens, then padding). Returns the wait for
        the compute stream, the [W * capacity, row_bytes] gathered rows and the handle.
        Called on the compute stream; yields to the comm stream before the first
        collective and switches back after the last."""
        world = self.world_size
        capacity = self.config.max_tokens_per_rank
        if capacity is not None:
            check_capacity(num_tokens, capacity, self.name)
            rows_CB = pack(capacity)
        check_process_group(self.group, self.name)
        dbo_yield_and_switch_from_compute_to_comm()
        if capacity is None:
            count_W = torch.empty(world, dtype=torch.int64, device=device)
            note_collective("all_gather_into_tensor", self.group)
            dist.all_gather_into_tensor(
                count_W, torch.tensor([num_tokens], dtype=torch.int64, device=device),
                group=self.group)
            capacity = max(int(count_W.max().item()), 1)
            rows_CB = pack(capacity)
        gathered_RB = torch.empty(world * capacity, rows_CB.shape[1], dtype=torch.uint8,
                                  device=device)
        note_collective("all_gather_into_tensor", self.group)
        dist.all_gather_into_tensor(gathered_RB, rows_CB, group=self.group)
        record_on_current_stream(rows_CB)
        wait = dbo_switch_to_compute_async()
        return wait, gathered_RB, NaiveHandle(num_tokens, capacity)

    def finalize_async(self, expert_out_RH: Tensor, dispatched: Dispatched, *,
                       workspace: Workspace, own: Optional[OwnRows] = None) -> Pending[Tensor]:
        self.refuse_split(own)
        handle: NaiveHandle = dispatched.handle
        dbo_yield_and_switch_from_compute_to_comm()
        send_RH = expert_out_RH.contiguous()
        mine_CH = torch.empty(handle.rows_per_rank, send_RH.shape[1], dtype=send_RH.dtype,
                              device=send_RH.device)
        note_collective("reduce_scatter_tensor", self.group)
        dist.reduce_scatter_tensor(mine_CH, send_RH, group=self.group)
        record_on_current_stream(send_RH)
        wait = dbo_switch_to_compute_async()

        def receiver() -> Tensor:
            wait.wait(mine_CH)
            return mine_CH[:handle.num_tokens]

        return Pending(None, receiver)

    @staticmethod
    def _padded_rows(layout: RowLayout, capacity: int, x_TH: Tensor, topk_ids_TK: Tensor,
                     topk_weights_TK: Tensor) -> Tensor:
        """[capacity, row_bytes]: this rank's tokens, then padding rows (ids -1)."""
        num_tokens = x_TH.shape[0]
        rows_CB = torch.zeros(capacity, layout.row_bytes, dtype=torch.uint8, device=x_TH.device)
        ids_CK, _, _ = layout.unpack(rows_CB)
        ids_CK[num_tokens:] = -1
        layout.pack_into(rows_CB[:num_tokens], x_TH, topk_ids_TK, topk_weights_TK)
        return rows_CB
