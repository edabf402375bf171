"""Top-k routing: router logits -> (weights, global expert ids) for every routing variant.

Shape legend: T tokens, E experts (global), K top-k, G expert groups.

The maths, all in float32 whatever the logits dtype (``s`` = scores, ``b`` = correction bias):

1. ``s = softmax(logits)`` over E, or ``s = sigmoid(logits)`` per expert.
2. Selection scores ``c = s + b`` with ``use_correction_bias``, else ``c = s``.
3. Grouped top-k (``n_group`` G, ``topk_group``): experts form G contiguous groups; a group's
   score is the sum of its top-2 ``c`` with the correction bias, else its max ``c`` (as in
   vLLM ``grouped_topk`` and DeepSeek-V3's ``MoEGate``); experts outside the ``topk_group``
   best groups get ``c = -inf``.
4. ``ids = topk(c, K)`` (descending ``c``); ``weights = s[ids]`` -- the bias never enters the
   weights.
5. ``renormalize``: ``weights /= weights.sum()`` per token.
6. ``weights *= routed_scaling_factor``.

A ``custom_routing_function`` replaces steps 1-5; its output is checked for shape and
converted to float32 weights / int64 ids; step 6 still applies. An id it returns outside
[0, E) (e.g. -1 for "no expert") becomes -1: that (token, k) slot is dropped, it adds
nothing to the token's output, on every backend and expert kernel.

On CUDA the built-in routing (steps 1-6) is one Triton kernel (`moe.kernels.route_triton`);
the torch version (CPU, custom routing, and the reference in tests) takes about twenty
ops, each a ~7 us launch on the host, which is on the critical path of the DBO schedule.
Both pick the same experts; on exact ties the kernel takes the lower expert id first,
where the torch version leaves the order to ``torch.topk``.

`config.kernels.implementation` picks the path for the built-in routing
(`moe.kernels.policy.KernelPolicy`). Triton is imported on first use, so importing this
module never needs it.
"""
from __future__ import annotations

import torch
from torch import Tensor

from moe.config import MoEConfig
from moe.kernels.policy import triton_module, use_triton

__all__ = ["route"]


