"""Layers 1 (CPU) and 2 (two gloo processes): the combine by expert group of `a2a_ll` in
single-batch overlap (`A2ALLOptions.combine_groups`).

Layer 1: the group masks (every local id in exactly one group), the grouped buffer's
row map and the options' validation. Layer 2: an SBO step with 1, 2, 4 and 8 groups (8:
one expert each) equals the layer without overlap (fp32; each group's partial output is
summed at the source instead of inside the experts, so within rounding: 1e-5 as
test_combine_chunks), with a rank of no tokens, all tokens on one expert, shared experts
on and off; each expert's weights are used in one experts call only (read once); the
order of experts calls, collectives and stream events in one SBO step; DBO steps keep
the ungrouped path.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from dbo import UBatchScheduler
from moe.backends.a2a_ll import A2ALLOptions, expert_group_ids, grouped_slots
from tests.dist_utils import run_distributed
from tests.moe.test_combine_chunks import BASE, CAPACITY, SCENARIOS, TO_COMM, SENT, make_layer


# -- Layer 1: masks, the row map, the options ------------------------------------------

@pytest.mark.parametrize("num_experts,num_groups", [(8, 1), (8, 3), (8, 8), (5, 2)])
def test_every_local_id_is_kept_by_exactly_one_group(num_experts, num_groups):
    ids_RK = torch.tensor([[e, -1] for e in range(num_experts)] + [[-1, -1]])
    kept = [expert_group_ids(ids_RK, g, num_groups=num_groups, num_experts=num_experts)
            for g in range(num_groups)]
    for e in range(num_experts):
        owners = [g for g, ids in enumerate(kept) if (ids == e).any()]
        assert len(owners) == 1, (e, owners)
    # groups are contiguous ranges in order, and -1 stays -1
    firsts = [int(ids[ids >= 0].min()) for ids in kept if (ids >= 0).any()]
    assert firsts == sorted(firsts)
    assert all((ids[-1] == -1).all() for ids in kept)


def test_grouped_slots_read_each_group_s_copy_of_a_slot_rank_by_rank():
    rows, num_groups = 6, 3
    slot_TW = torch.tensor([[0, 4], [2, -1], [-1, 5]])
    sel = grouped_slots(slot_TW, num_groups=num_groups, rows=rows)
    assert sel.tolist() == [[0, 6, 12, 4, 10, 16],
                            [2, 8, 14, -1, -1, -1],
                            [-1, -1, -1, 5, 11, 17]]
    # a rank that sent no tokens: an empty map of the same width
    empty = grouped_slots(slot_TW[:0], num_groups=num_groups, rows=rows)
    assert empty.shape == (0, 2 * num_groups)


@pytest.mark.parametrize("options,match", [
    (dict(combine_groups=0), "combine_groups=0: must be a positive int"),
    (dict(combine_groups=True), "combine_groups=True: must be a positive int"),
    (dict(combine_groups=2.0), "combine_groups=2.0: must be a positive int"),
    (dict(combine_groups=2, combine_chunks=2), "by expert group or by row chunk, not both"),
])
def test_bad_group_counts_are_refused(options, match):
    with pytest.raises(ValueError, match=match):
        A2ALLOptions(**options)


def test_more_groups_than_experts_is_refused():
    with pytest.raises(ValueError, match="combine_groups=9 exceeds MoEConfig.num_experts=8"):
        replace(BASE, backend_options=A2ALLOptions(combine_groups=9))


# -- Layer 2: outputs, weights read once, order ----------------------------------------

def sbo_errors(rank: int, world_size: int, device: str = "cpu") -> dict[str, float]:
    """max |SBO with groups - no overlap| per scenario and group count."""
    torch.manual_seed(200 + rank)
    errors = {}
    for name, (overrides, tokens) in SCENARIOS.items():
        x = torch.randn(tokens[rank], BASE.hidden_size).to(device)
        with torch.no_grad():
            want = make_layer(overrides, device=device)(x)
            for groups in (1, 2, 4):
                layer = make_layer({**overrides, "backend_options":
                                    A2ALLOptions(combine_groups=groups)}, device=device)
                (out,) = UBatchScheduler(device).run([lambda: layer(x)])
                assert out.shape == x.shape
                errors[f"{name}/groups={groups}"] = (
                    (out - want).abs().max().item() if out.numel() else 0.0)
    return errors


@pytest.mark.distributed
def test_sbo_with_groups_equals_no_overlap():
    for rank, errors in enumerate(run_distributed(2, sbo_errors)):
        assert len(errors) == len(SCENARIOS) * 3
        for case, error in errors.items():
            assert error <= 1e-5, f"rank {rank} {case}: SBO differs by {error}"


@pytest.mark.gpu
@pytest.mark.multigpu
def test_sbo_with_groups_equals_no_overlap_over_nccl():
    """The same on two GPUs: each group's collective runs on the comm stream, under the
    next group's experts on the compute stream (bf16 would round each partial: fp32)."""
    for rank, errors in enumerate(run_distributed(2, sbo_errors, "cuda", backend="nccl")):
        for case, error in errors.items():
            assert error <= 1e-5, f"rank {rank} {case}: SBO differs by {error}"


