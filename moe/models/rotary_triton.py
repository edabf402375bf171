"""The Triton kernel of `moe.models.rotary` (see there), and its launcher.

Import this module only after TRITON_INTERPRET is settled: Triton reads it when the
kernel is defined. Nothing is compiled or launched at import.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe.kernels.launch import FastLauncher, cdiv, next_power_of_2

_BLOCK_ELEMS = 4096  # heads x channel pairs per program, at most


@triton.jit
def rotary_kernel(
    x_ptr,  # [T, N, D], last dim contiguous (a view into a wider row is fine)
    cos_ptr,  # float32 [T, D/2], contiguous
    sin_ptr,  # float32 [T, D/2], contiguous
    out_ptr,  # [T, N, D], contiguous, x's dtype
    num_heads,  # N
    stride_xt,
    stride_xn,
    HALF: tl.constexpr,  # D / 2
    HALF_P2: tl.constexpr,  # next power of two of HALF
    BLOCK_N: tl.constexpr,  # heads per program
):
    """One token's BLOCK_N heads: out = (x1 cos - x2 sin, x2 cos + x1 sin) in fp32, one
    rounding to x's dtype. Each product and sum rounds in fp32 as the torch ops do; the
    launcher turns off FMA contraction so that it stays so."""
    t = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_j = tl.arange(0, HALF_P2)
    j_mask = offs_j < HALF
    mask = (offs_n < num_heads)[:, None] & j_mask[None, :]
    cos = tl.load(cos_ptr + t * HALF + offs_j, mask=j_mask, other=0.0)[None, :]
    sin = tl.load(sin_ptr + t * HALF + offs_j, mask=j_mask, other=0.0)[None, :]
    x1_ptrs = x_ptr + t * stride_xt + offs_n[:, None] * stride_xn + offs_j[None, :]
    x1 = tl.load(x1_ptrs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x1_ptrs + HALF, mask=mask, other=0.0).to(tl.float32)
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    o1_ptrs = out_ptr + t * num_heads * 2 * HALF + offs_n[:, None] * 2 * HALF + offs_j[None, :]
    tl.store(o1_ptrs, o1.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(o1_ptrs + HALF, o2.to(out_ptr.dtype.element_ty), mask=mask)


_ROTARY = FastLauncher(rotary_kernel)


def launch_rotary(x_TND: torch.Tensor, cos_TD2: torch.Tensor, sin_TD2: torch.Tensor,
                  out_TND: torch.Tensor, *, compiled: bool = True) -> None:
    """`rotary_kernel` into out_TND (contiguous), on the current stream (`compiled`:
    through the compiled handle, `moe.kernels.launch`)."""
    num_tokens, num_heads, dim = x_TND.shape
    half = dim // 2
    half_p2 = next_power_of_2(half)
    block_n = min(next_power_of_2(num_heads), max(1, _BLOCK_ELEMS // half_p2))
    grid = (num_tokens, cdiv(num_heads, block_n))
    _ROTARY(grid, x_TND, cos_TD2, sin_TD2, out_TND, num_heads, x_TND.stride(0),
            x_TND.stride(1), HALF=half, HALF_P2=half_p2, BLOCK_N=block_n,
            enable_fp_fusion=False, compiled=compiled)
