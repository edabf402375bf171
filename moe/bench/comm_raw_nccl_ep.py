"""NCCL EP's raw calls, the comm benchmark's yardstick for backend `nccl_ep` (`nccl.ep`).

Shape legend: T tokens on this rank, H hidden, K top-k, E experts, W ranks, E_loc = E / W,
C = the point's tokens per rank (each point gets an EP group of its own, sized for T, as
the backend is built per point with capacity T).

- `nccl_ep_raw_ll`, the low-latency kernels: dispatch is `Handle.update` with the top-k
  ids then `Handle.dispatch` into [E_loc, W*C, H] expert-major rows (with the per-expert
  counts), combine is `Handle.combine` of those rows with the top-k weights, each call
  one launch (no send-only half).
- `nccl_ep_raw_ht`, the high-throughput kernels: `update` (its metadata exchange) then
  `dispatch` into W*C flat rows with their ids and weights; combine adds the rows back
  without weights.

What the backend adds on top is its own: the descriptors of each call's tensors (made
once per point here), the ids it masks, DBO's hand-over. `nccl.ep` is imported on first
use only.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor

RAW_NAMES = ("nccl_ep_raw_ll", "nccl_ep_raw_ht")


class _Engine:
    """One point's handle, buffers and descriptors, made once; calls on the current stream."""

    def __init__(self, ep: Any, handle: Any, low_latency: bool, x_TH: Tensor,
                 topk_weights_TK: Tensor, topk_ids_TK: Tensor, *, world: int,
                 num_local: int, capacity: int) -> None:
        self.ep, self.handle, self.low_latency = ep, handle, low_latency
        device, hidden, top_k = x_TH.device, x_TH.shape[1], topk_ids_TK.shape[1]
        self.tensors = [x_TH, topk_weights_TK, topk_ids_TK]
        self.out_TH = torch.empty_like(x_TH)
        if low_latency:
            self.recv = torch.empty(num_local, world * capacity, hidden, dtype=x_TH.dtype,
                                    device=device)
            count_E = torch.empty(num_local, dtype=torch.int32, device=device)
            self.tensors += [count_E]
        else:
            self.recv = torch.empty(world * capacity, hidden, dtype=x_TH.dtype, device=device)
            recv_w = torch.empty(world * capacity, top_k, dtype=torch.float32, device=device)
            recv_ids = torch.empty(world * capacity, top_k, dtype=torch.int64, device=device)
            total_1 = torch.empty(1, dtype=torch.int32, device=device)
            self.tensors += [recv_w, recv_ids, total_1]
        self.tensors += [self.recv, self.out_TH]
        d = self.d = {id(t): ep.Tensor(t) for t in self.tensors}  # kept with the engine
        x, w, ids = (d[id(t)] for t in (x_TH, topk_weights_TK, topk_ids_TK))
        self.ids = ids
        recv, out = d[id(self.recv)], d[id(self.out_TH)]
        if low_latency:
            self.layout = None
            self.dispatch_args = (ep.DispatchInputs(tokens=x), ep.DispatchOutputs(tokens=recv),
                                  ep.LayoutInfo(expert_counters=d[id(count_E)]))
            self.combine_args = (ep.CombineInputs(tokens=recv),
                                 ep.CombineOutputs(tokens=out, topk_weights=w))
        else:
            self.layout = ep.LayoutInfo(recv_total_counter=d[id(total_1)])
            self.dispatch_args = (ep.DispatchInputs(tokens=x, topk_weights=w),
                                  ep.DispatchOutputs(tokens=recv, topk_weights=d[id(recv_w)],
                                                     topk_idx=d[id(recv_ids)]), None)
            self.combine_args = (ep.CombineInputs(tokens=recv), ep.CombineOutputs(tokens=out))

    def dispatch(self) -> Tensor:
        stream = torch.cuda.current_stream().cuda_stream
        self.handle.update(self.ids, layout_info=self.layout, stream=stream)
        inputs, outputs, layout = self.dispatch_args
        self.handle.dispatch(inputs, outputs, layout_info=layout, stream=stream)
        return self.recv

    def combine(self, state: Any) -> Tensor:
        inputs, outputs = self.combine_args
        self.handle.combine(inputs, outputs, stream=torch.cuda.current_stream().cuda_stream)
        return self.out_TH

    def rows_delivered(self, state: Any) -> int:
        return int(self.recv.numel() // self.recv.shape[-1])

    def graph_blocker(self) -> Optional[str]:
        return None  # fixed sizes, nothing read on the host


class NCCLEPRawSource:
    """`nccl_ep_raw_ll` or `nccl_ep_raw_ht` (`moe.bench.comm_engines.Source`)."""

    def __init__(self, name: str, shapes: Any, group: Optional[dist.ProcessGroup], *,
                 tokens: tuple[int, ...]) -> None:
        from moe.backends import check_nccl_ep_rows, require_nccl_ep

        if name not in RAW_NAMES:
            raise ValueError(f"unknown NCCL EP raw engine {name!r}: choose from {RAW_NAMES}")
        if group is None:
            raise ValueError(f"{name}: NCCL EP needs a process group on NCCL")
        self.name, self.shapes, self.group = name, shapes, group
        self.low_latency = name == "nccl_ep_raw_ll"
        self.ep = require_nccl_ep()
        check_nccl_ep_rows(shapes.hidden, shapes.dtype, "ll" if self.low_latency else "ht")
        self.made: list[Any] = []  # (handle, group) of earlier points, destroyed at close

    def bind(self, x_TH: Tensor, topk_weights_TK: Tensor, topk_ids_TK: Tensor) -> Any:
        import nccl.core

        from moe.backends import nccl_comm_ptr

        ep, s = self.ep, self.shapes
        world = dist.get_world_size(self.group)
        capacity = max(1, x_TH.shape[0])
        comm = nccl.core.Communicator(nccl_comm_ptr(self.group))
        config = ep.GroupConfig(
            algorithm=ep.Algorithm.LOW_LATENCY if self.low_latency else ep.Algorithm.HIGH_THROUGHPUT,
            num_experts=s.num_experts, max_dispatch_tokens_per_rank=capacity,
            max_recv_tokens_per_rank=0 if self.low_latency else world * capacity,
            max_token_bytes=s.hidden * s.dtype.itemsize)
        ep_group = ep.Group.create(comm, config)
        ids_TK = topk_ids_TK.to(torch.int64).contiguous()
        from nccl._extensions.bindings import nccl_ep as bindings
        layout = ep.Layout.EXPERT_MAJOR if self.low_latency else ep.Layout.FLAT
        handle = ep.Handle(bindings.init_handle(ep_group.ptr, int(layout), 0, ids_TK.shape[1], 0))
        self.made.append((handle, ep_group, comm))
        return _Engine(ep, handle, self.low_latency, x_TH.contiguous(),
                       topk_weights_TK.float().contiguous(), ids_TK, world=world,
                       num_local=s.num_experts // world, capacity=capacity)

    def close(self) -> None:
        if self.made:
            torch.cuda.synchronize()
            dist.barrier(group=self.group)
        for handle, ep_group, _ in self.made:
            handle.destroy()
            ep_group.destroy()
        self.made = []
