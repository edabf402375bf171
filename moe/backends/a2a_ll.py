"""`a2a_ll`: fixed-capacity all-to-all, no host sync ("low latency" style).

Shape legend: T tokens here (T <= C), C = `MoEConfig.max_tokens_per_rank`, H hidden,
K top-k, W ranks, B bytes per packed row.

Every rank sends every peer a slot of exactly C packed rows, whether it has tokens for
that peer or not, so all shapes are static and nothing is read on the host: the
dispatch never blocks the CPU and is CUDA-graph friendly. Token t's row for rank w goes
to slot position pos[t, w] = (number of earlier tokens also bound for w); unused slot
rows are padding (ids -1, zero x) and route to no expert. The receiver sees [W*C] rows,
the source rank's slot in order; the combine sends each row's partial output back to the
same slot position and the source sums a token's rows over ranks. The slot layout, the
packing and that sum are one kernel each on the GPU (`moe.backends.kernels.slots`,
`moe.kernels.rows`).

More tokens than the capacity is an error naming the capacity: a token is never dropped.
In a DBO step each ubatch sends slots of `A2ALLOptions.max_tokens_per_ubatch` rows where it
is set (each ubatch's exchange then moves half of the step's, not all of it again).
Within `moe.backends.capacity.exchange_capacity` (calls known to be smaller, such as
decode steps of a model whose capacity fits its prompt) the slots are that size.

Streams: with nothing to read on the host, each half queues its collective first and
yields after it (the `a2a` backend must yield first, to read its counts). The transfer
then starts as soon as the packing before it has run, not when the other ubatch has
queued its compute and yielded back (at a step's start, when the host is not ahead of the
GPU, that wait left the compute stream idle for ~1.2 ms on 2x H200). Both halves send
before they yield, so the comm stream still gets the ubatches' transfers alternating:
dispatch 0, dispatch 1, combine 0, combine 1, dispatch 0 of the next layer, ...

The chunked combine (`finalize_chunked_async`, `A2ALLOptions.combine_chunks` > 1, in a
single-batch-overlap step): the slots being fixed-size, chunk i is the same slot
positions of every other rank's block, one `all_to_all_single` with split sizes the host
knows (`moe.backends.combine_chunks`); the own block goes last, computed under the last
chunk's transfer. Nothing yields (one ubatch), no host read: graph-safe as above.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from dbo.failures import note_collective
from dbo.yield_points import (dbo_enabled, dbo_single_batch_overlap, dbo_switch_to_comm_sync,
                              dbo_switch_to_compute_async, dbo_yield)
from moe.backend_options import BackendOptions
from moe.backends.base import (Dispatched, OwnRows, Pending, PrepareFinalize, RunExperts,
                               check_capacity, check_process_group)
from moe.backends.capacity import step_capacity
from moe.backends.combine_chunks import CombineChunks, plan_combine_chunks
from moe.config import MoEConfig
from moe.kernels.rows import pack_rows, sum_rows
from moe.backends.kernels.slots import ll_slots
from moe.row_layout import RowLayout
from moe.workspace import Workspace
from streams.memory import record_on_current_stream


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True, kw_only=True)
class A2ALLOptions(BackendOptions):
    """Options of backend `a2a_ll` (`MoEConfig(backend="a2a_ll", backend_options=
    A2ALLOptions(...))`)."""

    backend_name = "a2a_ll"

    max_tokens_per_ubatch: Optional[int] = None
    """The capacity of one ubatch of a DBO step (at most MoEConfig.max_tokens_per_rank).
    a2a_ll sends every slot of its capacity whether filled or not; without this, each of
    a DBO step's two ubatches pads to the whole step's capacity and the step moves twice
    what the unsplit step moves. None: max_tokens_per_rank. The DBO runner stops a step
    whose largest ubatch exceeds it on every rank at once."""
    combine_chunks: int = 1
    """In a single-batch-overlap step: run the experts on the rows other ranks sent in
    this many chunks (slot positions [i*C/n, (i+1)*C/n) of every rank's block, C =
    max_tokens_per_rank) and send each chunk's combine while the next chunk's experts
    run, then this rank's own rows under the last one. 1 = the combine whole (with
    `MoEConfig.split_last_combine`'s split). Each chunk reads the weights of the experts
    its rows use, so n chunks may read an expert's weights up to n times."""
    combine_groups: int = 1
    """In a single-batch-overlap step: run this rank's experts in this many groups
    (local experts [g*E/G, (g+1)*E/G)), each over every received row, and send each
    group's partial combine while the next group's experts run: every expert's weights
    are read once. Each group's combine sends every slot row (the slots are fixed-size),
    so the step moves G times the combine's bytes; the source sums a token's G partials
    per rank. 1 = the experts whole; exclusive with combine_chunks > 1."""

    def __post_init__(self) -> None:
        super().__post_init__()
        value = self.max_tokens_per_ubatch
        if value is not None and (not _is_int(value) or value < 1):
            raise ValueError(f"A2ALLOptions.max_tokens_per_ubatch={value!r}: must be a "
                             f"positive int, or None (a ubatch takes max_tokens_per_rank).")
        chunks = self.combine_chunks
        if not _is_int(chunks) or chunks < 1:
            raise ValueError(f"A2ALLOptions.combine_chunks={chunks!r}: must be a positive int "
                             f"(1 = the combine in one piece).")
        groups = self.combine_groups
        if not _is_int(groups) or groups < 1:
            raise ValueError(f"A2ALLOptions.combine_groups={groups!r}: must be a positive int "
                             f"(1 = the experts whole).")
        if groups > 1 and chunks > 1:
            raise ValueError(f"A2ALLOptions.combine_groups={groups} and combine_chunks="
                             f"{chunks}: a single-batch-overlap combine goes by expert group "
                             f"or by row chunk, not both; set one of them to 1.")

    def check(self, config: Any) -> None:
        value, capacity = self.max_tokens_per_ubatch, config.max_tokens_per_rank
        if value is not None and (capacity is None or value > capacity):
            raise ValueError(f"A2ALLOptions.max_tokens_per_ubatch={value} needs "
                             f"MoEConfig.max_tokens_per_rank >= {value} (got {capacity}): a "
                             f"ubatch holds at most the step's tokens.")
        chunks = self.combine_chunks
        if capacity is not None and chunks > capacity:
            raise ValueError(
                f"A2ALLOptions.combine_chunks={chunks} exceeds MoEConfig.max_tokens_per_rank="
                f"{capacity}: each chunk takes at least one slot row of every rank's block; "
                f"use at most {capacity} chunks.")
        groups, local = self.combine_groups, config.num_experts
        if groups > local:
            raise ValueError(f"A2ALLOptions.combine_groups={groups} exceeds MoEConfig."
                             f"num_experts={local}: a group holds at least one expert.")


