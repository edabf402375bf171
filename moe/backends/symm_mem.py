"""`symm_mem`: exact all-to-all on torch symmetric memory (NVSHMEM), with no host sync.

Shape legend: T tokens here (T <= C), C = `MoEConfig.max_tokens_per_rank`, W ranks, H
hidden, K top-k, B bytes per packed row, S rows this rank sends (one per (token,
destination rank) pair), N = W*C (the most rows a rank sends or receives).

Only routed rows travel, as in `a2a`, but the counts never reach the host: they go to
the GPU-side op `torch.ops.symm_mem.all_to_all_vdev` (`moe.backends.symm_mem_support`
says what it needs), so nothing here blocks the CPU and a step can be captured in a CUDA
graph.

Dispatch: the rows are `a2a`'s (token + its K ids and weights, `moe.row_layout`), packed
rank-major in the order of `a2a.send_order` into a symmetric send buffer, with the rows
for each rank counted on the GPU into a symmetric [W] tensor. The op puts each source's
rows back to back in rank order from row 0 of a receive buffer of N rows (each peer
sends at most C rows to a rank) and leaves the counts it received on the GPU. Rows past
the received total hold an earlier call's rows: the receiver gives them ids -1 (a
comparison with the total on the GPU), so they route to no expert.
Combine: the same op backwards. The expert outputs of the received rows go back with
the received counts as splits, so they arrive at the sender in its own send order; the
sum over each token's rows is `a2a`'s (`moe.kernels.rows.sum_rows`). Both directions
move exactly the routed rows; the experts run on all N rows, as in `a2a_ll` (the padding
rows' ids are -1).

No split combine (`own_rows` is None): where this rank's own rows land in the receive
buffer is a device value, which the host cannot slice without a sync.

Buffers: one set of symmetric buffers per ubatch workspace (`Workspace.keep`), sized from
C, the same on every rank, made (a collective) at the ubatch's first dispatch and reused by
every later step: nothing is allocated after warmup. Reuse is safe because each op starts
with a barrier of all ranks: a buffer of one ubatch's dispatch is next written by that
ubatch's next dispatch, which every rank reaches only after it has passed the barrier of
the combine between them, i.e. after every rank has finished this dispatch (and likewise
for the combine's buffers).

Send/receive split: none. The op takes no signal and returns nothing: it launches a
kernel that exchanges the counts and ends in a barrier of all ranks, then the data kernel,
which copies and waits for its copies to finish (`nvshmem_quiet`); nothing is left to
wait for later. torch's `nvshmem_put_with_signal` / `nvshmem_wait_for_signal` ops take
their byte count from the host, which does not know the counts. So, as in `a2a_ll`, each
half packs on the compute stream, issues the op on the comm stream, records comm-done and
yields at once (the other ubatch's compute runs meanwhile; the op's blocks hold SMs until
the data is there); the receiver waits on that event.

More tokens than C is an error naming the capacity, raised before any collective (the
DBO runner raises it on every rank at its vote, `dbo_max_tokens_per_rank`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from dbo.failures import note_collective
from dbo.yield_points import dbo_switch_to_comm_sync, dbo_switch_to_compute_async, dbo_yield
from moe.backends.a2a import send_order
from moe.backends.base import Dispatched, OwnRows, Pending, PrepareFinalize, check_capacity
from moe.backends.symm_mem_support import SymmBuffers, require_symm_mem
from moe.config import MoEConfig
from moe.kernels.rows import pack_rows, sum_rows
from moe.row_layout import RowLayout, destination_mask
from moe.workspace import Workspace


@dataclass(frozen=True)
class SymmHandle:
    """What the combine needs: slot_TW, the row of the send order that carried token t to
    rank w (-1 where it did not go), and the ubatch's buffers the dispatch used."""

    slot_TW: Tensor
    buffers: SymmBuffers


