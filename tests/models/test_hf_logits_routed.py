"""Layer 1 (CPU; one test on two gloo processes): MoE blocks that hand their experts the
router logits (`moe.hf.logits_routed`), as transformers 5.17's Aria does: the block's
experts module, which routes itself with `route_tokens_to_experts`, becomes a
`LogitsRoutedExperts` that routes with the replaced module's own method and runs dbo's
dispatch, experts and combine on that routing.

The installed transformers' Aria calls its experts through the experts interface, so the
blocks here are rebuilt as transformers 5.17 writes them (`AriaExperts` with `fc1.weight`
[E, H, 2I] / `fc2.weight` [E, I, H], silu of the first half times the second, a router
`nn.Linear`) inside a tiny Aria model; tests/models/test_hf_coverage.py runs transformers
5.17's own classes where 5.17 is installed. Checked: the converted logits equal the
unconverted model's with DBO off and on, in one process and on two expert-parallel ranks;
the routing is the module's own (another one, its values returned in the other order, is
followed too); the converted model's state dict in transformers' names is the unconverted
one, tensor for tensor; a module that takes logits but has no routing method is refused
in one line with the model left as it was; a routing method that returns something else
than the routing is named at the call.

Tolerance: 1e-5 of the logits' scale (`tests.hf_utils.assert_logits_close`): float32,
the experts' GEMMs over other row groupings and sums in another order. The saved state
dict is compared exactly: it is made of copies and transposes only.
"""
from __future__ import annotations

import types
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
from torch import nn

pytest.importorskip("transformers")

import moe.hf  # noqa: E402
from moe.hf import coverage  # noqa: E402
from moe.hf.logits_routed import LogitsRoutedExperts  # noqa: E402
from moe.hf.save import hf_state_dict  # noqa: E402
from tests.dist_utils import run_distributed  # noqa: E402
from tests.hf_utils import (assert_logits_close, assert_saves_unconverted, batch, dbo_logits,
                             logits)  # noqa: E402



class GroupedGemm(nn.Module):
    """transformers 5.17's `AriaGroupedExpertsGemm`: one weight [E, in, out]."""

    def __init__(self, in_features: int, out_features: int, groups: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(groups, in_features, out_features))


