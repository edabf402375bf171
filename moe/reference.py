"""Dense, token-by-token MoE ground truth and deterministic test weights.

Shape legend: T tokens, E experts (global), K top-k, H hidden, I intermediate size.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moe.config import MoEConfig
from moe.router import route

__all__ = ["reference_moe", "init_moe_weights"]


def reference_moe(
    x_TH: Tensor,
    *,
    router_weight_EH: Tensor,
    w13_EIH: Tensor,
    w2_EHI: Tensor,
    config: MoEConfig,
    correction_bias_E: Tensor | None = None,
    shared_experts: nn.Module | None = None,
) -> Tensor:
    """The MoE layer computed one token and one expert at a time, in float32.

    Routing: ``logits = F.linear(x, router_weight)`` in x's dtype (as a model's router
    linear does, so the expert choice matches the layer's on the same device), then
    `moe.router.route` (a slot it drops, id -1, adds nothing). Each picked expert runs
    ``W2 (silu(Wgate x) * Wup x)`` in float32 and its output is added with its weight.
    With ``apply_router_weight_on_input`` (top-1) the input is scaled by the weight
    instead and the output added with weight 1. Shared experts, when given, see the
    unscaled input and are added in float32.

    Args:
        x_TH: [T, H] input, float32/float16/bfloat16.
        router_weight_EH: [E, H] router weight (x's dtype).
        w13_EIH: [E, 2I, H] all experts (gate rows, then up rows); not an EP slice.
        w2_EHI: [E, H, I] all experts.
        config: the layer config.
        correction_bias_E: [E] ``e_score_correction_bias`` when ``config.use_correction_bias``.
        shared_experts: module mapping [T, H] -> [T, H], or None.

    Returns:
        [T, H] in x's dtype.
    """
    num_tokens, hidden = x_TH.shape
    num_experts, inter = config.num_experts, config.intermediate_size
    expected = {
        "router_weight_EH": (router_weight_EH, (num_experts, hidden)),
        "w13_EIH": (w13_EIH, (num_experts, 2 * inter, hidden)),
        "w2_EHI": (w2_EHI, (num_experts, hidden, inter)),
    }
    for name, (tensor, shape) in expected.items():
        if tuple(tensor.shape) != shape:
            raise ValueError(
                f"reference_moe: {name} has shape {tuple(tensor.shape)}, expected {list(shape)} "
                f"(all {num_experts} experts of the config)."
            )
    logits_TE = F.linear(x_TH, router_weight_EH.to(x_TH.dtype))
    weights_TK, ids_TK = route(logits_TE, config, correction_bias_E=correction_bias_E)

    w13_f32, w2_f32 = w13_EIH.float(), w2_EHI.float()
    out_TH = torch.zeros(num_tokens, hidden, dtype=torch.float32, device=x_TH.device)
    for t in range(num_tokens):
        for k in range(config.top_k):
            e, weight = int(ids_TK[t, k]), float(weights_TK[t, k])
            if e < 0:
                continue  # a slot custom routing dropped (`moe.router`)
            x_H = x_TH[t].float()
            if config.apply_router_weight_on_input:
                x_H, weight = x_H * weight, 1.0
            h_2I = w13_f32[e] @ x_H
            act_I = F.silu(h_2I[:inter]) * h_2I[inter:]
            out_TH[t] += weight * (w2_f32[e] @ act_I)
    if shared_experts is not None:
        out_TH += shared_experts(x_TH).float()
    return out_TH.to(x_TH.dtype)


def _expert_seed(seed: int, expert: int) -> int:
    # Each expert's weights depend on (seed, expert) only, so an EP rank's slice equals the
    # same slice of the full set. Arithmetic, not hash(): str hashes vary per process.
    return (seed * 0x9E3779B1 + (expert + 1) * 0x85EBCA77) % (2**63)


def init_moe_weights(
    config: MoEConfig,
    *,
    num_local_experts: int | None = None,
    first_expert: int = 0,
    seed: int,
    device: torch.device | str = "cpu",
) -> dict[str, Tensor]:
    """Deterministic random MoE weights, scaled so activations stay O(1) for O(1) inputs.

    Entries N(0, 1/fan_in): router logits, gate/up and expert outputs all have unit-order
    variance. Values are drawn on the CPU in float32 (the same on every device), then
    cast to ``config.dtype`` and moved to ``device``.

    Args:
        config: sizes and dtype.
        num_local_experts: experts held here (an EP slice); None = all ``num_experts``.
        first_expert: global id of the first local expert (e.g. rank * num_local_experts).
        seed: base seed.
        device: where the tensors go.

    Returns:
        ``router_weight`` [E, H], ``w13`` [E_local, 2I, H], ``w2`` [E_local, H, I] in
        ``config.dtype``, plus ``e_score_correction_bias`` [E] float32 when
        ``config.use_correction_bias``.
    """
    num_local = config.num_experts if num_local_experts is None else num_local_experts
    if not 1 <= num_local or not 0 <= first_expert or first_expert + num_local > config.num_experts:
        raise ValueError(
            f"init_moe_weights: experts [{first_expert}, {first_expert + num_local}) do not fit "
            f"in num_experts={config.num_experts}: check num_local_experts / first_expert."
        )
    hidden, inter, dtype = config.hidden_size, config.intermediate_size, config.dtype
    gen = torch.Generator().manual_seed(seed)
    weights = {
        "router_weight": torch.randn(config.num_experts, hidden, generator=gen) / hidden**0.5,
    }
    if config.use_correction_bias:
        weights["e_score_correction_bias"] = 0.1 * torch.randn(config.num_experts, generator=gen)
    w13, w2 = [], []
    for e in range(first_expert, first_expert + num_local):
        gen_e = torch.Generator().manual_seed(_expert_seed(seed, e))
        w13.append(torch.randn(2 * inter, hidden, generator=gen_e) / hidden**0.5)
        w2.append(torch.randn(hidden, inter, generator=gen_e) / inter**0.5)
    weights["w13"] = torch.stack(w13)
    weights["w2"] = torch.stack(w2)
    out = {}
    for name, tensor in weights.items():
        target = torch.float32 if name == "e_score_correction_bias" else dtype
        out[name] = tensor.to(device=device, dtype=target).contiguous()
    return out
