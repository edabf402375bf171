"""The pieces both fused-MoE GEMM kernels share, in Triton: GEMM1's gate-and-up dot on TMA
loads, and the tile epilogue (the expert form's bias and activation, the routing weight,
the store).

The epilogue's constexpr flags come from the expert form (`moe.kernels.fused_moe.form`):

    GEMM1: h = acc (+ b13[e]);  gated: act(clamp(gate)) * clamp(up), or GPT-OSS's
           gate * sigmoid(alpha * gate) * (up + 1);  without a gate: act(h)
    GEMM2: y = acc (+ b2[e]);   times the routing weight (MUL_ROUTED_WEIGHT)

dbo's default expert (GATED, ACTIVATION "silu", no INTERLEAVED / HAS_BIAS / LIMIT) takes
none of the variants' branches: they are all constexpr, so its kernels compile to the
code they compiled to before the variants existed.

Import only after TRITON_INTERPRET is settled; nothing is compiled or launched at import.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def gate_up_descriptor(b_ptr, num_experts, N, K, stride_bn,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       INTERLEAVED: tl.constexpr):
    """w13 [E, 2N, K] viewed for `gate_up_dot`'s boxes. Gate rows then up rows: viewed
    [E * 2, N, K], box (2e, n0, k0) holds expert e's gate rows [n0, n0 + BLOCK_N) over
    it and its up rows under it (zeros past row N of either half). INTERLEAVED (rows gate,
    up, gate, up, ...): viewed [E * N, 2, K], box (eN + n0, 0, k0) holds the gate and up
    row of each column side by side (past an expert's last row the next expert's rows:
    the store mask drops those columns)."""
    # One return: Triton checks every return of a function against the others.
    if INTERLEAVED:
        desc = tl.make_tensor_descriptor(
            b_ptr, shape=[num_experts * N, 2, K], strides=[2 * stride_bn, stride_bn, 1],
            block_shape=[BLOCK_N, 2, BLOCK_K])
    else:
        desc = tl.make_tensor_descriptor(
            b_ptr, shape=[num_experts * 2, N, K], strides=[N * stride_bn, stride_bn, 1],
            block_shape=[2, BLOCK_N, BLOCK_K])
    return desc


@triton.jit
def gate_up_dot(b_desc, a, acc_pair, expert, n0, k0,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INPUT_PRECISION: tl.constexpr,
                N, INTERLEAVED: tl.constexpr):
    """acc_pair [BM, 2 * BLOCK_N] += a [BM, BLOCK_K] @ (gate | up columns [n0, n0 + BLOCK_N)
    of expert `expert` (int32), depth [k0, k0 + BLOCK_K)): one box, one dot twice as wide
    (INTERLEAVED: the columns alternate gate, up; `N` the expert's width)."""
    if INTERLEAVED:
        b = b_desc.load([expert * N + n0, 0, k0]).reshape(2 * BLOCK_N, BLOCK_K).T
    else:
        b = b_desc.load([2 * expert, n0, k0]).reshape(2 * BLOCK_N, BLOCK_K).T
    return tl.dot(a, b, acc_pair, input_precision=INPUT_PRECISION)


@triton.jit
def split_gate_up(acc_pair, BM: tl.constexpr, BLOCK_N: tl.constexpr,
                  INTERLEAVED: tl.constexpr):
    """(gate, up) [BM, BLOCK_N] each from `gate_up_dot`'s accumulator: columns [0, BLOCK_N)
    are the gate's, [BLOCK_N, 2 * BLOCK_N) the up's (INTERLEAVED: even and odd columns)."""
    if INTERLEAVED:
        pair = tl.reshape(acc_pair, (BM, BLOCK_N, 2))
    else:
        pair = tl.permute(tl.reshape(acc_pair, (BM, 2, BLOCK_N)), (0, 2, 1))
    return tl.split(pair)


@triton.jit
def activation(gate, up, GATED: tl.constexpr, ACTIVATION: tl.constexpr, LIMIT: tl.constexpr,
               ALPHA: tl.constexpr):
    """The expert's activation in fp32 (`moe.experts.form.form_activation`): LIMIT > 0 clamps
    the gate to <= LIMIT and up to [-LIMIT, LIMIT] first; "swiglu_oai" is
    gate * sigmoid(ALPHA * gate) * (up + 1); any other names act(gate), times up when
    GATED (`up` unused otherwise)."""
    if LIMIT > 0:
        gate = tl.minimum(gate, LIMIT)
        up = tl.minimum(tl.maximum(up, -LIMIT), LIMIT)
    if ACTIVATION == "swiglu_oai":
        out = gate * tl.sigmoid(gate * ALPHA) * (up + 1.0)
    else:
        if ACTIVATION == "silu":
            out = gate * tl.sigmoid(gate)
        elif ACTIVATION == "gelu":
            out = 0.5 * gate * (1.0 + tl.erf(gate * 0.7071067811865476))  # x / sqrt(2)
        elif ACTIVATION == "gelu_tanh":
            # 0.5 x (1 + tanh(u)) == x sigmoid(2u), u = sqrt(2 / pi) (x + 0.044715 x^3)
            inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
            out = gate * tl.sigmoid(2.0 * inner)
        elif ACTIVATION == "relu":
            out = tl.maximum(gate, 0.0)
        elif ACTIVATION == "relu2":
            out = tl.maximum(gate, 0.0)
            out = out * out
        else:
            tl.static_assert(ACTIVATION == "sigmoid")
            out = tl.sigmoid(gate)
        if GATED:
            out = out * up
    return out


@triton.jit
def store_tile(
    acc,  # fp32 [BM, BLOCK_N]: the GEMM (GATED: the gate half)
    acc_up,  # fp32 [BM, BLOCK_N]: the up half (GATED only)
    c_ptr,
    topk_weights_ptr,
    bias_ptr,  # HAS_BIAS: [E, 2N] (GATED) or [E, N], contiguous, any float dtype
    expert,  # the tile's expert (HAS_BIAS only)
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
    INTERLEAVED: tl.constexpr,  # GATED: the bias alternates gate, up
    ACTIVATION: tl.constexpr,  # "none" (GEMM2) or a name `activation` computes
    HAS_BIAS: tl.constexpr,
    LIMIT: tl.constexpr,
    ALPHA: tl.constexpr,
):
    """Epilogue of one tile: the bias (HAS_BIAS), the activation (ACTIVATION, GATED: of the
    gate and up halves), times the routing weight (MUL_ROUTED_WEIGHT), rounded to C's
    dtype and stored at the sorted row (C_SORTED, padding rows too) or at the routed id
    (used rows only)."""
    row_mask = row_ids < num_routed
    if HAS_BIAS:
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_mask = cols < N
        if GATED:
            bias_row = bias_ptr + expert.to(tl.int64) * (2 * N)
            if INTERLEAVED:
                gate_bias = tl.load(bias_row + 2 * cols, mask=col_mask, other=0.0)
                up_bias = tl.load(bias_row + 2 * cols + 1, mask=col_mask, other=0.0)
            else:
                gate_bias = tl.load(bias_row + cols, mask=col_mask, other=0.0)
                up_bias = tl.load(bias_row + N + cols, mask=col_mask, other=0.0)
            acc = acc + gate_bias.to(tl.float32)[None, :]
            acc_up = acc_up + up_bias.to(tl.float32)[None, :]
        else:
            bias = tl.load(bias_ptr + expert.to(tl.int64) * N + cols, mask=col_mask, other=0.0)
            acc = acc + bias.to(tl.float32)[None, :]
    if ACTIVATION != "none":
        acc = activation(acc, acc_up, GATED, ACTIVATION, LIMIT, ALPHA)
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