class AriaExperts(nn.Module):
    """transformers 5.17's `AriaExperts`: called with the router logits, routes them
    itself (top-k of the logits, softmax over the top logits), fc1 [E, H, 2I] and fc2
    [E, I, H] in x out, silu(first half) * second half. Computed per (token, slot)
    here: the reference, not a copy of 5.17's grouped loop."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        self.fc1 = GroupedGemm(config.hidden_size, 2 * config.intermediate_size,
                               config.moe_num_experts)
        self.fc2 = GroupedGemm(config.intermediate_size, config.hidden_size,
                               config.moe_num_experts)

    def route_tokens_to_experts(self, router_logits: torch.Tensor) -> Any:
        top_logits, top_indices = torch.topk(router_logits, k=self.config.moe_topk, dim=1)
        return top_indices, nn.functional.softmax(top_logits, dim=-1)

    def forward(self, hidden_states: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        ids_TK, weights_TK = self.route_tokens_to_experts(router_logits)
        if ids_TK.is_floating_point():  # a routing that returns (weights, ids)
            ids_TK, weights_TK = weights_TK, ids_TK
        out_TH = torch.zeros_like(hidden_states)
        for k in range(ids_TK.shape[1]):
            h_TJ = torch.einsum("th,thj->tj", hidden_states, self.fc1.weight[ids_TK[:, k]])
            projection, gate = h_TJ.chunk(2, dim=-1)
            y_TH = torch.einsum("ti,tih->th", nn.functional.silu(projection) * gate,
                                self.fc2.weight[ids_TK[:, k]])
            out_TH += weights_TK[:, k, None] * y_TH
        return out_TH


class AriaTextMoELayer(nn.Module):
    """transformers 5.17's block: a router `nn.Linear`, the experts on its logits, and
    the shared experts (the installed model's own module)."""

    def __init__(self, config: Any, experts: nn.Module, shared_experts: nn.Module) -> None:
        super().__init__()
        self.router = nn.Linear(config.hidden_size, config.moe_num_experts, bias=False)
        self.experts = experts
        self.shared_experts = shared_experts

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        x_TH = hidden_states.view(-1, shape[-1])
        routed = self.experts(x_TH, self.router(x_TH)).view(shape)
        return routed + self.shared_experts(hidden_states)


def _aria(make_experts: Callable[[Any], nn.Module] = AriaExperts, *,
          seed: int = 0) -> nn.Module:
    """The tiny Aria model, its MoE blocks rebuilt as transformers 5.17 builds them
    (weights drawn from `seed`, the same in every process)."""
    model = coverage.tiny_model("aria", seed=seed)
    config = model.config
    gen = torch.Generator().manual_seed(seed)
    for layer in model.model.layers:
        old = layer.mlp
        if not isinstance(getattr(old, "experts", None), nn.Module):
            continue
        block = AriaTextMoELayer(config, make_experts(config), old.shared_experts)
        with torch.no_grad():
            for p in (block.router.weight, *block.experts.parameters()):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
        layer.mlp = block
    return model.eval()


def _sigmoid_weights_first(self: nn.Module, router_logits: torch.Tensor) -> Any:
    """Another routing than Aria's (sigmoid of every logit, not renormalised), its
    values in the other order: (weights, ids)."""
    weights_TK, ids_TK = torch.sigmoid(router_logits).topk(self.config.moe_topk, dim=1)
    return weights_TK, ids_TK


def test_experts_routing_their_logits_convert_and_match():
    model = _aria()
    ids, mask = batch(3, 6, seed=1)
    expected = logits(model, ids, mask)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    moe.hf.convert(model)
    experts = [m for m in model.modules() if isinstance(m, LogitsRoutedExperts)]
    assert len(experts) == 2 and all(m.routing == "route_tokens_to_experts" for m in experts)
    assert "routed by AriaExperts.route_tokens_to_experts" in model.dbo_conversion_summary
    names = set(model.state_dict())
    assert "model.layers.1.mlp.experts.w13" in names
    assert not any(".fc1." in n or ".route_owner." in n for n in names)
    assert_logits_close(logits(model, ids, mask), expected)
    assert_logits_close(dbo_logits(model, ids, mask), expected)
    # What save_pretrained writes: the unconverted state dict, fc1 / fc2 in their layout.
    assert_saves_unconverted(hf_state_dict(model), state)


def test_the_routing_is_the_experts_modules_own():
    def other(config: Any) -> nn.Module:
        module = AriaExperts(config)
        module.route_tokens_to_experts = types.MethodType(_sigmoid_weights_first, module)
        return module

    model = _aria(other)
    ids, mask = batch(2, 5, seed=2)
    expected = logits(model, ids, mask)
    # The other routing changes the logits: the match below is not Aria's routing by luck.
    aria = logits(_aria(), ids, mask)
    assert (aria - expected).abs().max() > 1e-3 * expected.abs().max()
    moe.hf.convert(model)
    assert_logits_close(logits(model, ids, mask), expected)


def test_experts_taking_logits_without_a_routing_method_are_refused_unchanged():
    class Unroutable(AriaExperts):
        route_tokens_to_experts = None  # type: ignore[assignment]

        def forward(self, hidden_states: torch.Tensor, router_logits: torch.Tensor) -> Any:
            return hidden_states

    model = _aria(Unroutable)
    before = dict(model.named_modules())
    with pytest.raises(ValueError) as info:
        moe.hf.convert(model)
    text = str(info.value)
    assert "\n" not in text
    assert "forward(hidden_states, router_logits)" in text and "route_tokens_to_experts" in text
    assert "'model.layers.0.mlp'" in text or "'model.layers.1.mlp'" in text
    assert dict(model.named_modules()) == before


def test_a_routing_method_that_returns_no_routing_is_named_at_the_call():
    model = _aria()
    moe.hf.convert(model)
    experts = model.model.layers[1].mlp.experts
    experts.route_owner.route_tokens_to_experts = lambda logits_TE: logits_TE
    ids, mask = batch(2, 5, seed=3)
    with pytest.raises(ValueError, match=r"AriaExperts\.route_tokens_to_experts returned "
                                         r"Tensor, not the routing"):
        logits(model, ids, mask)


def _ep_ranks(rank: int, world: int) -> None:
    model = _aria(seed=5)
    ids, mask = batch(*((3, 6), (2, 5))[rank], seed=10 + rank)
    expected = logits(model, ids, mask)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    moe.hf.convert(model, group=dist.group.WORLD)
    experts = model.model.layers[1].mlp.experts
    assert isinstance(experts, LogitsRoutedExperts) and experts.num_local_experts * world == \
        experts.config.num_experts
    outputs = [logits(model, ids, mask), dbo_logits(model, ids, mask, group=dist.group.WORLD)]
    saved = hf_state_dict(model)  # gathers every rank's experts on rank 0
    for out in outputs:
        assert_logits_close(out, expected)
    if rank != 0:
        assert saved is None
        return
    assert_saves_unconverted(saved, state)


def test_two_ranks_shard_the_experts_of_blocks_routing_their_logits():
    run_distributed(2, _ep_ranks)
