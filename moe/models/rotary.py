"""Rotary position embedding of the reference model's queries and keys.

Shape legend: T tokens, N heads, D head dim.

    apply_rotary(x_TND, cos_TD2, sin_TD2)
        out[t, n, j]       = x1 cos[t, j] - x2 sin[t, j]
        out[t, n, j + D/2] = x2 cos[t, j] + x1 sin[t, j]
        with x1 = x[t, n, j], x2 = x[t, n, j + D/2]    (the "rotate half" convention)

The math runs in fp32 and rounds once to x's dtype. On CUDA it is one Triton kernel that
reads x once and writes the output once, with the products and sums rounded in fp32 one
by one (no fused multiply-add), so it gives the torch version's bits. The torch version
(CPU, where autograd records through x, and the reference in tests) takes nine kernels
over an fp32 copy of x: for the deepseek-v3-like queries at 4096 tokens (128 heads of
128) that is about 3 GB of memory traffic per layer, against 0.27 GB for the kernel.

`KernelPolicy.implementation` picks the path (`moe.kernels.policy`).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from moe.kernels.policy import KernelPolicy, triton_module, use_triton


def apply_rotary(x_TND: Tensor, cos_TD2: Tensor, sin_TD2: Tensor, *,
                 policy: KernelPolicy = KernelPolicy()) -> Tensor:
    """Rotate channel pairs (j, j + D/2) of every head; a new contiguous [T, N, D] tensor
    in x's dtype.

    x_TND: [T, N, D] with D even (a view of a wider projection output is fine; the
    Triton kernel needs the last dim contiguous, else the torch version runs);
    cos_TD2, sin_TD2: float32 [T, D/2] (`moe.models.attention.rotary_cos_sin`).
    """
    if x_TND.dim() != 3 or x_TND.shape[-1] % 2:
        raise ValueError(f"apply_rotary: x must be [T, N, D] with D even, got "
                         f"{tuple(x_TND.shape)}")
    num_tokens, _, dim = x_TND.shape
    for name, t in (("cos", cos_TD2), ("sin", sin_TD2)):
        if tuple(t.shape) != (num_tokens, dim // 2) or t.dtype != torch.float32:
            raise ValueError(f"apply_rotary: {name} must be float32 [{num_tokens}, {dim // 2}], "
                             f"got {t.dtype} {tuple(t.shape)}")
    if (not use_triton(policy, x_TND) or x_TND.numel() == 0 or x_TND.stride(-1) != 1
            or (torch.is_grad_enabled() and x_TND.requires_grad)):
        # The kernel has no backward: where autograd records, the torch version (same
        # bits) keeps the gradient of the queries and keys.
        return _apply_rotary_torch(x_TND, cos_TD2, sin_TD2)
    out_TND = torch.empty(x_TND.shape, dtype=x_TND.dtype, device=x_TND.device)
    _triton().launch_rotary(x_TND, cos_TD2.contiguous(), sin_TD2.contiguous(), out_TND,
                            compiled=policy.compiled_launches)
    return out_TND


def _apply_rotary_torch(x_TND: Tensor, cos_TD2: Tensor, sin_TD2: Tensor) -> Tensor:
    x1, x2 = x_TND.float().chunk(2, dim=-1)
    cos, sin = cos_TD2[:, None, :], sin_TD2[:, None, :]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x_TND.dtype)


def _triton() -> Any:
    return triton_module("moe.models.rotary_triton")
