"""Layer 2 (two/three gloo processes): every dispatch/combine backend against the
single-process dense reference, with DBO on and off, over edge cases.

Each rank builds the same global weights (seeded), takes its slice of experts, and
routes its own tokens (a different count per rank). The dense reference is computed on
each rank from the full weights. fp32 tolerances are 1e-5: the backends add per-rank
partial sums (and reduce-scatter adds them in another order) where the reference adds
all K expert outputs of a token in one loop, so only summation order differs.
"""
from __future__ import annotations

from dataclasses import replace
import os
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist

from dbo import UBatchScheduler
from moe.config import MoEConfig
from moe.kernels.policy import KernelPolicy
from moe.layer import MoELayer
from moe.reference import init_moe_weights, reference_moe
from moe.shared import SharedExperts
from tests.dist_utils import run_distributed

pytestmark = pytest.mark.distributed

ATOL = RTOL = 1e-5


def all_to_expert_zero(logits_TE: torch.Tensor, top_k: int):
    """Custom routing: every token to expert 0 (on rank 0) with weight 1."""
    num_tokens = logits_TE.shape[0]
    ids = torch.zeros(num_tokens, top_k, dtype=torch.int64)
    ids[:, 1:] = torch.arange(1, top_k).expand(num_tokens, top_k - 1) if top_k > 1 else ids[:, 1:]
    return torch.full((num_tokens, top_k), 1.0 / top_k), ids


def to_last_expert(logits_TE: torch.Tensor, top_k: int):
    """Custom routing: every token to the last experts (none on rank 0 when W >= 2)."""
    num_tokens, num_experts = logits_TE.shape
    ids = torch.arange(num_experts - top_k, num_experts).expand(num_tokens, top_k).clone()
    return torch.full((num_tokens, top_k), 1.0 / top_k), ids


SCENARIOS = {
    # name: (MoEConfig overrides, tokens per rank (indexed by rank), split for DBO)
    "basic": (dict(), (13, 7, 9)),
    "shared_experts": (dict(num_shared_experts=1), (11, 5, 8)),
    "rank_with_no_tokens": (dict(), (0, 9, 4)),
    "all_to_one_expert": (dict(custom_routing_function=all_to_expert_zero), (6, 8, 5)),
    "rank_receives_nothing": (dict(custom_routing_function=to_last_expert), (6, 5, 7)),
    "top1_weight_on_input": (dict(top_k=1, apply_router_weight_on_input=True), (9, 4, 6)),
    "one_token_ubatches": (dict(), (2, 2, 2)),
    "sigmoid_grouped_bias": (dict(scoring="sigmoid", n_group=3, topk_group=2,
                                  use_correction_bias=True, routed_scaling_factor=2.5),
                             (10, 12, 3)),
}


def check_backend(rank: int, world_size: int, backend: str,
                  kernels: KernelPolicy = KernelPolicy()) -> dict[str, tuple]:
    """Per scenario: (max |DBO off - reference|, max |DBO on - reference|, the same with
    the layer as the model's last (a2a/a2a_ll split the last ubatch's combine), shapes);
    `kernels`: the row and slot kernels' paths."""
    torch.manual_seed(1234 + rank)
    return errors_against_reference(
        rank, lambda cfg: MoELayer(replace(cfg, backend=backend, experts="reference"),
                                   group=dist.group.WORLD), kernels=kernels)


