"""The Triton kernel of `moe.router.route` (the built-in routing, steps 1-6 of the maths
there, scaling included), and its launcher.

One program routes BLOCK_T tokens (one on the GPU, see `_BLOCK_T`). Their logits are
read as a [BLOCK_T, G_POW2, X_POW2] tile: expert e = g * X + x sits at (g, x), so a group
is the last axis and its score is a reduction over it (plain top-k is the same tile with
G = 1). Padding experts (x >= X or g >= G) hold -inf choices and zero scores. Top-k is
K rounds of "take the best choice, then set it to -inf"; the group pick is the same over
group scores.

Ties: among equal choices the lower expert id is taken first, and among equal group
scores the lower group (torch.topk promises no order there). NaN choices (a NaN or
infinite logit) count as +inf, so every id is still a distinct expert in [0, E); their
weights are NaN.

On CUDA, exp is libdevice's expf and the divisions round to nearest, the same maths as
torch's sigmoid and softmax kernels: sigmoid scores are bit-identical to torch's, softmax
scores differ only by the order of the denominator's sum, so both paths pick the same
experts (up to the order of exact ties) and the weights agree to a few ulp (sums).
Triton's default `tl.exp` and `/` are approximate (ex2.approx, div.full) and would let
near-ties flip. The interpreter has no libdevice and uses numpy's exp.

Legend: T tokens, E experts, G groups of X = E / G experts, K top-k.
Import this module only after TRITON_INTERPRET is settled: Triton reads it when the
kernel is defined. Nothing is compiled or launched at import.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from moe.kernels.launch import FastLauncher, cdiv, next_power_of_2

# One token per one-warp program keeps every reduction inside a warp. H200, DeepSeek-V3
# routing of 4096 tokens: 9.7 us, against 29 us for 16 tokens on 4 warps (Qwen3's: 5.6
# and 7.6 us). Above 1024 experts more warps bound the registers per thread.
_BLOCK_T = 1
_EXPERTS_PER_WARP = 1024
# The interpreter runs the programs one after another: fewer, larger ones keep tests fast.
_INTERPRETED_BLOCK_T = 16
_NEG_INF = tl.constexpr(float("-inf"))


@triton.jit
def _exp(x, PRECISE: tl.constexpr):
    if PRECISE:
        return libdevice.exp(x)
    else:
        return tl.exp(x)


@triton.jit
def route_kernel(
    # Pointers
    logits_ptr,  # [T, E], any float dtype, strides (stride_t, stride_e)
    bias_ptr,  # [E], contiguous: correction bias (read only with USE_BIAS)
    weights_ptr,  # float32 [T, K], contiguous (out)
    ids_ptr,  # int64 [T, K], contiguous (out)
    # Sizes
    num_tokens,  # T
    stride_t,
    stride_e,
    scaling_factor,  # routed_scaling_factor, applied last
    # Routing
    SOFTMAX: tl.constexpr,  # scores: softmax over E (True) or sigmoid per expert
    USE_BIAS: tl.constexpr,  # choice = score + bias; groups scored by their top-2 sum
    NUM_GROUPS: tl.constexpr,  # G (1: plain top-k)
    GROUP_SIZE: tl.constexpr,  # X = E / G
    TOPK_GROUP: tl.constexpr,  # groups kept per token (< G when G > 1)
    TOP_K: tl.constexpr,  # K
    RENORMALIZE: tl.constexpr,
    PRECISE: tl.constexpr,  # libdevice exp (CUDA); False under the interpreter
    # Tiling
    BLOCK_T: tl.constexpr,
    G_POW2: tl.constexpr,
    X_POW2: tl.constexpr,
    K_POW2: tl.constexpr,
):
    """weights[t], ids[t] = the K best experts of token t by choice, best first."""
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = offs_t < num_tokens
    token = offs_t.to(tl.int64)
    offs_g = tl.arange(0, G_POW2)
    g3 = offs_g[None, :, None]
    x3 = tl.arange(0, X_POW2)[None, None, :]
    expert3 = g3 * GROUP_SIZE + x3  # [1, G_POW2, X_POW2]; >= E only on padding
    is_expert3 = (g3 < NUM_GROUPS) & (x3 < GROUP_SIZE)

    # Tokens past T read zeros, not -inf: their (never stored) rows stay NaN-free.
    logits = tl.load(logits_ptr + token[:, None, None] * stride_t + expert3 * stride_e,
                     mask=t_mask[:, None, None] & is_expert3, other=0.0).to(tl.float32)
    if SOFTMAX:
        logits = tl.where(is_expert3, logits, _NEG_INF)
        row_max = tl.max(tl.max(logits, axis=2), axis=1)
        num = _exp(logits - row_max[:, None, None], PRECISE)  # 0 on padding
        den = tl.sum(tl.sum(num, axis=2), axis=1)
        scores = tl.math.div_rn(num, den[:, None, None])
    else:
        scores = tl.math.div_rn(tl.full(logits.shape, 1.0, tl.float32),
                                1.0 + _exp(-logits, PRECISE))
    choice = scores
    if USE_BIAS:
        bias = tl.load(bias_ptr + expert3, mask=is_expert3, other=0.0)
        choice = scores + bias.to(tl.float32)
    # torch.topk ranks NaN above everything; as +inf it also matches the max below,
    # which keeps every picked id a real expert.
    choice = tl.where(choice != choice, float("inf"), choice)
    choice = tl.where(is_expert3, choice, _NEG_INF)

    if TOPK_GROUP < NUM_GROUPS:
        first = tl.max(choice, axis=2)  # [BLOCK_T, G_POW2]
        if USE_BIAS:
            # The top-2 sum: drop one copy of the best (the lowest x among equals).
            first_x = tl.min(tl.where(choice == first[:, :, None], x3, X_POW2), axis=2)
            second = tl.max(tl.where(x3 == first_x[:, :, None], _NEG_INF, choice), axis=2)
            group_score = first + second
        else:
            group_score = first
        group_score = tl.where(offs_g[None, :] < NUM_GROUPS, group_score, _NEG_INF)
        keep = tl.zeros((BLOCK_T, G_POW2), dtype=tl.int1)
        for _ in tl.static_range(TOPK_GROUP):
            best = tl.max(group_score, axis=1)
            pick = tl.min(tl.where(group_score == best[:, None], offs_g[None, :], G_POW2),
                          axis=1)
            picked = offs_g[None, :] == pick[:, None]
            keep = keep | picked
            group_score = tl.where(picked, _NEG_INF, group_score)
        choice = tl.where(keep[:, :, None], choice, _NEG_INF)

    # K rounds of argmax. The routing (checked by MoEConfig) keeps >= K experts, all with
    # choice > -inf, so each round's max is a real expert not taken before.
    offs_k = tl.arange(0, K_POW2)
    weights = tl.zeros((BLOCK_T, K_POW2), dtype=tl.float32)
    ids = tl.zeros((BLOCK_T, K_POW2), dtype=tl.int32)
    total = tl.zeros((BLOCK_T,), dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        best = tl.max(tl.max(choice, axis=2), axis=1)
        is_best = choice == best[:, None, None]
        pick = tl.min(tl.min(tl.where(is_best, expert3, G_POW2 * X_POW2), axis=2), axis=1)
        picked = expert3 == pick[:, None, None]
        # One term is non-zero: this is the gather scores[t, pick], exactly.
        weight = tl.sum(tl.sum(tl.where(picked, scores, 0.0), axis=2), axis=1)
        choice = tl.where(picked, _NEG_INF, choice)
        weights = tl.where(offs_k[None, :] == k, weight[:, None], weights)
        ids = tl.where(offs_k[None, :] == k, pick[:, None], ids)
        total = total + weight

    if RENORMALIZE:
        # Scores are positive; the floor only guards an all-underflow row against 0/0.
        total = tl.maximum(total, 1.1754943508222875e-38)  # float32 tiny
        weights = tl.math.div_rn(weights, total[:, None])
    weights = weights * scaling_factor
    out = token[:, None] * TOP_K + offs_k[None, :]
    out_mask = t_mask[:, None] & (offs_k[None, :] < TOP_K)
    tl.store(weights_ptr + out, weights, mask=out_mask)
    tl.store(ids_ptr + out, ids.to(tl.int64), mask=out_mask)


# False under TRITON_INTERPRET=1: kernels are then InterpretedFunctions, which cannot call
# libdevice and run their programs one after another.
_COMPILED = isinstance(route_kernel, triton.runtime.JITFunction)
_ROUTE = FastLauncher(route_kernel)


def launch_route(logits_TE: torch.Tensor, bias_E: torch.Tensor | None, *, top_k: int,
                 scoring: str, renormalize: bool, scaling: float, n_group: int | None,
                 topk_group: int | None,
                 compiled: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """`route_kernel` over the T tokens, on the current stream: steps 1-6 of
    `moe.router`, the scaling factor included. The routing's settings come as arguments
    (a `MoEConfig`'s built-in routing: its fields of the same names; `scaling` is its
    `routed_scaling_factor`).

    Args:
        logits_TE: [T, E], any float dtype and strides.
        bias_E: correction bias [E], or None.
        top_k: experts per token (K).
        scoring: "softmax" or "sigmoid".
        renormalize: the K weights are divided by their sum.
        scaling: the factor the weights are multiplied by last.
        n_group, topk_group: grouped top-k (the K experts come from the `topk_group`
            best of `n_group` groups); None, or every group kept: plain top-k.
        compiled: launch through the compiled handle (`moe.kernels.launch`).

    Returns:
        ``(weights_TK, ids_TK)``: fresh contiguous float32 and int64 [T, K]; nothing is
        launched when T = 0.
    """
    num_tokens, num_experts = logits_TE.shape
    weights_TK = torch.empty(num_tokens, top_k, dtype=torch.float32, device=logits_TE.device)
    ids_TK = torch.empty(num_tokens, top_k, dtype=torch.int64, device=logits_TE.device)
    if num_tokens == 0:
        return weights_TK, ids_TK
    # Keeping all groups masks nothing: route those configs as plain top-k.
    grouped = n_group is not None and topk_group is not None and topk_group < n_group
    num_groups = n_group if grouped else 1
    topk_group = topk_group if grouped else 1
    group_size = num_experts // num_groups
    g_pow2 = next_power_of_2(num_groups)
    x_pow2 = next_power_of_2(group_size)
    block_t = _BLOCK_T if _COMPILED else _INTERPRETED_BLOCK_T
    num_warps = min(8, max(1, g_pow2 * x_pow2 // _EXPERTS_PER_WARP))
    _ROUTE(
        (cdiv(num_tokens, block_t),),
        logits_TE, None if bias_E is None else bias_E.contiguous(), weights_TK, ids_TK,
        num_tokens, logits_TE.stride(0), logits_TE.stride(1),
        float(scaling),
        SOFTMAX=scoring == "softmax", USE_BIAS=bias_E is not None,
        NUM_GROUPS=num_groups, GROUP_SIZE=group_size, TOPK_GROUP=topk_group,
        TOP_K=top_k, RENORMALIZE=renormalize, PRECISE=_COMPILED,
        BLOCK_T=block_t, G_POW2=g_pow2, X_POW2=x_pow2,
        K_POW2=next_power_of_2(top_k), num_warps=num_warps, compiled=compiled,
    )
    return weights_TK, ids_TK
