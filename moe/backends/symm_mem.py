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
for each rank counted on the GPU into a symmetric [W] tensor. On the Triton path the
order and the counts are one kernel (`moe.backends.kernels.send_order_triton`, in place of ~30
torch ops, each a launch's host time): the dispatch launches that, the packing kernel
and the op. The op puts each source's rows back to back in rank order from row 0 of a
receive buffer of N rows (each peer sends at most C rows to a rank) and leaves the
counts it received on the GPU. Rows past the received total hold an earlier call's
rows: the receiver gives them ids -1 (a comparison with the total on the GPU), so they
route to no expert.
Combine: the same op backwards. The expert outputs of the received rows go back with
the received counts as splits, so they arrive at the sender in its own send order; the
sum over each token's rows is `a2a`'s (`moe.kernels.rows.sum_rows`). Both directions
move exactly the routed rows; the experts run on all N rows, as in `a2a_ll` (the padding
rows' ids are -1).

No split combine (`own_rows` is None): where this rank's own rows land in the receive
buffer is a device value, which the host cannot slice without a sync.

Buffers: two sets of symmetric buffers per process group, one per ubatch, shared by every
MoE layer of that row layout (`moe.backends.symm_mem_support.shared_buffers`): sized from
C, the same on every rank, made (a collective) at the ubatch's first dispatch and reused
by every later layer and step, so nothing is allocated after warmup, and a model of any
depth holds two (at DeepSeek-V3 shapes, H 7168, K 8, C 4096, W 2, a set is 478 MB per
rank: 0.96 GB, not 55 GB for 58 layers). Each layer keeps a reference in its ubatch
workspace (`Workspace.keep`), so a frozen workspace still refuses a first use.

Why one set per ubatch is enough. torch's op is two kernels: the first puts this rank's
counts into every peer's `out_splits_offsets` and ends in a barrier of all ranks; the
second gets each peer's rows from the peer's `input` and waits for its own gets only.
Every rank issues the same ops in the same order on the device's one comm stream, each
after waiting on its compute-done, so a peer's op k reaches this rank's memory only after
this rank has entered op k-1 (puts, before op k's barrier) or op k (gets, after it), that
is after all that this rank queued before those ops has run. A ubatch uses a set
alternately: the dispatch's half (send_XB, recv_NB, splits_D, got_D) at dispatch k, the
combine's half at its combine c, the dispatch's half again at the next dispatch k', and
between c and k' the combine's receiver makes the compute stream wait on c and reads the
combined rows (a new tensor leaves the layer; the rows in recv_NB are read only by the
layer's experts, before c). So: this rank writes the dispatch's half for k' (packing on
compute, op k' on comm) after all its reads of k (mask, experts, splits copy: before c);
peers put into it for k' only after this rank entered c; peers' gets of k from send_XB
ended before they entered c, whose barrier this rank passed before it packs for k'.
Likewise for the combine's half between c and the next combine, with k' between. None of
this asks whether k' is the same layer's next step or the next layer's dispatch, so
every layer of a ubatch can use the same set (a layer runs its combine's receiver before
the next layer starts: the modular kernel awaits it). The other ubatch's ops interleave
with these on the comm stream with no receiver between (its dispatch of layer L runs
while this ubatch's experts still read recv_NB), so the two ubatches keep two sets. The
ubatches' layers must run on one compute stream, one step after another, as a step's do.
Layers of another hidden size, top-k, dtype or capacity get their own two sets.

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
from dbo.yield_points import (dbo_current_ubatch_id, dbo_switch_to_comm_sync,
                              dbo_switch_to_compute_async, dbo_yield)
from moe.backends.a2a import send_order
from moe.backends.base import Dispatched, OwnRows, Pending, PrepareFinalize, check_capacity
from moe.backends.symm_mem_support import SymmBuffers, require_symm_mem, shared_buffers
from moe.config import MoEConfig
from moe.kernels.policy import KernelPolicy, triton_module, use_triton
from moe.kernels.rows import pack_row_fields, sum_rows
from moe.backends.kernels.slots import TRITON_MAX_WORLD_SIZE
from moe.row_layout import RowLayout, destination_mask
from moe.workspace import Workspace


def packed_send_order(topk_ids_TK: Tensor, num_local_experts: int, *, splits_W: Tensor,
                      policy: KernelPolicy) -> tuple[Tensor, Tensor]:
    """The rank-major send order of the ids' (token, rank) pairs, as `a2a.send_order`
    gives it, with the rows for each rank written into splits_W (int [W], the send
    counts' buffer). Returns (src_X int64 [W*T], slot_TW int64 [T, W]), fresh, on the
    current stream, no host sync. On the Triton path (`use_triton`, W <= 64) one kernel
    (`moe.backends.kernels.send_order_triton`); otherwise the torch ops, bit-identical."""
    num_tokens, world = topk_ids_TK.shape[0], splits_W.shape[0]
    if not (use_triton(policy, topk_ids_TK) and world <= TRITON_MAX_WORLD_SIZE):
        mask_TW = destination_mask(topk_ids_TK, num_local_experts, world)
        torch.sum(mask_TW, 0, out=splits_W)
        return send_order(mask_TW)
    device = topk_ids_TK.device
    src_X = torch.empty(world * num_tokens, dtype=torch.int64, device=device)
    slot_TW = torch.empty(num_tokens, world, dtype=torch.int64, device=device)
    triton_module("moe.backends.kernels.send_order_triton").launch_send_order(
        topk_ids_TK, num_local_experts=num_local_experts, splits_W=splits_W, slot_TW=slot_TW,
        src_X=src_X, compiled=policy.compiled_launches)
    return src_X, slot_TW


_NEEDS_GROUP = ("backend 'symm_mem' needs an expert-parallel process group of 2 or "
                "more ranks (group=...): use backend 'local' on one rank")


@dataclass(frozen=True)
class SymmViews:
    """One ubatch's shared buffers for one row layout, with the views of them that every
    call reads, made once: each view op is a host cost per call on CUDA, and the buffers
    never move (`shared_buffers`), so the views never go stale. send_fields: (ids, weights,
    x) of all of `send_XB`'s rows; recv_fields: (ids_NK, weights_NK, x_NH) of `recv_NB`;
    got_rows_W: `got_D[0]`, the rows received from each rank; back_out_NH:
    `back_recv_NH[:, :H]`, the combined rows without the stride padding."""

    buffers: SymmBuffers
    send_fields: tuple[Tensor, Tensor, Tensor]
    recv_fields: tuple[Tensor, Tensor, Tensor]
    got_rows_W: Tensor
    back_out_NH: Tensor

    @staticmethod
    def of(buffers: SymmBuffers, layout: RowLayout) -> "SymmViews":
        return SymmViews(buffers, layout.unpack(buffers.send_XB), layout.unpack(buffers.recv_NB),
                         buffers.got_D[0], buffers.back_recv_NH[:, :layout.hidden_size])


@dataclass(frozen=True)
class SymmHandle:
    """What the combine needs: slot_TW, the row of the send order that carried token t to
    rank w (-1 where it did not go), and the ubatch's buffers the dispatch used."""

    slot_TW: Tensor
    views: SymmViews


class SymmMemBackend(PrepareFinalize):
    """Exact dispatch/combine with `torch.ops.symm_mem.all_to_all_vdev`, counts on the GPU."""

    name = "symm_mem"
    graph_safe_with_capacity = True
    opt_in = True  # NVSHMEM
    needs_capacity = True
    comm_recordable = False  # all_to_all_vdev over NVSHMEM, not a c10d collective
    graph_safe = True

    @classmethod
    def check_runs(cls, world_size: int, config: Optional[MoEConfig] = None) -> None:
        require_symm_mem()
        if world_size < 2:
            raise ValueError(_NEEDS_GROUP)

    def __init__(self, config: MoEConfig, group: Optional[dist.ProcessGroup]) -> None:
        if config.max_tokens_per_rank is None:
            raise ValueError("backend 'symm_mem' needs MoEConfig.max_tokens_per_rank (its "
                             "symmetric buffers are sized for it, the same on every rank): "
                             "set it to the largest token count a rank sends in one step")
        self._op: Any = require_symm_mem()
        if group is None:
            raise ValueError(_NEEDS_GROUP)
        super().__init__(config, group)
        import torch.distributed._symmetric_memory as symm

        self.capacity = config.max_tokens_per_rank
        self.group_name: str = group.group_name
        # (hidden, top_k, dtype, device) of the inputs -> their row layout and the name
        # its buffers are kept under in a workspace: constants, made at the first call.
        self._layouts: dict[tuple[int, int, torch.dtype, torch.device],
                            tuple[RowLayout, str]] = {}
        if hasattr(symm, "enable_symm_mem_for_group"):  # a no-op where already enabled
            symm.enable_symm_mem_for_group(self.group_name)

    def _views(self, workspace: Workspace, x_TH: Tensor,
               top_k: int) -> tuple[RowLayout, SymmViews]:
        """The row layout of these inputs, and this ubatch's buffers for it: the set every
        layer of the group shares (`shared_buffers`, made at the first dispatch of the
        ubatch and layout), kept in this layer's workspace with its views so that later
        calls find both with one look-up."""
        device = x_TH.device
        key = (x_TH.shape[1], top_k, x_TH.dtype, device)
        named = self._layouts.get(key)
        if named is None:
            layout = RowLayout(x_TH.shape[1], top_k, x_TH.dtype)
            # The name is made once: formatting the layout costs microseconds a call.
            named = self._layouts[key] = (layout, f"symm_mem/{layout}/{device}")
        layout, name = named
        rows = self.world_size * self.capacity

        def make() -> SymmBuffers:
            return SymmBuffers.allocate(
                rows=rows, row_bytes=layout.row_bytes, hidden=layout.hidden_size,
                dtype=layout.dtype, world_size=self.world_size, group_name=self.group_name,
                device=device)

        def shared() -> SymmViews:
            key = (dbo_current_ubatch_id(), layout, rows)
            return SymmViews.of(shared_buffers(self.group, key, device=device, make=make),
                                layout)

        return layout, workspace.keep(name, shared)

    def prepare_async(self, x_TH: Tensor, topk_weights_TK: Tensor, topk_ids_TK: Tensor, *,
                      workspace: Workspace) -> Pending[Dispatched]:
        num_tokens = x_TH.shape[0]
        check_capacity(num_tokens, self.capacity, self.name)
        layout, views = self._views(workspace, x_TH, topk_ids_TK.shape[1])
        bufs = views.buffers
        src_X, slot_TW = packed_send_order(topk_ids_TK, self.placement.num_local_experts,
                                           splits_W=bufs.splits_D, policy=self.config.kernels)
        num_rows = src_X.shape[0]
        ids_XK, weights_XK, x_XH = views.send_fields
        pack_row_fields(ids_XK[:num_rows], weights_XK[:num_rows], x_XH[:num_rows], x_TH,
                        topk_ids_TK, topk_weights_TK, src_X, policy=self.config.kernels)

        dbo_switch_to_comm_sync()
        note_collective("symm_mem.all_to_all_vdev", self.group)
        self._op(bufs.send_XB, bufs.recv_NB, bufs.splits_D, bufs.got_D, self.group_name)
        wait = dbo_switch_to_compute_async()
        dbo_yield()  # after the send: nothing to read first (see a2a_ll's module doc)
        handle = SymmHandle(slot_TW, views)

        def receiver() -> Dispatched:
            wait.wait()
            ids_NK, weights_NK, x_NH = views.recv_fields
            # Rows at or past the received total are left from earlier calls.
            stale_N1 = bufs.row_N1 >= views.got_rows_W.sum()
            ids_NK = self.local_ids(ids_NK).masked_fill_(stale_N1, -1)
            return Dispatched(x_NH, ids_NK, weights_NK, handle)

        return Pending(None, receiver)

    def finalize_async(self, expert_out_RH: Tensor, dispatched: Dispatched, *,
                       workspace: Workspace, own: Optional[OwnRows] = None) -> Pending[Tensor]:
        self.refuse_split(own)
        handle: SymmHandle = dispatched.handle
        views = handle.views
        bufs = views.buffers
        rows, hidden = expert_out_RH.shape
        assert hidden == views.back_out_NH.shape[1], (hidden, views.back_out_NH.shape)
        # The op reads only the rows each peer sent (its counts), from row 0 on.
        bufs.back_send_YH[:rows, :hidden].copy_(expert_out_RH)
        bufs.splits_C.copy_(views.got_rows_W)

        dbo_switch_to_comm_sync()
        note_collective("symm_mem.all_to_all_vdev", self.group)
        self._op(bufs.back_send_YH, bufs.back_recv_NH, bufs.splits_C, bufs.got_C,
                 self.group_name)
        wait = dbo_switch_to_compute_async()
        dbo_yield()

        def receiver() -> Tensor:
            wait.wait()
            return sum_rows(views.back_out_NH, handle.slot_TW, policy=self.config.kernels)

        return Pending(None, receiver)