def route(
    logits_TE: Tensor, config: MoEConfig, *, correction_bias_E: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Pick ``config.top_k`` experts per token.

    Args:
        logits_TE: router logits [T, E], any floating dtype; T may be 0.
        config: routing settings (scoring, groups, bias, renormalize, scaling, custom fn)
            and the kernel path (`config.kernels`).
        correction_bias_E: ``e_score_correction_bias`` [E]; required iff
            ``config.use_correction_bias``.

    Returns:
        ``(topk_weights_TK, topk_ids_TK)``: float32 [T, K] weights and int64 [T, K] global
        expert ids in [0, E), both contiguous, on the logits' device (and its stream); with
        a custom routing function, -1 where it returned an id outside [0, E) (dropped).
    """
    _check_logits(logits_TE, config)
    bias_E = _check_bias(correction_bias_E, config, logits_TE)
    if use_triton(config.kernels, logits_TE) and config.custom_routing_function is None:
        route_triton = triton_module("moe.kernels.route_triton")
        assert (bias_E is not None) == config.use_correction_bias
        return route_triton.launch_route(  # step 6 included
            logits_TE, bias_E, top_k=config.top_k, scoring=config.scoring,
            renormalize=config.renormalize, scaling=config.routed_scaling_factor,
            n_group=config.n_group, topk_group=config.topk_group,
            compiled=config.kernels.compiled_launches)
    logits_TE = logits_TE.float()
    if config.custom_routing_function is not None:
        weights_TK, ids_TK = _custom_route(logits_TE, config)
    else:
        weights_TK, ids_TK = _builtin_route(logits_TE, config, bias_E)
    if config.routed_scaling_factor != 1.0:
        weights_TK = weights_TK * config.routed_scaling_factor
    return weights_TK.contiguous(), ids_TK.contiguous()


def _builtin_route(
    logits_TE: Tensor, config: MoEConfig, bias_E: Tensor | None
) -> tuple[Tensor, Tensor]:
    if config.scoring == "softmax":
        scores_TE = torch.softmax(logits_TE, dim=-1)
    else:
        scores_TE = torch.sigmoid(logits_TE)
    choice_TE = scores_TE if bias_E is None else scores_TE + bias_E
    if config.n_group is not None:
        choice_TE = _mask_to_best_groups(choice_TE, config, by_top2=bias_E is not None)
    ids_TK = torch.topk(choice_TE, config.top_k, dim=-1, sorted=True).indices
    weights_TK = scores_TE.gather(1, ids_TK)
    if config.renormalize:
        # Scores are positive; the clamp only guards an all-underflow row against 0/0.
        total_T1 = weights_TK.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
        weights_TK = weights_TK / total_T1
    return weights_TK, ids_TK


def _mask_to_best_groups(choice_TE: Tensor, config: MoEConfig, *, by_top2: bool) -> Tensor:
    """Set ``-inf`` on experts outside each token's ``topk_group`` best groups."""
    assert config.n_group is not None and config.topk_group is not None
    num_tokens = choice_TE.shape[0]
    choice_TGX = choice_TE.reshape(num_tokens, config.n_group, config.experts_per_group)
    if by_top2:
        group_score_TG = choice_TGX.topk(2, dim=-1).values.sum(dim=-1)
    else:
        group_score_TG = choice_TGX.amax(dim=-1)
    best_groups_TG = torch.topk(group_score_TG, config.topk_group, dim=-1).indices
    keep_TG = torch.zeros_like(group_score_TG, dtype=torch.bool)
    keep_TG.scatter_(1, best_groups_TG, True)
    keep_TE = keep_TG.unsqueeze(-1).expand_as(choice_TGX).reshape_as(choice_TE)
    return choice_TE.masked_fill(~keep_TE, float("-inf"))


def _custom_route(logits_TE: Tensor, config: MoEConfig) -> tuple[Tensor, Tensor]:
    fn = config.custom_routing_function
    assert fn is not None
    result = fn(logits_TE, config.top_k)
    if not (isinstance(result, tuple) and len(result) == 2):
        raise TypeError(
            f"custom_routing_function returned {type(result).__name__}: it must return a "
            f"tuple (topk_weights_TK, topk_ids_TK)."
        )
    weights_TK, ids_TK = result
    expected = (logits_TE.shape[0], config.top_k)
    for name, tensor in (("topk_weights", weights_TK), ("topk_ids", ids_TK)):
        if not isinstance(tensor, Tensor) or tuple(tensor.shape) != expected:
            shape = tuple(tensor.shape) if isinstance(tensor, Tensor) else type(tensor).__name__
            raise ValueError(
                f"custom_routing_function returned {name} of shape {shape}: expected "
                f"[num_tokens, top_k] = {list(expected)}."
            )
    if not weights_TK.is_floating_point():
        raise TypeError(
            f"custom_routing_function returned topk_weights of dtype {weights_TK.dtype}: "
            f"return a floating tensor."
        )
    if ids_TK.is_floating_point() or ids_TK.is_complex() or ids_TK.dtype == torch.bool:
        raise TypeError(
            f"custom_routing_function returned topk_ids of dtype {ids_TK.dtype}: return an "
            f"integer tensor of global expert ids."
        )
    # An id outside [0, E) drops its (token, k) slot: it becomes -1, which every backend
    # and expert kernel reads as "no expert here" (a range check that raises would cost
    # a host sync on every call). Negative ids must not reach the expert maps, which
    # would read them from the end.
    ids_TK = ids_TK.long()
    in_range_TK = (ids_TK >= 0) & (ids_TK < config.num_experts)
    return weights_TK.float(), torch.where(in_range_TK, ids_TK, -1)


def _check_logits(logits_TE: Tensor, config: MoEConfig) -> None:
    if not isinstance(logits_TE, Tensor) or logits_TE.dim() != 2:
        shape = tuple(logits_TE.shape) if isinstance(logits_TE, Tensor) else type(logits_TE)
        raise ValueError(f"route: logits_TE has shape {shape}: expected [num_tokens, num_experts].")
    if logits_TE.shape[1] != config.num_experts:
        raise ValueError(
            f"route: logits_TE has {logits_TE.shape[1]} columns but config.num_experts="
            f"{config.num_experts}: the router weight must be [num_experts, hidden_size]."
        )
    if not logits_TE.is_floating_point():
        raise TypeError(f"route: logits_TE dtype {logits_TE.dtype} is not floating point.")


def _check_bias(bias_E: Tensor | None, config: MoEConfig, logits_TE: Tensor) -> Tensor | None:
    if config.use_correction_bias and bias_E is None:
        raise ValueError(
            "route: config.use_correction_bias=True but correction_bias_E is None: pass the "
            "layer's e_score_correction_bias [num_experts]."
        )
    if bias_E is None:
        return None
    if not config.use_correction_bias:
        raise ValueError(
            "route: correction_bias_E given but config.use_correction_bias=False: set "
            "use_correction_bias=True, or do not pass the bias."
        )
    if tuple(bias_E.shape) != (config.num_experts,):
        raise ValueError(
            f"route: correction_bias_E has shape {tuple(bias_E.shape)}: expected "
            f"[num_experts] = [{config.num_experts}]."
        )
    if bias_E.device != logits_TE.device:
        raise ValueError(
            f"route: correction_bias_E is on {bias_E.device} but logits_TE on "
            f"{logits_TE.device}: move the bias with the layer."
        )
    return bias_E.float()
