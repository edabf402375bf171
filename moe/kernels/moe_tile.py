"""Pieces shared by the two fused-MoE GEMM kernels (`fused_moe`, `fused_moe_persistent`):
GEMM1's gate-and-up dot on TMA loads, the tile epilogue, the launch arguments that make a
GEMM GEMM1 or GEMM2 (`GemmRole`), and the scratch allocator for in-kernel tensor
descriptors.

Import only after TRITON_INTERPRET is settled; nothing is compiled at import.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl


@triton.jit
def gate_up_descriptor(b_ptr, num_experts, N, K, stride_bn,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """w13 [E, 2N, K] viewed [E * 2, N, K] for `gate_up_dot`'s boxes: box (2e, n0, k0) holds
    expert e's gate rows [n0, n0 + BLOCK_N) over it and its up rows under it (zeros past
    row N of either half)."""
    return tl.make_tensor_descriptor(
        b_ptr, shape=[num_experts * 2, N, K], strides=[N * stride_bn, stride_bn, 1],
        block_shape=[2, BLOCK_N, BLOCK_K])


@triton.jit
def gate_up_dot(b_desc, a, acc_pair, expert, n0, k0,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    """acc_pair [BM, 2 * BLOCK_N] += a [BM, BLOCK_K] @ (gate | up columns [n0, n0 + BLOCK_N)
    of expert `expert` (int32), depth [k0, k0 + BLOCK_K)): one box, one dot twice as wide."""
    b = b_desc.load([2 * expert, n0, k0]).reshape(2 * BLOCK_N, BLOCK_K).T
    return tl.dot(a, b, acc_pair, input_precision=INPUT_PRECISION)


@triton.jit
def split_gate_up(acc_pair, BM: tl.constexpr, BLOCK_N: tl.constexpr):
    """(gate, up) [BM, BLOCK_N] each from `gate_up_dot`'s accumulator: columns [0, BLOCK_N)
    are the gate's, [BLOCK_N, 2 * BLOCK_N) the up's."""
    return tl.split(tl.permute(tl.reshape(acc_pair, (BM, 2, BLOCK_N)), (0, 2, 1)))


@triton.jit
def store_tile(
    acc,  # fp32 [BM, BLOCK_N]: the GEMM (GATED: the gate half)
    acc_up,  # fp32 [BM, BLOCK_N]: the up half (GATED only)
    c_ptr,
    topk_weights_ptr,
    offs_m,  # int [BM]: the tile's sorted rows
    row_ids,  # int32 [BM]: their flat routed ids, num_routed for padding
    pid_n,
    N,
    num_routed,
    weights_top_k,
    stride_cm,
    stride_cn,
    stride_wn,
    C_SORTED: tl.constexpr,
    GATED: tl.constexpr,
    MUL_ROUTED_WEIGHT: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Epilogue of one tile: silu(gate) * up (GATED), times the routing weight
    (MUL_ROUTED_WEIGHT), rounded to C's dtype and stored at the sorted row (C_SORTED,
    padding rows too) or at the routed id (used rows only)."""
    row_mask = row_ids < num_routed
    if GATED:
        acc = acc * tl.sigmoid(acc) * acc_up
    if MUL_ROUTED_WEIGHT:
        weight_offs = (row_ids // weights_top_k).to(tl.int64) * stride_wn + row_ids % weights_top_k
        weight = tl.load(topk_weights_ptr + weight_offs, mask=row_mask, other=0.0)
        acc = acc * weight[:, None]
    offs_cn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if C_SORTED:
        c_ptrs = c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm + offs_cn[None, :] * stride_cn
        c_mask = (offs_m[:, None] >= 0) & (offs_cn[None, :] < N)
    else:
        c_ptrs = c_ptr + row_ids.to(tl.int64)[:, None] * stride_cm + offs_cn[None, :] * stride_cn
        c_mask = row_mask[:, None] & (offs_cn[None, :] < N)
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)


@dataclass(frozen=True)
class GemmRole:
    """What makes a launch GEMM1 or GEMM2 of the pair, in both kernels' terms."""

    weights: torch.Tensor
    """The routing weights' pointer argument (C when unused, for GEMM1)."""
    weights_top_k: int
    stride_wn: int
    flags: dict[str, Any]
    """A_ROWS_DIV, A_SORTED, C_SORTED, GATED, MUL_ROUTED_WEIGHT, INPUT_PRECISION."""


def gemm_role(a: torch.Tensor, c: torch.Tensor, weights_NK: torch.Tensor | None, *,
              a_rows_div: int, a_sorted: bool) -> GemmRole:
    """GEMM1 when `weights_NK` is None (gated, writes the sorted activation), else GEMM2
    (weighted by float32 [N, K] routing weights, made unit-stride in their last dim if
    needed; writes rows by routed id). `a_sorted`: A is in the sorted row order."""
    final = weights_NK is not None
    if final and weights_NK.stride(1) != 1:
        weights_NK = weights_NK.contiguous()
    # Follow torch's matmul: exact fp32 unless the user allowed TF32 (16-bit: unused).
    ieee = a.dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32
    flags = {"A_ROWS_DIV": a_rows_div, "A_SORTED": a_sorted, "C_SORTED": not final,
             "GATED": not final, "MUL_ROUTED_WEIGHT": final,
             "INPUT_PRECISION": "ieee" if ieee else "tf32"}
    if not final:
        return GemmRole(c, 1, 1, flags)
    return GemmRole(weights_NK, weights_NK.shape[1], weights_NK.stride(0), flags)


def tma_scratch(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    """Global scratch for in-kernel tensor descriptors, from torch's caching allocator
    (stream-ordered on the current stream, where the kernel runs)."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def use_tma_scratch() -> None:
    """Install `tma_scratch` for this thread / greenlet (Triton keeps the allocator in a
    context variable: every DBO ubatch has its own)."""
    triton.set_allocator(tma_scratch)