def step_log(rank: int, world_size: int, groups: int, mode: str) -> list[tuple]:
    """Experts calls (rows given, and the local experts they route to), collectives and
    stand-in stream events of one layer's step: `mode` "sbo" (one ubatch) or "dbo"."""
    import moe.backends.a2a_ll as a2a_ll_module

    layer = make_layer(dict(num_shared_experts=1,
                            backend_options=A2ALLOptions(combine_groups=groups)))
    log: list[tuple] = []
    a2a_ll_module.note_collective = lambda name, group=None: log.append((name,))
    layer.shared_experts.register_forward_hook(lambda *_: log.append(("shared",)))
    kernel = layer._kernel(torch.device("cpu"))
    apply = kernel.experts.apply

    def spy_apply(x_NH, w13, w2, ids_NK, *args, **kwargs):
        log.append(("experts", x_NH.shape[0], tuple(sorted(set(ids_NK[ids_NK >= 0].tolist())))))
        return apply(x_NH, w13, w2, ids_NK, *args, **kwargs)

    kernel.experts.apply = spy_apply
    torch.manual_seed(rank)
    x = torch.randn(CAPACITY, BASE.hidden_size)  # every local expert gets rows
    with torch.no_grad():
        fns = [lambda: layer(x)] if mode == "sbo" else [lambda: layer(x[:8]),
                                                         lambda: layer(x[8:])]
        UBatchScheduler("cpu", log=log).run(fns)
    return log


@pytest.mark.distributed
@pytest.mark.parametrize("groups", [2, 4])
def test_each_group_s_experts_run_once_and_its_combine_goes_before_the_next(groups):
    local = BASE.num_experts // 2
    rows = 2 * CAPACITY  # every slot row of both ranks, in every group
    for rank, log in enumerate(run_distributed(2, step_log, groups, "sbo")):
        calls = [e for e in log if e[0] == "experts"]
        assert [c[1] for c in calls] == [rows] * groups, (rank, calls)
        # weights read once: each local expert's rows are in exactly one call, group g's
        per_call = [set(c[2]) for c in calls]
        for g, experts in enumerate(per_call):
            assert experts <= set(range(g * local // groups, (g + 1) * local // groups))
        assert sorted(e for s in per_call for e in s) == list(range(local)), (rank, per_call)
        want = [*TO_COMM, *SENT, ("shared",), ("wait", "compute", "comm_done[0]")]
        for call in calls:
            want += [call, *TO_COMM, *SENT]
        want += [("wait", "compute", "comm_done[0]")]
        assert log == want, (rank, log)


def ungrouped_dbo(rank: int, world_size: int) -> bool:
    strip = lambda log: [e[:2] for e in log]  # noqa: E731
    return strip(step_log(rank, world_size, 4, "dbo")) == strip(step_log(rank, world_size, 1,
                                                                         "dbo"))


@pytest.mark.distributed
def test_dbo_steps_keep_the_ungrouped_combine():
    assert run_distributed(2, ungrouped_dbo) == [True, True]
