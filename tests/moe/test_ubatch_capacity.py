"""Layer 2 (two gloo processes): `A2ALLOptions.max_tokens_per_ubatch`, a2a_ll's capacity of
one ubatch of a DBO step.

Each ubatch's exchange sends slots of the ubatch capacity (not the step's), the outputs
equal the unsplit step's, and a split step whose largest ubatch exceeds it stops every
rank before any collective, naming the field.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dbo import DBOConfig, DBORunner
from moe.backends.a2a_ll import A2ALLOptions
from moe.config import MoEConfig
from moe.layer import MoELayer
from moe.reference import init_moe_weights
from tests.dist_utils import run_distributed

pytestmark = pytest.mark.distributed

CONFIG = MoEConfig(num_experts=4, top_k=2, hidden_size=8, intermediate_size=8,
                   backend="a2a_ll", experts="reference", max_tokens_per_rank=16,
                   backend_options=A2ALLOptions(max_tokens_per_ubatch=8))


def _model(cfg: MoEConfig) -> nn.Module:
    layers = [MoELayer(cfg, group=dist.group.WORLD, layer_id=i, last_layer=i == 1)
              for i in range(2)]
    for i, layer in enumerate(layers):
        layer.load_weights(init_moe_weights(cfg, seed=5 + i))
    return nn.Sequential(*layers)


def exchanges(rank: int, world_size: int) -> dict:
    model = _model(CONFIG)
    runner = DBORunner(model, DBOConfig(split="tokens", min_prefill_tokens=2,
                                        min_decode_tokens=2))
    torch.manual_seed(rank)
    x = torch.randn(12 + 4 * rank, 8)  # ubatches of 6 and 8 tokens
    out: dict = {}
    with torch.no_grad(), ExchangeRows() as spy:
        whole = model(x)
        out["unsplit_rows"] = spy.take()
        split = runner(x)
        out["split"] = runner.last_decision.split
        out["split_rows"] = spy.take()
    out["equal"] = torch.allclose(split, whole, rtol=1e-5, atol=1e-6)
    # A ubatch capacity of 6: rank 1's 14 tokens split into ubatches of 7.
    small = _model(dataclasses.replace(
        CONFIG, backend_options=A2ALLOptions(max_tokens_per_ubatch=6)))
    overflow = DBORunner(small, DBOConfig(split="tokens", min_prefill_tokens=2,
                                          min_decode_tokens=2))
    try:
        with torch.no_grad():
            overflow(torch.randn(12 if rank == 0 else 14, 8))  # rank 1: ubatches of 7
        out["overflow"] = "no error"
    except ValueError as exc:
        out["overflow"] = str(exc)
    return out


class ExchangeRows:
    """Within: the input rows of every a2a_ll `all_to_all_single`, in order (`rows`)."""

    def __init__(self) -> None:
        self.rows: list[int] = []

    def __enter__(self) -> "ExchangeRows":
        import moe.backends.a2a_ll as a2a_ll_module
        self.module = a2a_ll_module.dist
        self.saved = original = self.module.all_to_all_single

        def spy(out, inp, *args, **kwargs):
            self.rows.append(inp.shape[0])
            return original(out, inp, *args, **kwargs)

        self.module.all_to_all_single = spy
        return self

    def __exit__(self, *exc) -> None:
        self.module.all_to_all_single = self.saved

    def take(self) -> list[int]:
        """The rows so far, then start again."""
        rows, self.rows = self.rows, []
        return rows


def test_a2a_ll_ubatches_exchange_their_own_capacity_and_match_the_unsplit_step():
    for rank, out in enumerate(run_distributed(2, exchanges)):
        assert out["split"] and out["equal"], (rank, out)
        # Two layers, a dispatch and a combine each: 2 ranks x C slot rows per exchange.
        assert out["unsplit_rows"] == [2 * 16] * 4, out
        assert out["split_rows"] == [2 * 8] * 8, out
        assert "has 7 tokens in one model call this step (its largest ubatch" in \
            out["overflow"], (rank, out["overflow"])
        assert "more than the model's capacity max_tokens_per_ubatch=6" in out["overflow"]
