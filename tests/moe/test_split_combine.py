"""Layer 2 (two/three gloo processes): the split combine of the model's last MoE layer.

In a DBO step, the last ubatch of a `last_layer` MoE layer runs the experts on the rows
the other ranks sent (its own masked), queues the combine, then runs its own rows while
the combine is in flight. These tests check that order from the calls themselves and
that nothing else splits; the outputs against the reference are in test_moe_backends.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from dbo import UBatchScheduler
from moe.backends.base import OwnRows
from moe.config import MoEConfig
from moe.layer import MoELayer
from moe.reference import init_moe_weights
from tests.dist_utils import run_distributed

pytestmark = pytest.mark.distributed

CONFIG = MoEConfig(num_experts=6, top_k=2, hidden_size=8, intermediate_size=8,
                   max_tokens_per_rank=16)


class SpyExperts:
    """Wraps an expert kernel; logs (ubatch, rows given, rows with a valid id)."""

    def __init__(self, inner, log: list) -> None:
        self.inner, self.log = inner, log

    def apply(self, x_NH, w13_EIH, w2_EHI, topk_ids_NK, topk_weights_NK, *, workspace=None,
              **kwargs):
        from dbo.yield_points import dbo_current_ubatch_id
        valid = int((topk_ids_NK >= 0).any(dim=1).sum())
        self.log.append(("experts", dbo_current_ubatch_id(), x_NH.shape[0], valid))
        return self.inner.apply(x_NH, w13_EIH, w2_EHI, topk_ids_NK, topk_weights_NK,
                                workspace=workspace, **kwargs)


def call_order(rank: int, world_size: int, backend: str, split: bool, dbo: bool) -> list:
    """The experts calls and collectives, in issue order, of one step over two layers
    (the second marked last)."""
    import moe.backends.a2a as a2a_module
    import moe.backends.a2a_ll as a2a_ll_module
    from dbo.yield_points import dbo_current_ubatch_id

    cfg = dataclasses.replace(CONFIG, split_last_combine=split)
    layers = [MoELayer(dataclasses.replace(cfg, backend=backend, experts="reference"),
                       group=dist.group.WORLD, layer_id=i, last_layer=i == 1) for i in range(2)]
    log: list = []
    for layer in layers:
        layer.load_weights(init_moe_weights(cfg, seed=1))
        kernel = layer._kernel(torch.device("cpu"))
        kernel.experts = SpyExperts(kernel.experts, log)

    def note(name: str, group: object = None) -> None:
        log.append((name, dbo_current_ubatch_id()))

    a2a_module.note_collective = a2a_ll_module.note_collective = note
    torch.manual_seed(rank)
    x = torch.randn(10, 8)

    def stack(x_TH: torch.Tensor) -> torch.Tensor:
        for layer in layers:
            x_TH = x_TH + layer(x_TH)
        return x_TH

    with torch.no_grad():
        if dbo:
            UBatchScheduler("cpu").run([lambda: stack(x[:5]), lambda: stack(x[5:])])
        else:
            stack(x)
    return log


def split_and_whole(rank: int, world_size: int, backend: str) -> tuple[list, list]:
    """`call_order` of the same DBO step with the split on, then off."""
    return (call_order(rank, world_size, backend, True, True),
            call_order(rank, world_size, backend, False, True))


def events_of(log: list, ubatch: int) -> list:
    return [entry for entry in log if entry[1] == ubatch]


@pytest.mark.parametrize("backend", ["a2a", "a2a_ll"])
@pytest.mark.parametrize("world_size", [2, 3])
def test_last_ubatch_sends_other_ranks_rows_before_computing_its_own(backend, world_size):
    for rank, (split, whole) in enumerate(run_distributed(world_size, split_and_whole,
                                                          backend)):
        ub0, ub1 = events_of(split, 0), events_of(split, 1)
        # ubatch 0: per layer one experts call over all rows, between its two transfers.
        assert ub0 == events_of(whole, 0), (rank, ub0)
        assert [e[0] for e in ub0] == ["all_to_all_single", "experts",
                                       "all_to_all_single"] * 2, ub0
        # ubatch 1: layer 0 as ubatch 0; layer 1 splits: the experts on the rows from
        # other ranks (own masked), the combine's send, then the own rows only.
        assert [e[0] for e in ub1] == ["all_to_all_single", "experts", "all_to_all_single",
                                       "all_to_all_single", "experts", "all_to_all_single",
                                       "experts"], (rank, ub1)
        _, _, all_rows, valid_others = ub1[4]
        _, _, own_rows, valid_own = ub1[6]
        _, _, whole_rows, valid_whole = events_of(whole, 1)[4]
        assert all_rows == whole_rows and own_rows < all_rows, (rank, ub1)
        if backend == "a2a_ll":
            assert own_rows == CONFIG.max_tokens_per_rank
        # Every row with a valid id is computed once: masked in the first call exactly
        # where the second computes it.
        assert valid_others + valid_own == valid_whole, (rank, ub1, events_of(whole, 1))


@pytest.mark.parametrize("split,dbo", [(False, True), (True, False)])
def test_no_split_when_switched_off_or_outside_dbo(split, dbo):
    for log in run_distributed(2, call_order, "a2a_ll", split, dbo):
        experts = [e for e in log if e[0] == "experts"]
        assert len(experts) == (4 if dbo else 2), log
        assert all(rows == 2 * CONFIG.max_tokens_per_rank for _, _, rows, _ in experts)


def naive_last_layer(rank: int, world_size: int) -> int:
    layer = MoELayer(dataclasses.replace(CONFIG, backend="naive", experts="reference"),
                     group=dist.group.WORLD, last_layer=True)
    layer.load_weights(init_moe_weights(CONFIG, seed=1))
    calls: list = []
    kernel = layer._kernel(torch.device("cpu"))
    kernel.experts = SpyExperts(kernel.experts, calls)
    x = torch.randn(6, 8)
    with torch.no_grad():
        UBatchScheduler("cpu").run([lambda: layer(x[:3]), lambda: layer(x[3:])])
    return len(calls)


def test_backends_without_own_rows_never_split():
    """naive cannot split its combine: a last layer under DBO runs as any other."""
    assert run_distributed(2, naive_last_layer) == [2, 2]
    backend = MoELayer(dataclasses.replace(CONFIG, backend="naive")).backend
    assert backend.own_rows(None) is None
    with pytest.raises(ValueError, match="cannot split its combine"):
        backend.refuse_split(OwnRows(slice(0, 1)))


def test_own_rows_not_handed_over_is_an_error():
    with pytest.raises(RuntimeError, match="not handed over"):
        OwnRows(slice(0, 4)).take()
