"""Every registered backend against the dense reference (two gloo ranks), found through
the registry: a new backend is tested here by registering it and adding its row to
`ROWS` (the traits it declares; tests/moe/test_backend_traits.py checks them). A backend
that cannot run in this process is skipped with the reason its own `check_runs` gives;
`single_rank` ones (EP size 1) are covered by the single-process layer tests.

DBO on runs each scenario twice: each ubatch's experts on its own rows, and joined
(`joined_experts`: the experts once over both ubatches' rows).

fp32 tolerance 1e-5: the backends add per-rank partial sums (reduce-scatter in another
order) where the reference adds a token's K expert outputs in one loop, so only the
summation order differs (as in tests/moe/test_moe_backends.py).
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dbo import UBatchScheduler
from moe.backends import BACKENDS, backend_class, backend_traits
from moe.config import MoEConfig
from moe.layer import MoELayer
from moe.reference import init_moe_weights, reference_moe
from tests.dist_utils import run_distributed

# One row per registered backend: the traits it declares true (`moe.backends.TRAITS`).
# A new backend adds its row here.
ROWS: dict[str, frozenset[str]] = {name: frozenset(traits) for name, traits in {
    "local": {"graph_safe", "graph_safe_with_capacity", "comm_recordable", "single_rank"},
    "naive": {"graph_safe_with_capacity", "reads_counts_on_host", "comm_recordable"},
    "naive_mono": {"graph_safe_with_capacity", "reads_counts_on_host", "comm_recordable",
                   "routes_gathered_logits"},
    "a2a": {"reads_counts_on_host", "comm_recordable"},
    "a2a_ll": {"graph_safe", "graph_safe_with_capacity", "pads_to_capacity", "comm_recordable",
               "needs_capacity", "takes_ubatch_capacity"},
    "symm_mem": {"graph_safe", "graph_safe_with_capacity", "needs_capacity", "opt_in"},
    "deepep_ht": {"reads_counts_on_host", "opt_in"},
    "deepep_ll": {"graph_safe", "graph_safe_with_capacity", "pads_to_capacity",
                  "needs_capacity", "opt_in"},
    "deepep_v2": {"reads_counts_on_host", "needs_capacity", "opt_in"},
    "nccl_ep": {"graph_safe", "graph_safe_with_capacity", "pads_to_capacity", "needs_capacity",
                "opt_in"},
}.items()}

ATOL = 1e-5
CAPACITY = 12
HIDDEN = 16
SCENARIOS = {
    # name: tokens per rank (rank 0, rank 1)
    "basic": (11, 6),
    "rank_with_no_tokens": (0, 9),
    "at_capacity": (CAPACITY, CAPACITY),
}


def contract_config(backend: str) -> MoEConfig:
    return MoEConfig(num_experts=8, top_k=3, hidden_size=HIDDEN, intermediate_size=8,
                     max_tokens_per_rank=CAPACITY, backend=backend, experts="reference")


def run_contract(rank: int, world_size: int, backend: str) -> dict:
    """Per scenario: (max |DBO off - reference|, max |DBO on - reference|, both shapes);
    with a backend that needs a capacity, also what one token over it raises."""
    torch.manual_seed(100 + rank)
    cfg = contract_config(backend)
    layer = MoELayer(cfg, group=dist.group.WORLD)
    weights = init_moe_weights(cfg, seed=7)
    layer.load_weights(weights)
    results: dict = {}
    for name, tokens in SCENARIOS.items():
        x = torch.randn(tokens[rank], HIDDEN)
        ref = reference_moe(x, router_weight_EH=weights["router_weight"],
                            w13_EIH=weights["w13"], w2_EHI=weights["w2"], config=cfg)
        with torch.no_grad():
            off = layer(x)
            half = x.shape[0] // 2
            halves = [lambda: layer(x[:half]), lambda: layer(x[half:])]
            on = torch.cat(UBatchScheduler("cpu").run(halves))
            joined = torch.cat(UBatchScheduler("cpu").run(halves, joined_experts=True))
        results[name] = tuple((out - ref).abs().max().item() if x.numel() else 0.0
                              for out in (off, on, joined)) + tuple(
            tuple(out.shape) for out in (off, on, joined))
    if backend_traits(backend).needs_capacity:
        # Every rank over the capacity: each refuses before any collective.
        try:
            with torch.no_grad():
                layer(torch.randn(CAPACITY + 1, HIDDEN))
            results["over_capacity"] = "no error"
        except ValueError as exc:
            results["over_capacity"] = str(exc)
    return results


@pytest.mark.distributed
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_backend_contract(backend):
    if backend_traits(backend).single_rank:
        pytest.skip(f"{backend} runs on an EP group of one rank only (single_rank)")
    try:
        backend_class(backend, 2).check_runs(2, contract_config(backend))
    except (ImportError, ValueError) as exc:
        pytest.skip(f"{backend}: {exc}")
    for rank, results in enumerate(run_distributed(2, run_contract, backend)):
        for name, tokens in SCENARIOS.items():
            err_off, err_on, err_joined, *shapes = results[name]
            assert shapes == [(tokens[rank], HIDDEN)] * 3, (rank, name)
            assert err_off <= ATOL, f"rank {rank} {name}: DBO off differs by {err_off}"
            assert err_on <= ATOL, f"rank {rank} {name}: DBO on differs by {err_on}"
            assert err_joined <= ATOL, (f"rank {rank} {name}: DBO with joined experts "
                                        f"differs by {err_joined}")
        if backend_traits(backend).needs_capacity:
            message = results["over_capacity"]
            assert f"max_tokens_per_rank={CAPACITY}" in message, message
            assert f"{CAPACITY + 1} tokens" in message, message
