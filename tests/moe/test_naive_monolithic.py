"""Layer 2 (two gloo processes): the naive backend's monolithic form (`naive_mono`:
router logits gathered with the tokens, every rank routing the gathered rows) against
the dense reference and against the modular form (`naive`), DBO on and off.

The scenarios are `test_moe_backends`' (a rank with no tokens, all tokens to one
expert, top-1 weight on input, grouped sigmoid routing with a correction bias, ...).
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from dbo import UBatchScheduler
from moe.config import MoEConfig
from moe.layer import MoELayer
from moe.reference import init_moe_weights
from tests.dist_utils import run_distributed
from tests.moe.test_moe_backends import assert_close_everywhere, check_backend

pytestmark = pytest.mark.distributed


def test_naive_mono_matches_reference_two_ranks():
    assert_close_everywhere(run_distributed(2, check_backend, "naive_mono"), 2)


def mono_and_modular(rank: int, world_size: int, capacity) -> list[float]:
    """max |naive_mono - naive| / max |naive| per (tokens on this rank), DBO off and on;
    rank 0 has no tokens in the first case."""
    cfg = MoEConfig(num_experts=6, top_k=2, hidden_size=16, intermediate_size=8,
                    max_tokens_per_rank=capacity, experts="reference", scoring="sigmoid",
                    use_correction_bias=True)
    weights = init_moe_weights(cfg, seed=5)
    layers = {}
    for backend in ("naive", "naive_mono"):
        layers[backend] = MoELayer(replace(cfg, backend=backend), group=dist.group.WORLD)
        layers[backend].load_weights(weights)
    torch.manual_seed(rank)
    diffs = []
    for tokens in ((0, 7), (5, 3)):
        x = torch.randn(tokens[rank], 16)
        half = x.shape[0] // 2
        outs = {}
        with torch.no_grad():
            for name, layer in layers.items():
                off = layer(x)
                on = torch.cat(UBatchScheduler("cpu").run(
                    [lambda: layer(x[:half]), lambda: layer(x[half:])]))
                outs[name] = (off, on)
        for a, b in zip(outs["naive"], outs["naive_mono"]):
            assert a.shape == b.shape == (tokens[rank], 16)
            scale = a.abs().max().item() if a.numel() else 0.0
            diffs.append((a - b).abs().max().item() / scale if scale else 0.0)
    return diffs


@pytest.mark.parametrize("capacity", [None, 8])
def test_naive_mono_equals_the_modular_form(capacity):
    """Same experts, same weights, same rows: the outputs agree to a few float32 ulp.

    Not bit for bit: the modular form routes each rank's T rows, the monolithic form
    the gathered W*C rows (padding included), so a token's logits sit at another offset
    of the buffer `route` runs on. ATen's AVX2 sigmoid (not its AVX-512 one) gives 1 ulp
    different results in a vector's tail than in its body (measured under
    ATEN_CPU_CAPABILITY=avx2), so a top-k weight may differ by 1 ulp (2**-24 relative),
    and each output row sums K=2 weighted expert rows: the output moves by at most a
    few ulp of its scale. 2**-20 (16 ulp) of the output's scale leaves room for that and
    fails on any wrong row, expert or weight (those move it by O(1))."""
    for diffs in run_distributed(2, mono_and_modular, capacity):
        assert all(d <= 2 ** -20 for d in diffs), diffs


def test_naive_mono_is_graph_safe_only_with_a_capacity():
    """Layer 1 (CPU): like `naive`, it reads the counts on the host without a capacity."""
    from moe.backends.naive_mono import NaiveMonolithicBackend

    cfg = MoEConfig(num_experts=4, top_k=2, hidden_size=8, intermediate_size=8)
    assert not NaiveMonolithicBackend(cfg, None).graph_safe
    assert NaiveMonolithicBackend(replace(cfg, max_tokens_per_rank=4), None).graph_safe
    assert NaiveMonolithicBackend.routes_gathered_logits
