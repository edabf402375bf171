"""`deepep_ht`: DeepEP's normal (high-throughput) kernels, `deep_ep.Buffer` over NVLink.

Shape legend: T tokens here, H hidden, P = H rounded up to 512-byte rows (DeepEP's copy
unit; x is padded to P and the result sliced back), K top-k, R rows received.

Dispatch: `get_dispatch_layout` (which ranks and experts each token goes to), then
`dispatch`: each token goes once to every rank holding one of its experts, with its K
ids and weights. DeepEP hands the ids over already local (-1 where the expert lives
elsewhere), which is `Dispatched.topk_ids_RK` as is. The experts return their rows
weighted and summed over the token's local experts; DeepEP's combine adds those rows
per token without weights, so the weighting happens once.

Two forms of the dispatch:
- default: DeepEP reads the received counts on the host (it busy-waits for them) and
  allocates exactly R rows. The host wait comes after a yield, so the other ubatch's
  compute is queued first (as in `a2a`: except before the other ubatch has started).
- `DeepEPHTOptions.worst_case_dispatch` (DeepEP's `num_worst_tokens`): R is always
  max_tokens_per_rank * ranks, the rows past the real count have ids -1 (routed to no
  expert), nothing is read on the host and a step can be captured in a CUDA graph.

Streams: DeepEP runs its kernels on its own comm stream. Each call gets an event captured
on the compute stream before any yield (`previous_event`; an event recorded after a yield
would also cover the other ubatch's queued compute) and `async_finish=True`; the receiver
makes the compute stream wait on the event DeepEP returns. DeepEP marks the tensors it
reads or allocates as used by its stream (`record_stream`), so none is reused early.
Outside a DBO step nothing can overlap, so each call takes DeepEP's synchronous form
(its comm stream waits on the compute stream and the compute stream on it, inside the
call): that drops the events and the stream marks, ~80 us per dispatch and combine at
128 tokens per rank on 2x H200 (the comm micro-benchmark, BENCHMARKS.md).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from dbo.yield_points import dbo_enabled, dbo_other_ubatch_started, dbo_yield
from moe.backend_options import BackendOptions
from moe.backends.base import Dispatched, OwnRows, Pending, PrepareFinalize, check_capacity
from moe.backends.deepep_support import (
    check_ht_world,
    ht_buffer_bytes,
    ht_configs,
    ht_padded_hidden,
    require_deep_ep,
    shared_buffer,
)
from moe.config import MoEConfig
from moe.workspace import Workspace


@dataclass(frozen=True)
class HTHandle:
    """DeepEP's dispatch handle (a tuple of tensors: prefix matrices, source indices,
    send heads), which the combine takes back."""

    deep_handle: tuple


@dataclass(frozen=True, kw_only=True)
class DeepEPHTOptions(BackendOptions):
    """Options of backend `deepep_ht` (`MoEConfig(backend="deepep_ht", backend_options=
    DeepEPHTOptions(...))`)."""

    backend_name = "deepep_ht"

    worst_case_dispatch: bool = False
    """Receive into buffers sized for the worst case (max_tokens_per_rank * ranks rows,
    DeepEP's `num_worst_tokens`) instead of reading the counts on the host: no host sync,
    so a step can be captured in a CUDA graph; needs MoEConfig.max_tokens_per_rank."""


class DeepEPHTBackend(PrepareFinalize):
    """DeepEP normal kernels: exact rows (default) or worst-case rows (graph-capturable)."""

    name = "deepep_ht"
    reads_counts_on_host = True  # the default (not worst-case) form
    opt_in = True  # DeepEP
    comm_recordable = False  # DeepEP's own NVLink/RDMA kernels
    options_type = DeepEPHTOptions
    row_dtypes = (torch.bfloat16,)
    library = "DeepEP"
    kernels = "DeepEP's normal kernels"
    options: DeepEPHTOptions
    agreement_prefix = "deepep_"

    @classmethod
    def check_runs(cls, world_size: int, config: Optional[MoEConfig] = None) -> None:
        require_deep_ep(cls.name, "Buffer")
        check_ht_world(cls.name, world_size)
        if config is not None:
            cls.check_shape(config.hidden_size, config.dtype, world_size)

    @classmethod
    def check_shape(cls, hidden_size: int, dtype: torch.dtype, world_size: int) -> None:
        ht_padded_hidden(cls.name, hidden_size, dtype)

    def __init__(self, config: MoEConfig, group: Optional[dist.ProcessGroup]) -> None:
        super().__init__(config, group)
        deep_ep = require_deep_ep(self.name, "Buffer")
        self.padded_hidden = ht_padded_hidden(self.name, config.hidden_size, config.dtype)
        self.num_worst_tokens = 0
        if self.options.worst_case_dispatch:
            if config.max_tokens_per_rank is None:
                raise ValueError("backend 'deepep_ht' with DeepEPHTOptions.worst_case_dispatch "
                                 "needs MoEConfig.max_tokens_per_rank (the receive buffers "
                                 "hold max_tokens_per_rank * ranks rows): set it, or turn "
                                 "worst_case_dispatch off")
            self.num_worst_tokens = config.max_tokens_per_rank * self.world_size
        if group is None:
            raise ValueError("backend 'deepep_ht' needs an EP process group (group=...): "
                             "use backend 'local' on one rank")
        check_ht_world(self.name, self.world_size)
        self.topk_idx_dtype = getattr(deep_ep, "topk_idx_t", torch.int64)
        self.dispatch_config, self.combine_config = ht_configs(deep_ep, self.world_size)
        nvl, rdma = ht_buffer_bytes(deep_ep, self.padded_hidden * config.dtype.itemsize,
                                    self.world_size)
        self.shared = shared_buffer(deep_ep, group, "ht", num_nvl_bytes=nvl,
                                    num_rdma_bytes=rdma)

    @property
    def graph_safe(self) -> bool:  # type: ignore[override]
        """Only the worst-case form: the default one reads the received counts on the host."""
        return self.num_worst_tokens > 0

    def prepare_async(self, x_TH: Tensor, topk_weights_TK: Tensor, topk_ids_TK: Tensor, *,
                      workspace: Workspace) -> Pending[Dispatched]:
        if self.num_worst_tokens:
            check_capacity(x_TH.shape[0], self.config.max_tokens_per_rank, self.name)
        buffer = self.shared.buffer
        x_TP = self._pad(x_TH)
        ids_TK = _as(topk_ids_TK, self.topk_idx_dtype)
        weights_TK = _as(topk_weights_TK, torch.float32)

        in_step = dbo_enabled()  # outside a step: DeepEP's synchronous form (module doc)
        compute_done = buffer.capture() if in_step else None  # before any yield
        per_rank, per_rdma_rank, per_expert, in_rank_TW, layout_done = buffer.get_dispatch_layout(
            ids_TK, self.config.num_experts, previous_event=compute_done, async_finish=in_step,
            allocate_on_comm_stream=False)
        # The default dispatch holds the host until the counts arrive: queue the other
        # ubatch's compute first, unless it has not started (then it has nothing queued
        # that the GPU could run meanwhile; `a2a` measured the same choice).
        yield_first = (self.num_worst_tokens == 0 and in_step
                       and dbo_other_ubatch_started())
        if yield_first:
            dbo_yield()
        recv_x_RP, recv_ids_RK, recv_weights_RK, _, deep_handle, done = buffer.dispatch(
            x_TP, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma_rank,
            is_token_in_rank=in_rank_TW, num_tokens_per_expert=per_expert, topk_idx=ids_TK,
            topk_weights=weights_TK, expert_alignment=1,
            num_worst_tokens=self.num_worst_tokens, config=self.dispatch_config,
            previous_event=layout_done if in_step else None, async_finish=in_step,
            allocate_on_comm_stream=False)
        if in_step and not yield_first:
            dbo_yield()
        handle = HTHandle(deep_handle)
        hidden = self.config.hidden_size

        def receiver() -> Dispatched:
            if in_step:
                done.current_stream_wait()
            # ids arrive as DeepEP's topk_idx_t; the experts read int64.
            recv_x_RH = recv_x_RP if self.padded_hidden == hidden else recv_x_RP[:, :hidden]
            return Dispatched(recv_x_RH, _as(recv_ids_RK, torch.int64), recv_weights_RK,
                              handle)

        return Pending(None, receiver)

    def finalize_async(self, expert_out_RH: Tensor, dispatched: Dispatched, *,
                       workspace: Workspace, own: Optional[OwnRows] = None) -> Pending[Tensor]:
        self.refuse_split(own)
        handle: HTHandle = dispatched.handle
        buffer = self.shared.buffer
        out_RP = self._pad(expert_out_RH)
        in_step = dbo_enabled()
        combined_TP, _, done = buffer.combine(
            out_RP, handle.deep_handle, topk_weights=None, config=self.combine_config,
            previous_event=buffer.capture() if in_step else None, async_finish=in_step,
            allocate_on_comm_stream=False)
        if in_step:
            dbo_yield()  # after the send: the combine never holds the host
        hidden = self.config.hidden_size

        def receiver() -> Tensor:
            if in_step:
                done.current_stream_wait()
            if self.padded_hidden == hidden:
                return combined_TP
            return combined_TP[:, :hidden].contiguous()

        return Pending(None, receiver)

    def _pad(self, rows_NH: Tensor) -> Tensor:
        """[N, H] -> contiguous [N, P] (zeros in the padding columns)."""
        pad = self.padded_hidden - rows_NH.shape[1]
        if pad == 0:
            return rows_NH.contiguous()
        return F.pad(rows_NH, (0, pad))


def _as(t: Tensor, dtype: torch.dtype) -> Tensor:
    """`t` as a contiguous tensor of `dtype`: itself when it is one already, checked here
    because `Tensor.to` and `contiguous` cost a dispatcher call each even when they
    return `t` (a few us per dispatch, which is host-bound at small token counts)."""
    if t.dtype == dtype and t.is_contiguous():
        return t
    return t.to(dtype).contiguous()
