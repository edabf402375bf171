"""DeepEP v2's raw calls (`deep_ep.ElasticBuffer`), the comm benchmark's yardstick for
backend `deepep_v2`.

Shape legend: T tokens on this rank, H hidden, K top-k, E experts, W ranks, C = the run's
largest point (the buffer's `num_max_tokens_per_rank`).

- `deepep_v2_raw_prefill`: `dispatch(..., do_cpu_sync=True, do_expand=True)` (the host
  waits for the counts; exactly the rows received, one per (token, local expert)), then
  `combine` of those rows;
- `deepep_v2_raw_decode`: `dispatch(..., do_cpu_sync=False, do_expand=False)` (rows
  sized for the worst case, W * C, nothing read on the host), then `combine`.
Both synchronous (no events, no comm-stream allocation): DeepEP's own calls as its tests
make them, against which the backend's stream handling and masks are measured. One
buffer per source, made at its first point on the group's started NCCL communicator;
`deep_ep` is imported on first use only. DeepEP v2 needs peers (on one rank its dispatch
crashes), NCCL >= 2.30.4 and bfloat16 rows.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor

RAW_NAMES = ("deepep_v2_raw_prefill", "deepep_v2_raw_decode")


class _Engine:
    def __init__(self, buffer: Any, prefill: bool, num_experts: int, x_TH: Tensor,
                 topk_weights_TK: Tensor, topk_ids_TK: Tensor) -> None:
        self.buffer, self.prefill, self.num_experts = buffer, prefill, num_experts
        self.x_TH, self.topk_weights_TK, self.topk_ids_TK = x_TH, topk_weights_TK, topk_ids_TK

    def dispatch(self) -> Any:
        recv_x, _, _, handle, _ = self.buffer.dispatch(
            self.x_TH, topk_idx=self.topk_ids_TK, topk_weights=self.topk_weights_TK,
            num_experts=self.num_experts, do_cpu_sync=self.prefill, do_expand=self.prefill)
        return recv_x, handle

    def combine(self, state: Any) -> Tensor:
        recv_x, handle = state
        out_TH, _, _ = self.buffer.combine(recv_x, handle)
        return out_TH

    def rows_delivered(self, state: Any) -> int:
        return int(state[0].shape[0])

    def graph_blocker(self) -> Optional[str]:
        if not self.prefill:
            return None
        return ("deepep_v2_raw_prefill waits on the host for the received counts: it cannot "
                "be captured in a CUDA graph; time deepep_v2_raw_decode, or drop --cuda-graph")


class DeepEPV2RawSource:
    """`deepep_v2_raw_prefill` or `deepep_v2_raw_decode` (`moe.bench.comm_engines.Source`).

    `buffer_cls`: the buffer class, built as `cls(group, num_max_tokens_per_rank=C,
    hidden=H, num_topk=K, use_fp8_dispatch=False)`; None: `deep_ep.ElasticBuffer`, where
    this process has what DeepEP v2 needs (raises saying what is missing otherwise)."""

    def __init__(self, name: str, shapes: Any, group: Optional[dist.ProcessGroup], *,
                 tokens: tuple[int, ...],
                 buffer_cls: Optional[Callable[..., Any]] = None) -> None:
        if name not in RAW_NAMES:
            raise ValueError(f"unknown DeepEP v2 raw engine {name!r}: choose from {RAW_NAMES}")
        if group is None or dist.get_world_size(group) < 2:
            raise ValueError(f"{name}: DeepEP v2 needs a process group of at least 2 ranks")
        if buffer_cls is None:
            from moe.backends import require_elastic_buffer
            buffer_cls = require_elastic_buffer().ElasticBuffer
        self.name, self.shapes, self.group = name, shapes, group
        self.prefill = name == "deepep_v2_raw_prefill"
        self.capacity = max(tokens)
        self.buffer_cls = buffer_cls
        self.buffer: Any = None

    def bind(self, x_TH: Tensor, topk_weights_TK: Tensor, topk_ids_TK: Tensor) -> Any:
        if self.buffer is None:
            from moe.backends import start_nccl_comm
            start_nccl_comm(self.group)
            s = self.shapes
            self.buffer = self.buffer_cls(self.group, num_max_tokens_per_rank=self.capacity,
                                          hidden=s.hidden, num_topk=s.top_k,
                                          use_fp8_dispatch=False)
        return _Engine(self.buffer, self.prefill, self.shapes.num_experts, x_TH.contiguous(),
                       topk_weights_TK.to(torch.float32).contiguous(),
                       topk_ids_TK.to(torch.int64).contiguous())

    def close(self) -> None:
        if self.buffer is not None and torch.cuda.is_available():
            torch.cuda.synchronize()
        self.buffer = None