def errors_against_reference(rank: int, make_layer: Callable[[MoEConfig], MoELayer],
                             **config: Any) -> dict[str, tuple]:
    """Every scenario through the layer `make_layer(cfg)` builds (cfg: the scenario's
    MoEConfig with `config`'s fields): (max |out - reference| with DBO off, on, and on
    as the model's last layer, then the three output shapes). Seed torch first."""
    errors = {}
    for name, (overrides, tokens) in SCENARIOS.items():
        cfg = MoEConfig(**{**dict(num_experts=12, top_k=3, hidden_size=24,
                                  intermediate_size=16, max_tokens_per_rank=16, **config),
                           **overrides})
        layer = make_layer(cfg)
        weights = init_moe_weights(cfg, seed=7)
        layer.load_weights(weights)
        shared = None
        if cfg.num_shared_experts:
            shared = SharedExperts.from_config(cfg, seed=3)
            layer.shared_experts.load_state_dict(shared.state_dict())
        x = torch.randn(tokens[rank], cfg.hidden_size)
        ref = reference_moe(x, router_weight_EH=weights["router_weight"], w13_EIH=weights["w13"],
                            w2_EHI=weights["w2"], config=cfg,
                            correction_bias_E=weights.get("e_score_correction_bias"),
                            shared_experts=shared)
        with torch.no_grad():
            if "e_score_correction_bias" in weights:
                layer.router.e_score_correction_bias.copy_(weights["e_score_correction_bias"])
            off = layer(x)
            half = x.shape[0] // 2
            on = torch.cat(UBatchScheduler("cpu").run(
                [lambda: layer(x[:half]), lambda: layer(x[half:])]))
            layer.last_layer = True
            on_split = torch.cat(UBatchScheduler("cpu").run(
                [lambda: layer(x[:half]), lambda: layer(x[half:])]))
        errors[name] = tuple((out - ref).abs().max().item() if x.numel() else 0.0
                             for out in (off, on, on_split)) + (
                                 tuple(off.shape), tuple(on.shape), tuple(on_split.shape))
    return errors


def assert_close_everywhere(results: list, world_size: int) -> None:
    for rank, errors in enumerate(results):
        for name, (err_off, err_on, err_split, *shapes) in errors.items():
            tokens = SCENARIOS[name][1][rank]
            assert shapes == [(tokens, 24)] * 3, (rank, name)
            assert err_off <= ATOL, f"rank {rank} {name}: DBO off differs by {err_off}"
            assert err_on <= ATOL, f"rank {rank} {name}: DBO on differs by {err_on}"
            assert err_split <= ATOL, f"rank {rank} {name}: split combine differs by {err_split}"


@pytest.mark.parametrize("backend", ["naive", "a2a", "a2a_ll"])
def test_backend_matches_reference_two_ranks(backend):
    assert_close_everywhere(run_distributed(2, check_backend, backend), 2)


@pytest.mark.parametrize("backend", ["a2a", "a2a_ll"])
def test_backend_matches_reference_three_ranks(backend):
    assert_close_everywhere(run_distributed(3, check_backend, backend), 3)


def check_backend_triton_rows(rank: int, world_size: int, backend: str) -> dict:
    """`check_backend` with the packing, the combine sums and `a2a_ll`'s slot layout on
    their Triton kernels (the GPU path; interpreted here)."""
    return check_backend(rank, world_size, backend,
                         kernels=KernelPolicy(implementation="triton"))


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="runs the Triton row kernels on CPU tensors, which needs the "
                           "interpreter (conftest sets TRITON_INTERPRET=1 without CUDA)")
@pytest.mark.parametrize("backend", ["a2a", "a2a_ll"])
def test_backend_with_triton_row_kernels(backend):
    assert_close_everywhere(run_distributed(2, check_backend_triton_rows, backend), 2)


def naive_without_capacity(rank: int, world_size: int) -> float:
    cfg = MoEConfig(num_experts=4, top_k=2, hidden_size=8, intermediate_size=8)
    layer = MoELayer(replace(cfg, backend="naive", experts="reference"), group=dist.group.WORLD)
    weights = init_moe_weights(cfg, seed=1)
    layer.load_weights(weights)
    x = torch.randn(3 + 5 * rank, 8)
    ref = reference_moe(x, router_weight_EH=weights["router_weight"], w13_EIH=weights["w13"],
                        w2_EHI=weights["w2"], config=cfg)
    with torch.no_grad():
        return (layer(x) - ref).abs().max().item()


def test_naive_without_capacity_exchanges_counts():
    assert max(run_distributed(2, naive_without_capacity)) <= ATOL


def capacity_overflow(rank: int, world_size: int) -> str:
    cfg = MoEConfig(num_experts=4, top_k=2, hidden_size=8, intermediate_size=8,
                    max_tokens_per_rank=4)
    layer = MoELayer(replace(cfg, backend="a2a_ll", experts="reference"), group=dist.group.WORLD)
    layer.load_weights(init_moe_weights(cfg, seed=1))
    try:
        layer(torch.randn(5, 8))
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_a2a_ll_capacity_overflow_is_an_error_not_a_drop():
    for message in run_distributed(2, capacity_overflow):
        assert "max_tokens_per_rank=4" in message and "5 tokens" in message