@dataclass(frozen=True)
class LLHandle:
    """slot_TW: the flat slot row of token t on rank w, or -1 if t does not go to w;
    capacity: the slot size C of this exchange (the step's or, in a DBO step, the
    ubatch's)."""

    slot_TW: Tensor
    capacity: int


class AllToAllLLBackend(PrepareFinalize):
    """Padded, fixed-capacity all-to-all: static shapes, no count exchange."""

    name = "a2a_ll"
    graph_safe_with_capacity = True
    pads_to_capacity = True  # every slot of the capacity is sent
    takes_ubatch_capacity = True
    needs_capacity = True
    comm_recordable = True
    graph_safe = True
    options_type = A2ALLOptions
    options: A2ALLOptions

    def __init__(self, config: MoEConfig, group: Optional[dist.ProcessGroup]) -> None:
        super().__init__(config, group)
        if config.max_tokens_per_rank is None:
            raise ValueError("backend 'a2a_ll' needs MoEConfig.max_tokens_per_rank (the "
                             "fixed capacity per rank): set it to the largest token count a "
                             "rank sends in one step")
        self.capacity = config.max_tokens_per_rank
        self.ubatch_capacity = self.options.max_tokens_per_ubatch or self.capacity
        self._chunk_plans: dict[tuple[int, int, torch.device], CombineChunks] = {}
        groups, local = self.options.combine_groups, self.placement.num_local_experts
        if groups > local:
            raise ValueError(f"A2ALLOptions.combine_groups={groups} exceeds the "
                             f"{local} experts each of the {self.world_size} ranks holds: a "
                             f"group holds at least one expert; use at most {local}.")

    def prepare_async(self, x_TH: Tensor, topk_weights_TK: Tensor, topk_ids_TK: Tensor, *,
                      workspace: Workspace) -> Pending[Dispatched]:
        num_tokens, world = x_TH.shape[0], self.world_size
        in_two_ubatches = dbo_enabled() and not dbo_single_batch_overlap()
        cap = self.ubatch_capacity if in_two_ubatches else self.capacity
        check_capacity(num_tokens, cap, self.name)
        check_process_group(self.group, self.name)
        cap = step_capacity(cap, ubatch=in_two_ubatches, num_tokens=num_tokens,
                            backend=self.name)
        device = x_TH.device
        layout = RowLayout(x_TH.shape[1], topk_ids_TK.shape[1], x_TH.dtype)
        slot_TW, src_X = ll_slots(topk_ids_TK, num_local_experts=self.placement.num_local_experts,
                                  world_size=world, capacity=cap, workspace=workspace,
                                  policy=self.config.kernels)
        send_XB = workspace.get("a2a_ll.send", (world * cap, layout.row_bytes), torch.uint8,
                                device)
        pack_rows(send_XB, layout, x_TH, topk_ids_TK, topk_weights_TK, src_X,
                  policy=self.config.kernels)
        recv_RB = workspace.get("a2a_ll.recv", (world * cap, layout.row_bytes),
                                torch.uint8, device)

        dbo_switch_to_comm_sync()
        note_collective("all_to_all_single", self.group)
        dist.all_to_all_single(recv_RB, send_XB, group=self.group)
        wait = dbo_switch_to_compute_async()
        dbo_yield()  # after the send: see the module doc
        handle = LLHandle(slot_TW, cap)

        def receiver() -> Dispatched:
            wait.wait()
            return self.dispatched_from_rows(layout, recv_RB, handle)

        return Pending(None, receiver)

    def own_rows(self, dispatched: Dispatched) -> Optional[slice]:
        """Rows from this rank: its slot of C rows (padding included)."""
        capacity = dispatched.handle.capacity
        start = self.placement.rank * capacity
        return slice(start, start + capacity)

    def finalize_async(self, expert_out_RH: Tensor, dispatched: Dispatched, *,
                       workspace: Workspace, own: Optional[OwnRows] = None) -> Pending[Tensor]:
        handle: LLHandle = dispatched.handle
        rows, hidden = expert_out_RH.shape
        dtype, device = expert_out_RH.dtype, expert_out_RH.device
        back_XH = workspace.get("a2a_ll.back", (rows, hidden), dtype, device)
        send_RH = expert_out_RH.contiguous()

        dbo_switch_to_comm_sync()
        note_collective("all_to_all_single", self.group)
        dist.all_to_all_single(back_XH, send_RH, group=self.group)
        record_on_current_stream(send_RH)
        wait = dbo_switch_to_compute_async()
        dbo_yield()

        def receiver() -> Tensor:
            wait.wait()
            if own is not None:
                # The collective's copy to this rank carried rows not computed yet (never
                # read); the slot returns to the same position, so overwrite it.
                back_XH[own.rows].copy_(own.take())
            return sum_rows(back_XH, handle.slot_TW, policy=self.config.kernels)

        return Pending(None, receiver)

    @property
    def chunks_combine(self) -> bool:
        """With peers to send to: one rank has no combine to chunk."""
        return self.world_size > 1

    @property
    def combine_chunks(self) -> int:
        """`A2ALLOptions.combine_chunks` where `chunks_combine`, else 1."""
        return self.options.combine_chunks if self.chunks_combine else 1

    @property
    def combine_groups(self) -> int:
        """`A2ALLOptions.combine_groups` where there are peers to send to (as for
        `chunks_combine`: one rank has no combine to overlap), else 1."""
        return self.options.combine_groups if self.chunks_combine else 1

    @property
    def max_tokens_per_ubatch(self) -> Optional[int]:
        """`A2ALLOptions.max_tokens_per_ubatch`."""
        return self.options.max_tokens_per_ubatch

    def finalize_chunked_async(self, run_experts: RunExperts, dispatched: Dispatched, *,
                               num_chunks: int, workspace: Workspace) -> Pending[Tensor]:
        """Per chunk (compute stream): the experts on the chunk's rows (gathered: a
        chunk spans every peer's block); then on the comm stream its combine into its
        rows of the chunked buffer. Last, the own block's experts, copied in on the
        compute stream. The receiver waits for the last chunk (the comm stream runs them
        in order) and sums each token's rows through the slot remap."""
        handle: LLHandle = dispatched.handle
        x_RH, ids_RK, weights_RK = (dispatched.x_RH, dispatched.topk_ids_RK,
                                    dispatched.topk_weights_RK)
        plan = self._chunk_plan(num_chunks, handle.capacity, x_RH.device)
        back_XH = workspace.get("a2a_ll.back", tuple(x_RH.shape), x_RH.dtype, x_RH.device)
        wait = None
        for chunk in plan.chunks:
            rows_N = chunk.rows_N
            send_NH = run_experts(x_RH.index_select(0, rows_N), ids_RK.index_select(0, rows_N),
                                  weights_RK.index_select(0, rows_N)).contiguous()
            dbo_switch_to_comm_sync()
            note_collective("all_to_all_single", self.group)
            dist.all_to_all_single(back_XH[chunk.out_rows], send_NH,
                                   output_split_sizes=chunk.splits,
                                   input_split_sizes=chunk.splits, group=self.group)
            record_on_current_stream(send_NH)
            wait = dbo_switch_to_compute_async()
        own = plan.own_rows
        # The own block's rows are a contiguous view: no gather. They never travel, so
        # they are computed under the last chunk's transfer and copied in here.
        back_XH[plan.own_out_rows].copy_(run_experts(x_RH[own], ids_RK[own], weights_RK[own]))
        assert wait is not None  # num_chunks >= 1

        def receiver() -> Tensor:
            wait.wait()
            return sum_rows(back_XH, plan.remap(handle.slot_TW), policy=self.config.kernels)

        return Pending(None, receiver)

    def finalize_grouped_async(self, run_experts: RunExperts, dispatched: Dispatched, *,
                               num_groups: int, workspace: Workspace) -> Pending[Tensor]:
        """Per group g (compute stream): the experts over every received row with only
        group g's local experts kept (`expert_group_ids`); then on the comm stream that
        partial output's combine into block g of the grouped buffer (every slot row, to
        this rank too: its own rows travel by the collective's local copy). The receiver
        waits for the last group (the comm stream runs them in order) and sums a token's
        G partials from each rank, rank by rank (`grouped_slots`)."""
        handle: LLHandle = dispatched.handle
        x_RH, ids_RK, weights_RK = (dispatched.x_RH, dispatched.topk_ids_RK,
                                    dispatched.topk_weights_RK)
        rows, hidden = x_RH.shape
        back_GRH = workspace.get("a2a_ll.back_groups", (num_groups, rows, hidden),
                                 x_RH.dtype, x_RH.device)
        local = self.placement.num_local_experts
        wait = None
        for g in range(num_groups):
            ids_g = expert_group_ids(ids_RK, g, num_groups=num_groups, num_experts=local)
            send_RH = run_experts(x_RH, ids_g, weights_RK).contiguous()
            dbo_switch_to_comm_sync()
            note_collective("all_to_all_single", self.group)
            dist.all_to_all_single(back_GRH[g], send_RH, group=self.group)
            record_on_current_stream(send_RH)
            wait = dbo_switch_to_compute_async()
        assert wait is not None  # num_groups >= 1

        def receiver() -> Tensor:
            wait.wait()
            sel_TX = grouped_slots(handle.slot_TW, num_groups=num_groups, rows=rows)
            return sum_rows(back_GRH.view(num_groups * rows, hidden), sel_TX,
                            policy=self.config.kernels)

        return Pending(None, receiver)

    def _chunk_plan(self, num_chunks: int, capacity: int, device: torch.device
                    ) -> CombineChunks:
        """The chunks' index tensors, built once per chunk count, slot size and device
        (eagerly, before a CUDA graph's capture: a graph's warmup steps run first)."""
        key = (num_chunks, capacity, device)
        plan = self._chunk_plans.get(key)
        if plan is None:
            plan = plan_combine_chunks(world_size=self.world_size, rank=self.placement.rank,
                                       capacity=capacity, num_chunks=num_chunks,
                                       device=device)
            self._chunk_plans[key] = plan
        return plan


def expert_group_ids(ids_RK: Tensor, group: int, *, num_groups: int,
                     num_experts: int) -> Tensor:
    """ids_RK (local expert ids, -1 = none) with only group `group`'s experts kept: local
    experts [group * E // G, (group + 1) * E // G), every other id -1."""
    lo, hi = group * num_experts // num_groups, (group + 1) * num_experts // num_groups
    return torch.where((ids_RK >= lo) & (ids_RK < hi), ids_RK, -1)


def grouped_slots(slot_TW: Tensor, *, num_groups: int, rows: int) -> Tensor:
    """slot_TW (the flat slot row of token t on rank w, -1 = none) as rows of the grouped
    combine's buffer [G * R]: [T, W * G], for each rank w its G groups' rows (g * R +
    slot), -1 where t does not go to w. A token's sum then runs rank by rank, each rank's
    groups in order."""
    offsets_G = torch.arange(num_groups, device=slot_TW.device, dtype=slot_TW.dtype) * rows
    sel_TWG = slot_TW.unsqueeze(-1) + offsets_G
    sel_TWG = torch.where(slot_TW.unsqueeze(-1) >= 0, sel_TWG, -1)
    return sel_TWG.reshape(slot_TW.shape[0], slot_TW.shape[1] * num_groups)
