"""DeepEP's raw calls, the comm benchmark's yardstick (`deep_ep.Buffer`, DeepEP v1).

Shape legend: T tokens on this rank, H hidden, K top-k, E experts, W ranks, E_loc = E / W,
N = the low-latency buffer's tokens per rank.

- `deepep_raw_ht`, the normal (high-throughput, intranode NVLink) kernels: dispatch is
  `get_dispatch_layout` then `dispatch` (with top-k ids and weights; it waits on the host
  for the received count), combine is `combine` of the received rows (unweighted, as
  DeepEP's combine is). DeepEP's default `Config`s for W ranks and `Buffer.num_sms`; the
  buffer is sized with `Config.get_nvl_buffer_size_hint` of those configs, as DeepEP's
  README sizes it.
- `deepep_raw_ll`, the low-latency kernels: `low_latency_dispatch` in bf16 (our backends
  send bf16; DeepEP's own test dispatches FP8), then `low_latency_combine` of the received
  [E_loc, N * W, H] rows with the top-k weights; no receive hook (each call waits for its
  data). One buffer for the run, N = the largest point with T <= `LL_MAX_TOKENS`, sized
  with `get_low_latency_rdma_size_hint`; larger points are refused.

One `Buffer` per source, created at the first point and destroyed by `close()`, so the two
sources never hold buffers at once. `deep_ep` is imported on first use only. The
low-latency buffer is refused in a process where backend `symm_mem` has started NVSHMEM
(`moe.backends.nvshmem_owner`: DeepEP's kernels would abort it).
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from moe.backends import require_deep_ep

LL_MAX_TOKENS = 256
"""Most tokens per rank of `deepep_raw_ll`. Its `Buffer.low_latency_*` assert
NVSHMEM_QP_DEPTH (1024 by default) >= 2 (N + 1), i.e. N <= 511; DeepEP's test runs 128
and notes 512 as buggy; the buffer grows ~15 MB per token at E = 256, H = 7168."""


class _NormalEngine:
    def __init__(self, buffer: Any, num_experts: int, x_TH: Tensor, topk_weights_TK: Tensor,
                 topk_idx_TK: Tensor) -> None:
        self.buffer, self.num_experts = buffer, num_experts
        self.x_TH, self.topk_weights_TK, self.topk_idx_TK = x_TH, topk_weights_TK, topk_idx_TK

    def dispatch(self) -> Any:
        per_rank, per_rdma_rank, per_expert, in_rank, _ = self.buffer.get_dispatch_layout(
            self.topk_idx_TK, self.num_experts)
        recv_x_RH, _, _, _, handle, _ = self.buffer.dispatch(
            self.x_TH, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma_rank,
            is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
            topk_idx=self.topk_idx_TK, topk_weights=self.topk_weights_TK)
        return recv_x_RH, handle

    def combine(self, state: Any) -> Tensor:
        recv_x_RH, handle = state
        out_TH, _, _ = self.buffer.combine(recv_x_RH, handle)
        return out_TH

    def rows_delivered(self, state: Any) -> int:
        return int(state[0].shape[0])

    def graph_blocker(self) -> Optional[str]:
        return ("DeepEP's normal dispatch waits on the host for the received counts: it "
                "cannot be captured in a CUDA graph; time it without --cuda-graph")


class _LowLatencyEngine:
    def __init__(self, buffer: Any, num_experts: int, max_tokens: int, x_TH: Tensor,
                 topk_weights_TK: Tensor, topk_idx_TK: Tensor) -> None:
        self.buffer, self.num_experts, self.max_tokens = buffer, num_experts, max_tokens
        self.x_TH, self.topk_weights_TK, self.topk_idx_TK = x_TH, topk_weights_TK, topk_idx_TK

    def dispatch(self) -> Any:
        recv_x_ENH, _, handle, _, _ = self.buffer.low_latency_dispatch(
            self.x_TH, self.topk_idx_TK, self.max_tokens, self.num_experts, use_fp8=False)
        return recv_x_ENH, handle

    def combine(self, state: Any) -> Tensor:
        recv_x_ENH, handle = state
        out_TH, _, _ = self.buffer.low_latency_combine(recv_x_ENH, self.topk_idx_TK,
                                                       self.topk_weights_TK, handle)
        return out_TH

    def rows_delivered(self, state: Any) -> int:
        return int(state[0].shape[0] * state[0].shape[1])

    def graph_blocker(self) -> Optional[str]:
        return None  # no receive hook, no async finish: one kernel per call, on the stream


class DeepEPRawSource:
    """`deepep_raw_ht` or `deepep_raw_ll` (`moe.bench.comm_engines.Source`)."""

    def __init__(self, name: str, shapes: Any, group: Optional[dist.ProcessGroup], *,
                 tokens: tuple[int, ...]) -> None:
        if name not in ("deepep_raw_ht", "deepep_raw_ll"):
            raise ValueError(f"unknown DeepEP raw engine {name!r}")
        if group is None:
            raise ValueError(f"{name}: DeepEP needs a process group of at least 2 ranks")
        self.name, self.shapes, self.group = name, shapes, group
        self.low_latency = name == "deepep_raw_ll"
        self.max_tokens = max((t for t in tokens if t <= LL_MAX_TOKENS), default=0)
        self.deep_ep = require_deep_ep(name, "Buffer")
        self.buffer: Any = None

    def _check(self, x_TH: Tensor) -> None:
        if x_TH.device.type != "cuda":
            raise ValueError(f"{self.name}: DeepEP runs on CUDA GPUs only")
        if x_TH.dtype != torch.bfloat16:
            raise ValueError(f"{self.name}: DeepEP sends bf16 rows, not {x_TH.dtype}")
        if self.low_latency and x_TH.shape[0] > self.max_tokens:
            raise ValueError(f"{self.name}: {x_TH.shape[0]} tokens per rank exceed the "
                             f"low-latency buffer's {LL_MAX_TOKENS} (LL_MAX_TOKENS)")

    def _buffer(self) -> Any:
        if self.buffer is not None:
            return self.buffer
        if self.low_latency:
            from moe.backends import claim_nvshmem

            claim_nvshmem(self.name)  # refused after symm_mem, before anything is made
        Buffer, world = self.deep_ep.Buffer, dist.get_world_size(self.group)
        s = self.shapes
        if self.low_latency:
            num_rdma_bytes = Buffer.get_low_latency_rdma_size_hint(
                self.max_tokens, s.hidden, world, s.num_experts)
            self.buffer = Buffer(self.group, num_rdma_bytes=num_rdma_bytes,
                                 low_latency_mode=True,
                                 num_qps_per_rank=s.num_experts // world,
                                 explicitly_destroy=True)
        else:
            hidden_bytes = s.hidden * max(s.dtype.itemsize, 2)
            num_nvl_bytes = max(cfg.get_nvl_buffer_size_hint(hidden_bytes, world)
                                for cfg in (Buffer.get_dispatch_config(world),
                                            Buffer.get_combine_config(world)))
            self.buffer = Buffer(self.group, num_nvl_bytes, 0, explicitly_destroy=True)
        return self.buffer

    def bind(self, x_TH: Tensor, topk_weights_TK: Tensor, topk_ids_TK: Tensor) -> Any:
        self._check(x_TH)
        buffer = self._buffer()
        idx_TK = topk_ids_TK.to(getattr(self.deep_ep, "topk_idx_t", torch.int64)).contiguous()
        weights_TK = topk_weights_TK.float().contiguous()
        if self.low_latency:
            return _LowLatencyEngine(buffer, self.shapes.num_experts, self.max_tokens,
                                     x_TH.contiguous(), weights_TK, idx_TK)
        return _NormalEngine(buffer, self.shapes.num_experts, x_TH.contiguous(), weights_TK,
                             idx_TK)

    def close(self) -> None:
        if self.buffer is not None:
            torch.cuda.synchronize()
            dist.barrier(group=self.group)
            self.buffer.destroy()
            self.buffer = None