def collective_order(rank: int, world_size: int, backend: str) -> list[tuple[str, int]]:
    """(collective, ubatch) in issue order for a DBO step over two MoE layers."""
    from dbo.failures import record_collectives

    cfg = MoEConfig(num_experts=4, top_k=2, hidden_size=8, intermediate_size=8,
                    max_tokens_per_rank=16)
    layers = [MoELayer(replace(cfg, backend=backend, experts="reference"), group=dist.group.WORLD)
              for _ in range(2)]
    for layer in layers:
        layer.load_weights(init_moe_weights(cfg, seed=1))
    x = torch.randn(10, 8)

    def stack(x_TH: torch.Tensor) -> torch.Tensor:
        for layer in layers:
            x_TH = x_TH + layer(x_TH)
        return x_TH

    with torch.no_grad(), record_collectives() as log:
        UBatchScheduler("cpu").run([lambda: stack(x[:5]), lambda: stack(x[5:])])
    return list(log)


@pytest.mark.parametrize("backend", ["a2a", "a2a_ll"])
def test_transfers_alternate_between_ubatches(backend):
    """One in-order comm stream: a ubatch's transfers must be issued in the order
    dispatch 0, dispatch 1, combine 0, combine 1 per layer, whether the backend yields
    before its send (a2a, which reads counts) or after it (a2a_ll)."""
    for log in run_distributed(2, collective_order, backend):
        # (a2a's count exchanges run on a side stream: noted as "... (counts)")
        transfers = [ubatch for name, ubatch in log if name == "all_to_all_single"]
        assert transfers == [0, 1, 0, 1] * 2, log


def test_local_ids_maps_this_ranks_experts_and_keeps_minus_one():
    """Rank 1 of 3 with 9 experts holds experts 3..5: they become 0..2, all else -1."""
    from moe.backends.base import ExpertPlacement, PrepareFinalize

    class Stub(PrepareFinalize):
        name = "stub"
        prepare_async = finalize_async = None

    cfg = MoEConfig(num_experts=9, top_k=3, hidden_size=8, intermediate_size=8)
    backend = Stub(cfg, None)
    backend.placement = ExpertPlacement(rank=1, world_size=3, num_experts=9)
    ids = torch.tensor([[0, 3, -1], [5, 4, 8], [-1, -1, -1], [2, 6, 3]])
    expected = torch.tensor([[-1, 0, -1], [2, 1, -1], [-1, -1, -1], [-1, -1, 0]])
    assert torch.equal(backend.local_ids(ids), expected)
    assert torch.equal(backend.local_ids(ids[:0]), expected[:0])


def _send_order_by_sort(mask_TW):
    """The order a stable sort of the (rank, token) pairs by rank gives (a2a's earlier
    method), as (src_X, slot_TW)."""
    num_tokens, world = mask_TW.shape
    key_WT = torch.where(mask_TW.t(), torch.arange(world)[:, None], world)
    sorted_key_X, order_X = torch.sort(key_WT.reshape(-1), stable=True)
    src_X = torch.where(sorted_key_X < world, order_X % max(num_tokens, 1), -1)
    slot_X = torch.empty_like(order_X)
    slot_X[order_X] = torch.arange(order_X.shape[0])
    return src_X, torch.where(mask_TW, slot_X.view(world, num_tokens).t(), -1)


@pytest.mark.parametrize("num_tokens", [0, 1, 7, 300])
@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("density", [0.0, 0.3, 1.0])
def test_a2a_send_order_is_the_stable_rank_major_order(num_tokens, world, density):
    from moe.backends.a2a import send_order

    gen = torch.Generator().manual_seed(num_tokens * 10 + world)
    mask_TW = torch.rand(num_tokens, world, generator=gen) < density
    src_X, slot_TW = send_order(mask_TW)
    want_src, want_slot = _send_order_by_sort(mask_TW)
    assert torch.equal(src_X, want_src) and torch.equal(slot_TW, want_slot)
    # Spelled out: rank w's tokens in token order, rank by rank, then -1s.
    expected = [t for w in range(world) for t in range(num_tokens) if mask_TW[t, w]]
    sent = int(mask_TW.sum())
    assert src_X[:sent].tolist() == expected and (src_X[sent:] == -1).all()