class SymmMemBackend(PrepareFinalize):
    """Exact dispatch/combine with `torch.ops.symm_mem.all_to_all_vdev`, counts on the GPU."""

    name = "symm_mem"
    comm_recordable = False  # all_to_all_vdev over NVSHMEM, not a c10d collective
    graph_safe = True

    def __init__(self, config: MoEConfig, group: Optional[dist.ProcessGroup]) -> None:
        if config.max_tokens_per_rank is None:
            raise ValueError("backend 'symm_mem' needs MoEConfig.max_tokens_per_rank (its "
                             "symmetric buffers are sized for it, the same on every rank): "
                             "set it to the largest token count a rank sends in one step")
        self._op: Any = require_symm_mem()
        if group is None:
            raise ValueError("backend 'symm_mem' needs an expert-parallel process group of "
                             "2 or more ranks (group=...): use backend 'local' on one rank")
        super().__init__(config, group)
        import torch.distributed._symmetric_memory as symm

        self.capacity = config.max_tokens_per_rank
        self.group_name: str = group.group_name
        if hasattr(symm, "enable_symm_mem_for_group"):  # a no-op where already enabled
            symm.enable_symm_mem_for_group(self.group_name)

    def _buffers(self, workspace: Workspace, layout: RowLayout,
                 device: torch.device) -> SymmBuffers:
        """This ubatch's buffers for rows of `layout` (made at its first dispatch)."""
        def make() -> SymmBuffers:
            return SymmBuffers.allocate(
                rows=self.world_size * self.capacity, row_bytes=layout.row_bytes,
                hidden=layout.hidden_size, dtype=layout.dtype, world_size=self.world_size,
                group_name=self.group_name, device=device)

        return workspace.keep(f"symm_mem/{layout}/{device}", make)

    def prepare_async(self, x_TH: Tensor, topk_weights_TK: Tensor, topk_ids_TK: Tensor, *,
                      workspace: Workspace) -> Pending[Dispatched]:
        num_tokens, world = x_TH.shape[0], self.world_size
        check_capacity(num_tokens, self.capacity, self.name)
        layout = RowLayout(x_TH.shape[1], topk_ids_TK.shape[1], x_TH.dtype)
        bufs = self._buffers(workspace, layout, x_TH.device)
        mask_TW = destination_mask(topk_ids_TK, self.placement.num_local_experts, world)
        bufs.splits_D.copy_(mask_TW.sum(0))
        src_X, slot_TW = send_order(mask_TW)
        pack_rows(bufs.send_XB[:src_X.shape[0]], layout, x_TH, topk_ids_TK, topk_weights_TK,
                  src_X, policy=self.config.kernels)

        dbo_switch_to_comm_sync()
        note_collective("symm_mem.all_to_all_vdev")
        self._op(bufs.send_XB, bufs.recv_NB, bufs.splits_D, bufs.got_D, self.group_name)
        wait = dbo_switch_to_compute_async()
        dbo_yield()  # after the send: nothing to read first (see a2a_ll's module doc)
        handle = SymmHandle(slot_TW, bufs)

        def receiver() -> Dispatched:
            wait.wait()
            ids_NK, weights_NK, x_NH = layout.unpack(bufs.recv_NB)
            # Rows at or past the received total are left from earlier calls.
            stale_N1 = bufs.row_N1 >= bufs.got_D[0].sum()
            ids_NK = self.local_ids(ids_NK).masked_fill_(stale_N1, -1)
            return Dispatched(x_NH, ids_NK, weights_NK, handle)

        return Pending(None, receiver)

    def finalize_async(self, expert_out_RH: Tensor, dispatched: Dispatched, *,
                       workspace: Workspace, own: Optional[OwnRows] = None) -> Pending[Tensor]:
        self.refuse_split(own)
        handle: SymmHandle = dispatched.handle
        bufs = handle.buffers
        rows, hidden = expert_out_RH.shape
        # The op reads only the rows each peer sent (its counts), from row 0 on.
        bufs.back_send_YH[:rows, :hidden].copy_(expert_out_RH)
        bufs.splits_C.copy_(bufs.got_D[0])

        dbo_switch_to_comm_sync()
        note_collective("symm_mem.all_to_all_vdev")
        self._op(bufs.back_send_YH, bufs.back_recv_NH, bufs.splits_C, bufs.got_C,
                 self.group_name)
        wait = dbo_switch_to_compute_async()
        dbo_yield()

        def receiver() -> Tensor:
            wait.wait()
            return sum_rows(bufs.back_recv_NH[:, :hidden], handle.slot_TW,
                            policy=self.config.kernels)

        return Pending(None, receiver)
