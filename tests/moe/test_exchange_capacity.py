"""Layer 1 (CPU) and Layer 2 (two gloo processes): `moe.backends.capacity.exchange_capacity`,
a smaller a2a_ll exchange for calls known to hold fewer tokens than the capacity.

Within it every exchange sends slots of its size (a DBO ubatch's: `tokens_per_ubatch`),
unsplit, in a DBO step (whose greenlets see the caller's context) and in a chunked
single-batch-overlap combine, with the outputs of the full-capacity exchange; a rank with
more tokens than it allows raises naming it; outside it the configured capacity is back.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from dbo import DBOConfig, DBORunner
from moe.backends.capacity import ExchangeCapacity, exchange_capacity, step_capacity
from tests.dist_utils import run_distributed
from tests.moe.test_ubatch_capacity import CONFIG, ExchangeRows, _model


def test_step_capacity_is_the_smaller_and_checks_the_tokens() -> None:
    assert step_capacity(16, ubatch=False, num_tokens=9, backend="a2a_ll") == 16
    with exchange_capacity(6, 4):
        assert step_capacity(16, ubatch=False, num_tokens=6, backend="a2a_ll") == 6
        assert step_capacity(8, ubatch=True, num_tokens=4, backend="a2a_ll") == 4
        assert step_capacity(3, ubatch=True, num_tokens=3, backend="a2a_ll") == 3
        with pytest.raises(ValueError, match=r"7 tokens on this rank exceed the "
                                             r"exchange_capacity\(tokens_per_rank=6\)"):
            step_capacity(16, ubatch=False, num_tokens=7, backend="a2a_ll")
    assert step_capacity(16, ubatch=False, num_tokens=9, backend="a2a_ll") == 16
    with exchange_capacity(5) as value:
        assert value == ExchangeCapacity(5, 5)
    for bad in (0, -1, True, 2.0):
        with pytest.raises(ValueError, match="must be a positive int"):
            ExchangeCapacity(bad, 1)


def _exchanges(rank: int, world_size: int) -> dict:
    model = _model(CONFIG)  # capacity 16, ubatch capacity 8
    runner = DBORunner(model, DBOConfig(split="tokens", min_prefill_tokens=2,
                                        min_decode_tokens=2))
    torch.manual_seed(rank)
    x = torch.randn(5 + rank, 8)  # ubatches of at most 3 tokens
    out: dict = {}
    with torch.no_grad(), ExchangeRows() as spy:
        whole = model(x)
        full_rows = spy.take()
        with exchange_capacity(6, 3):
            small = model(x)
            out["unsplit_rows"] = spy.take()
            split = runner(x)
            out["split"] = runner.last_decision.split
            out["split_rows"] = spy.take()
        model(x)
        out["after_rows"] = spy.take()
    out["full_rows"] = full_rows
    out["equal"] = (torch.allclose(small, whole, rtol=1e-5, atol=1e-6)
                    and torch.allclose(split, whole, rtol=1e-5, atol=1e-6))
    # Single-batch overlap with a chunked combine: the chunks follow the smaller slots.
    chunked = _model(dataclasses.replace(
        CONFIG, backend_options=dataclasses.replace(CONFIG.options, combine_chunks=2)))
    sbo = DBORunner(chunked, DBOConfig(overlap="sbo", min_prefill_tokens=2,
                                       min_decode_tokens=2))
    with torch.no_grad():
        reference = chunked(x)
        with exchange_capacity(6, 3):
            out["sbo_equal"] = torch.allclose(sbo(x), reference, rtol=1e-5, atol=1e-6)
    try:
        with torch.no_grad(), exchange_capacity(4):
            model(x)  # 5 and 6 tokens: over it on both ranks, before any collective
        out["over"] = "ran"
    except ValueError as exc:
        out["over"] = str(exc)
    dist.barrier()
    return out


@pytest.mark.distributed
def test_a2a_ll_exchanges_the_smaller_slots_with_the_same_outputs() -> None:
    for rank, out in enumerate(run_distributed(2, _exchanges)):
        assert out["equal"] and out["split"] and out["sbo_equal"], (rank, out)
        # Two layers, a dispatch and a combine each: 2 ranks x slot rows per exchange.
        assert out["full_rows"] == out["after_rows"] == [2 * 16] * 4, out
        assert out["unsplit_rows"] == [2 * 6] * 4, out
        assert out["split_rows"] == [2 * 3] * 8, out
        assert "exceed the exchange_capacity(tokens_per_rank=4)" in out["over"], out
