"""Layers 1-2 (CPU; one process, then two gloo ranks): expert ids that a custom routing
function returns outside [0, num_experts).

The contract (`MoEConfig.custom_routing_function`, `moe.router`): such a (token, k) slot
is dropped -- it adds nothing to its token's output -- on every backend (local, naive,
a2a, a2a_ll) and expert kernel (reference, grouped, triton), DBO on and off. The expected
output is computed independently: the same routing with each bad slot sent to a valid
expert with weight 0. (On main, naive computed id -2 on expert E-1, a2a failed on ids
past E, and the local experts read out of range.)
"""
from __future__ import annotations

from dataclasses import replace
import pytest
import torch
import torch.distributed as dist

from dbo import DBOConfig, DBORunner
from moe import MoEConfig, MoELayer, init_moe_weights, reference_moe
from moe.router import route
from tests.dist_utils import run_distributed

NUM_EXPERTS, TOP_K, HIDDEN = 4, 2, 16
SPLIT = DBOConfig(split="tokens", min_decode_tokens=0, min_prefill_tokens=0)
# Token t's slot (t % 7) % K takes BAD[t % 7] (None: keep the expert); tokens with t % 7 == 5
# lose both slots. A period of 7 tokens: DBO's halves of 14 or 28 tokens see the same.
BAD = (-1, -2, NUM_EXPERTS, NUM_EXPERTS + 3, -100, -1, None)


def routing(logits_TE: torch.Tensor, top_k: int, *, zero_bad: bool = False):
    """Top-k of the logits with some ids made invalid; with `zero_bad`, those slots go to
    expert 0 with weight 0 instead (the expected output of a dropped slot)."""
    weights_TK, ids_TK = torch.topk(torch.softmax(logits_TE, dim=-1), top_k, dim=-1)
    ids_TK, weights_TK = ids_TK.clone(), weights_TK.clone()
    for t in range(ids_TK.shape[0]):
        bad = BAD[t % 7]
        if bad is None:
            continue
        for k in (range(top_k) if t % 7 == 5 else [t % 7 % top_k]):
            ids_TK[t, k], weights_TK[t, k] = (0, 0.0) if zero_bad else (bad, weights_TK[t, k])
    return weights_TK, ids_TK


def expected_routing(logits_TE: torch.Tensor, top_k: int):
    return routing(logits_TE, top_k, zero_bad=True)


def configs(**extra) -> tuple[MoEConfig, MoEConfig]:
    base = dict(num_experts=NUM_EXPERTS, top_k=TOP_K, hidden_size=HIDDEN,
                intermediate_size=16, **extra)
    return (MoEConfig(**base, custom_routing_function=routing),
            MoEConfig(**base, custom_routing_function=expected_routing))


def expected_output(cfg: MoEConfig, weights: dict, x: torch.Tensor) -> torch.Tensor:
    return reference_moe(x, router_weight_EH=weights["router_weight"], w13_EIH=weights["w13"],
                         w2_EHI=weights["w2"], config=cfg)


# ---------------------------------------------------------------- layer 1: one process
def test_route_turns_out_of_range_ids_into_minus_one():
    cfg, _ = configs()
    logits = torch.randn(14, NUM_EXPERTS)
    weights, ids = route(logits, cfg)
    raw_weights, raw_ids = routing(logits.float(), TOP_K)
    valid = (raw_ids >= 0) & (raw_ids < NUM_EXPERTS)
    assert torch.equal(ids, torch.where(valid, raw_ids, -1))
    assert (~valid).sum() >= 10 and torch.equal(weights, raw_weights)


@pytest.mark.parametrize("experts", ["reference", "grouped", "triton"])
@pytest.mark.parametrize("dbo_on", [False, True])
def test_local_backend_drops_out_of_range_slots(experts, dbo_on):
    cfg, expected_cfg = configs()
    layer = MoELayer(replace(cfg, experts=experts))
    weights = init_moe_weights(cfg, seed=2)
    layer.load_weights(weights)
    x = torch.randn(14, HIDDEN)
    with torch.no_grad():
        out = (DBORunner(layer, SPLIT) if dbo_on else layer)(x)
    expected = expected_output(expected_cfg, weights, x)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert out[5].abs().max() == 0 and out[12].abs().max() == 0  # both slots dropped


# ------------------------------------------------------------ layer 2: two gloo ranks
EP_BACKENDS = ("naive", "a2a", "a2a_ll")


def ep_errors(rank: int, world_size: int) -> dict[str, float]:
    """Per backend and DBO off/on: max |layer - expected| on this rank."""
    torch.manual_seed(10 + rank)
    cfg, expected_cfg = configs(max_tokens_per_rank=28)
    weights = init_moe_weights(cfg, seed=2)
    x = torch.randn(14 * (rank + 1), HIDDEN)
    expected = expected_output(expected_cfg, weights, x)
    errors = {}
    for backend in EP_BACKENDS:
        layer = MoELayer(replace(cfg, backend=backend, experts="reference"), group=dist.group.WORLD)
        layer.load_weights(weights)
        for dbo_on in (False, True):
            call = DBORunner(layer, SPLIT, group=dist.group.WORLD) if dbo_on else layer
            with torch.no_grad():
                out = call(x)
            errors[f"{backend} dbo={dbo_on}"] = (out - expected).abs().max().item()
    return errors


@pytest.mark.distributed
def test_ep_backends_drop_out_of_range_slots_two_ranks():
    for rank, errors in enumerate(run_distributed(2, ep_errors)):
        for name, error in errors.items():
            assert error <= 1e-5, f"rank {rank} {name}: differs by {error}"
