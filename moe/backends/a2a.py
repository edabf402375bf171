"""`a2a`: exact all-to-all. A count exchange, a host sync for the split sizes, then one
`all_to_all_single` of packed rows (token + its top-k ids and weights) each way.

Shape legend: T tokens here, H hidden, K top-k, W ranks, S rows this rank sends
(one per (token, destination rank) pair), R rows it receives.

Each token goes once to every rank that holds at least one of its experts, carrying all
K ids and weights; the receiver maps them to local ids (-1 for experts elsewhere), so the
experts' weighted sum over k gives that rank's partial output, and the combine adds the
partials back per token. Packing the send rows and that sum are one kernel each on the
GPU (`moe.kernels.rows`). The host needs the counts, so the dispatch starts the count
exchange on a side stream and communicator (`moe.backends.counts`), yields, and reads
them only after the other ubatch has queued its compute.

Streams: each half yields once, before its send (`dbo_yield_and_switch_from_compute_to_comm`;
the step's very first dispatch sends first, see `prepare_async`),
issues its collective on the comm stream, records comm-done and returns to compute
without waiting (`dbo_switch_to_compute_async`); the receiver waits. Buffers allocated
on comm and read on compute are marked with `record_stream` by that wait, and inputs
made on compute and read on comm are marked for comm (`streams.memory`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from dbo.failures import note_collective
from dbo.yield_points import (
    dbo_enabled,
    dbo_other_ubatch_started,
    dbo_switch_to_comm_sync,
    dbo_switch_to_compute_async,
    dbo_yield,
    dbo_yield_and_switch_from_compute_to_comm,
)
from moe.backends.base import (Dispatched, OwnRows, Pending, PrepareFinalize,
                               check_process_group)
from moe.backends.counts import CountExchange
from moe.config import MoEConfig
from moe.kernels.rows import pack_rows, sum_rows
from moe.row_layout import RowLayout, destination_mask
from moe.workspace import Workspace
from streams.memory import record_on_current_stream


@dataclass(frozen=True)
class A2AHandle:
    """What the combine needs: the split sizes, and slot_TW, the row of the send order
    that carried token t to rank w (-1 where it did not go): the combine's sum reads its
    partials back from those rows."""

    slot_TW: Tensor
    send_counts: tuple[int, ...]
    recv_counts: tuple[int, ...]


def send_order(mask_TW: Tensor) -> tuple[Tensor, Tensor]:
    """The rank-major send order of the (token, rank) pairs in `mask_TW`, without a host
    sync: rank 0's tokens first (in token order), then rank 1's, ...; the W*T - S pairs
    that do not exist come last and are never sent (only the first S rows go).

    Returns (src_X, slot_TW): src_X [W*T], the token each row of the order carries (-1
    past the S pairs that exist); slot_TW [T, W], the row that carries token t to rank w
    (-1 where it does not go). A stable sort of the pairs by rank gives the same order;
    the ranks are only W + 1 keys, so a running count places each pair instead (one
    cumsum and one scatter). On an H200 at 2 ranks and 2048-8192 tokens that is 24-26 us
    of kernels per call, against 51-82 us the sort took (BENCHMARKS.md history).
    """
    num_tokens, world = mask_TW.shape
    device = mask_TW.device
    mask_X = mask_TW.t().reshape(-1)  # pair (w, t) at w * T + t
    index_X = torch.arange(mask_X.shape[0], device=device)
    sent_before_X = torch.cumsum(mask_X, 0)  # pairs that exist up to and including x
    num_sent = sent_before_X[-1:] if mask_X.numel() else index_X[:1]
    # A pair that exists goes to the count of existing pairs before it; one that does not
    # goes after all S of them, at the count of missing pairs before it.
    slot_X = torch.where(mask_X, sent_before_X - 1, num_sent + index_X - sent_before_X)
    order_X = torch.empty_like(index_X)
    order_X[slot_X] = index_X
    src_X = torch.where(index_X < num_sent, order_X % max(num_tokens, 1), -1)
    slot_TW = torch.where(mask_TW, slot_X.view(world, num_tokens).t(), -1)
    return src_X, slot_TW


class AllToAllBackend(PrepareFinalize):
    """Exact dispatch/combine with `all_to_all_single` and a host-synced count exchange."""

    name = "a2a"
    reads_counts_on_host = True
    comm_recordable = True

    def __init__(self, config: MoEConfig, group: Optional[dist.ProcessGroup]) -> None:
        super().__init__(config, group)
        self.counts = CountExchange(group)

    def prepare_async(self, x_TH: Tensor, topk_weights_TK: Tensor, topk_ids_TK: Tensor, *,
                      workspace: Workspace) -> Pending[Dispatched]:
        check_process_group(self.group, self.name)
        layout = RowLayout(x_TH.shape[1], topk_ids_TK.shape[1], x_TH.dtype)
        mask_TW = destination_mask(topk_ids_TK, self.placement.num_local_experts,
                                   self.world_size)
        # Start the count exchange first (side stream and communicator: it does not queue
        # behind data transfers, and it runs while the send order is packed below).
        pending_counts = self.counts.start(mask_TW.sum(0))
        src_X, slot_TW = send_order(mask_TW)
        rows_XB = torch.empty(src_X.shape[0], layout.row_bytes, dtype=torch.uint8,
                              device=x_TH.device)
        pack_rows(rows_XB, layout, x_TH, topk_ids_TK, topk_weights_TK, src_X,
                  policy=self.config.kernels)

        # Read the counts on the host only after the other ubatch has queued its compute
        # -- except before the other ubatch has started: then it has nothing queued that
        # the GPU could run meanwhile, and yielding first would hold this transfer back
        # by the other's host time up to its own dispatch (measured on 2x H200 at 4096
        # tokens, alternating in one process: the DBO step 0.9 ms slower). Then: read,
        # send, yield.
        send_first = dbo_enabled() and not dbo_other_ubatch_started()
        if send_first:
            dbo_switch_to_comm_sync()
        else:
            dbo_yield_and_switch_from_compute_to_comm()
        send_counts, recv_counts = pending_counts.result()
        num_send = sum(send_counts)
        recv_RB = torch.empty(sum(recv_counts), layout.row_bytes, dtype=torch.uint8,
                              device=x_TH.device)
        note_collective("all_to_all_single", self.group)
        dist.all_to_all_single(recv_RB, rows_XB[:num_send], list(recv_counts),
                               list(send_counts), group=self.group)
        record_on_current_stream(rows_XB)
        wait = dbo_switch_to_compute_async()
        if send_first:
            dbo_yield()
        handle = A2AHandle(slot_TW, send_counts, recv_counts)

        def receiver() -> Dispatched:
            wait.wait(recv_RB)
            return self.dispatched_from_rows(layout, recv_RB, handle)

        return Pending(None, receiver)

    def own_rows(self, dispatched: Dispatched) -> Optional[slice]:
        """Rows from this rank: its chunk of the receive order (rank order)."""
        return _chunk(dispatched.handle.recv_counts, self.placement.rank)

    def finalize_async(self, expert_out_RH: Tensor, dispatched: Dispatched, *,
                       workspace: Workspace, own: Optional[OwnRows] = None) -> Pending[Tensor]:
        handle: A2AHandle = dispatched.handle
        hidden = expert_out_RH.shape[1]
        dbo_yield_and_switch_from_compute_to_comm()
        back_SH = torch.empty(sum(handle.send_counts), hidden, dtype=expert_out_RH.dtype,
                              device=expert_out_RH.device)
        send_RH = expert_out_RH.contiguous()
        note_collective("all_to_all_single", self.group)
        dist.all_to_all_single(back_SH, send_RH, list(handle.send_counts),
                               list(handle.recv_counts), group=self.group)
        record_on_current_stream(send_RH)
        wait = dbo_switch_to_compute_async()
        # With `own`, the collective's copy to this rank carried rows not computed yet
        # (never read); their outputs overwrite that chunk once the collective is done.
        own_back = None if own is None else _chunk(handle.send_counts, self.placement.rank)

        def receiver() -> Tensor:
            wait.wait(back_SH)
            if own is not None:
                back_SH[own_back].copy_(own.take())
            return sum_rows(back_SH, handle.slot_TW, policy=self.config.kernels)

        return Pending(None, receiver)


def _chunk(counts: tuple[int, ...], rank: int) -> slice:
    """Rank `rank`'s rows in a buffer of chunks of `counts` rows, in rank order."""
    start = sum(counts[:rank])
    return slice(start, start + counts[rank])
