"""`deepep_ll`: DeepEP's low-latency kernels with receive hooks, `deep_ep.Buffer` in
low-latency mode (NVSHMEM; over NVLink within a node).

Shape legend: T tokens here (T <= max_tokens_per_rank), C = the capacity DeepEP is given
(max_tokens_per_rank, rounded up so that W*C is a multiple of 4), H hidden, K top-k,
W ranks, E_loc local experts, R = E_loc * W * C rows the experts see.

In a DBO step, dispatch (`low_latency_dispatch(..., return_recv_hook=True)`) only sends;
its `hook` launches the receive (outside one, each call is DeepEP's single kernel). The hook goes back in `Pending(hook, receiver)`, so the modular
kernel hands it to the other ubatch (`dbo_register_recv_hook`), which launches it after
queueing its own compute: no SM spins while the tokens travel. DeepEP delivers them
expert-major, [E_loc, W*C, H] with recv_count[e] valid rows at the front of expert e's
block; the experts read that buffer in place as R rows with one id each (e for the
valid rows, -1 for the padding; one small GPU op, nothing read on the host) and weight 1,
since DeepEP's combine (`low_latency_combine`, with its own hook) applies the top-k
weights itself.

FP8 dispatch (`DeepEPLLOptions.fp8_dispatch`): DeepEP casts the tokens to
float8_e4m3fn with one float32 scale per 128 channels on the way; they are dequantised
to bfloat16 (one [R, H] copy) before the experts, which take bfloat16. The combine stays
bfloat16.

Streams: with a receive hook DeepEP launches both halves on the current stream, the
compute stream: nothing crosses streams, so every tensor stays ordered by that stream.
DeepEP has two low-latency buffers, used alternately; at most two operations may wait
for their receive (one per ubatch), which `SharedBuffer.ll_started` asserts. Nothing
reads device values on the host: a step can be captured in a CUDA graph.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from dbo.yield_points import dbo_enabled
from moe.backend_options import BackendOptions
from moe.backends.base import Dispatched, OwnRows, Pending, PrepareFinalize, check_capacity
from moe.backends.deepep_support import (
    DEEPEP_MAX_INT4S,
    LLRowConstants,
    LL_HIDDEN_SIZES,
    SharedBuffer,
    check_ll_depth,
    check_ll_shape,
    check_ll_world,
    dequantize_fp8,
    ll_capacity,
    ll_expert_ids,
    ll_queue_depth,
    require_deep_ep,
    shared_buffer,
)
from moe.config import MoEConfig
from moe.workspace import Workspace


@dataclass(frozen=True)
class LLHandle:
    """DeepEP's dispatch handle, and this rank's top-k ids and weights of the tokens
    dispatched (the combine sends each token's rows back and weights them with these)."""

    deep_handle: tuple
    topk_ids_TK: Tensor
    topk_weights_TK: Tensor


@dataclass(frozen=True, kw_only=True)
class DeepEPLLOptions(BackendOptions):
    """Options of backend `deepep_ll` (`MoEConfig(backend="deepep_ll", backend_options=
    DeepEPLLOptions(...))`)."""

    backend_name = "deepep_ll"

    fp8_dispatch: bool = False
    """Send the tokens in FP8 (per-128-channel scales), dequantised to bfloat16 before
    the experts; the combine stays bfloat16."""


class DeepEPLLBackend(PrepareFinalize):
    """DeepEP low-latency kernels: fixed capacity, receive halves run as hooks."""

    name = "deepep_ll"
    graph_safe_with_capacity = True
    pads_to_capacity = True  # the experts see E_loc * W * C rows
    opt_in = True  # DeepEP
    needs_capacity = True
    comm_recordable = False  # DeepEP's own low-latency kernels
    options_type = DeepEPLLOptions
    row_dtypes = (torch.bfloat16,)
    hidden_sizes = LL_HIDDEN_SIZES
    library = "DeepEP"
    kernels = "DeepEP's low-latency kernels"
    options: DeepEPLLOptions
    agreement_prefix = "deepep_"
    graph_safe = True

    @classmethod
    def check_runs(cls, world_size: int, config: Optional[MoEConfig] = None) -> None:
        require_deep_ep(cls.name, "Buffer")
        check_ll_world(cls.name, world_size)
        if config is not None:
            cls.check_shape(config.hidden_size, config.dtype, world_size)

    @classmethod
    def check_shape(cls, hidden_size: int, dtype: torch.dtype, world_size: int) -> None:
        check_ll_shape(cls.name, hidden_size, dtype, world_size)

    @classmethod
    def check_max_tokens(cls, max_tokens: int, world_size: int, *, option: str,
                         backend_option: str, env: Mapping[str, str]) -> None:
        """DeepEP's capacity must fit NVSHMEM's queue depth (`check_ll_depth`)."""
        check_ll_depth(option, max_tokens, world_size, backend_option=backend_option,
                       env=env)

    def __init__(self, config: MoEConfig, group: Optional[dist.ProcessGroup]) -> None:
        super().__init__(config, group)
        deep_ep = require_deep_ep(self.name, "Buffer")
        check_ll_shape(self.name, config.hidden_size, config.dtype, self.world_size)
        if config.max_tokens_per_rank is None:
            raise ValueError("backend 'deepep_ll' needs MoEConfig.max_tokens_per_rank (the "
                             "fixed capacity per rank): set it to the largest token count a "
                             "rank sends in one step")
        assert group is not None  # world size >= 2, checked above
        self.capacity = ll_capacity(config.max_tokens_per_rank, self.world_size)
        self.use_fp8 = self.options.fp8_dispatch
        self.topk_idx_dtype = getattr(deep_ep, "topk_idx_t", torch.int64)
        num_rdma_bytes = deep_ep.Buffer.get_low_latency_rdma_size_hint(
            self.capacity, config.hidden_size, self.world_size, config.num_experts)
        if num_rdma_bytes // 16 >= DEEPEP_MAX_INT4S:  # DeepEP asserts this in C++
            raise ValueError(
                f"backend 'deepep_ll': MoEConfig.max_tokens_per_rank="
                f"{config.max_tokens_per_rank} at hidden size {config.hidden_size} with "
                f"{config.num_experts} experts over {self.world_size} ranks needs a "
                f"{num_rdma_bytes / 2**30:.1f} GiB low-latency buffer, beyond DeepEP's "
                f"{DEEPEP_MAX_INT4S * 16 / 2**30:.0f} GiB: lower max_tokens_per_rank, or use "
                f"'deepep_ht' for prefill-sized steps")
        # DeepEP asserts the queue depth on every call; say it here, once, with the fix:
        # before a grown buffer is made where the group has one (it keeps the depth).
        self._check_queue_depth(ll_queue_depth(group))
        self.shared: SharedBuffer = shared_buffer(
            deep_ep, group, "ll", num_rdma_bytes=num_rdma_bytes,
            num_qps_per_rank=self.placement.num_local_experts)
        self._check_queue_depth(getattr(self.shared.buffer, "nvshmem_qp_depth", None))

    def _check_queue_depth(self, depth: Optional[int]) -> None:
        if depth is not None and depth < 2 * (self.capacity + 1):
            raise ValueError(f"backend 'deepep_ll': MoEConfig.max_tokens_per_rank="
                             f"{self.config.max_tokens_per_rank} needs an NVSHMEM queue depth "
                             f"of at least {2 * (self.capacity + 1)}, and DeepEP was given "
                             f"{depth}: lower max_tokens_per_rank, or set NVSHMEM_QP_DEPTH "
                             f"before the first DeepEP low-latency buffer is made")

    @property
    def rows_per_expert(self) -> int:
        """W * C: the rows of one local expert's block in DeepEP's receive buffer."""
        return self.world_size * self.capacity

    def prepare_async(self, x_TH: Tensor, topk_weights_TK: Tensor, topk_ids_TK: Tensor, *,
                      workspace: Workspace) -> Pending[Dispatched]:
        check_capacity(x_TH.shape[0], self.config.max_tokens_per_rank, self.name)
        ids_TK = topk_ids_TK.to(self.topk_idx_dtype).contiguous()
        weights_TK = topk_weights_TK.to(torch.float32).contiguous()
        split = dbo_enabled()  # outside a DBO step: one kernel, nothing to hand over
        recv, recv_count_E, deep_handle, _, hook = self.shared.buffer.low_latency_dispatch(
            x_TH.contiguous(), ids_TK, self.capacity, self.config.num_experts,
            use_fp8=self.use_fp8, async_finish=False, return_recv_hook=split)
        handle = LLHandle(deep_handle, ids_TK, weights_TK)
        rows = workspace.keep(f"deepep_ll/rows/{self.rows_per_expert}/{x_TH.device}",
                              lambda: LLRowConstants.make(self.placement.num_local_experts,
                                                          self.rows_per_expert, x_TH.device))

        def receiver() -> Dispatched:
            if self.use_fp8:
                x_fp8_ENH, scales_ENS = recv
                x_RH = dequantize_fp8(x_fp8_ENH, scales_ENS)
            else:
                x_RH = recv.view(-1, recv.shape[-1])  # the receive buffer itself, no copy
            return Dispatched(x_RH, ll_expert_ids(recv_count_E, rows), rows.ones_R1, handle)

        return Pending(self._receive_hook(hook) if split else None, receiver)

    def finalize_async(self, expert_out_RH: Tensor, dispatched: Dispatched, *,
                       workspace: Workspace, own: Optional[OwnRows] = None) -> Pending[Tensor]:
        self.refuse_split(own)
        handle: LLHandle = dispatched.handle
        out_ENH = expert_out_RH.contiguous().view(self.placement.num_local_experts,
                                                 self.rows_per_expert, -1)
        split = dbo_enabled()
        combined_TH, _, hook = self.shared.buffer.low_latency_combine(
            out_ENH, handle.topk_ids_TK, handle.topk_weights_TK, handle.deep_handle,
            async_finish=False, return_recv_hook=split)
        return Pending(self._receive_hook(hook) if split else None, lambda: combined_TH)

    def _receive_hook(self, hook: Callable[[], None]) -> Callable[[], None]:
        """DeepEP's receive `hook`, run once, counted off the operations in flight."""
        shared = self.shared
        shared.ll_started()
        ran = []

        def receive() -> None:
            assert not ran, "a DeepEP receive hook ran twice"
            ran.append(True)
            hook()
            shared.ll_received()

        return receive
