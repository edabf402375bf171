"""Layers 1 (CPU) and 2 (two gloo processes): the chunked combine of `a2a_ll` in
single-batch overlap (`A2ALLOptions.combine_chunks`).

Layer 1: the chunk plan's index maps (every slot row lands in exactly one row of the
chunked buffer, and the remap reads it back) and the config's validation. Layer 2: an
SBO step with 1, 2 and 4 chunks equals the layer without overlap (fp32; the experts see
other row groups, so within rounding, 1e-5 as test_sbo), with a rank of no tokens, all
tokens on one expert, shared experts on and off; the order of experts calls,
collectives and stream events in one SBO step (stand-in streams' log); DBO steps and
calls outside a step keep the unchunked path.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from dbo import UBatchScheduler
from moe.backends.a2a_ll import A2ALLOptions
from moe.backends.combine_chunks import plan_combine_chunks
from moe.config import MoEConfig
from moe.layer import MoELayer
from moe.reference import init_moe_weights
from moe.shared import SharedExperts
from tests.dist_utils import run_distributed

CAPACITY = 16
BASE = MoEConfig(num_experts=8, top_k=2, hidden_size=16, intermediate_size=8,
                 max_tokens_per_rank=CAPACITY, experts="reference", backend="a2a_ll")


# -- Layer 1: the plan and the config -------------------------------------------------

@pytest.mark.parametrize("world_size,capacity,num_chunks", [
    (2, 16, 1), (2, 16, 4), (3, 5, 2), (3, 7, 3), (4, 3, 3)])
def test_chunk_plan_moves_every_slot_row_once(world_size, capacity, num_chunks):
    rows = world_size * capacity
    recv_XH = torch.arange(rows, dtype=torch.float32)[:, None] + 1  # row s holds s + 1
    for rank in range(world_size):
        plan = plan_combine_chunks(world_size=world_size, rank=rank, capacity=capacity,
                                   num_chunks=num_chunks, device=torch.device("cpu"))
        assert len(plan.chunks) == num_chunks
        # What the collectives do for the rows of this buffer: chunk i's rows land in
        # its output range, each peer's in rank order; the own block at the end.
        chunked_XH = torch.zeros_like(recv_XH)
        for chunk in plan.chunks:
            assert chunk.splits[rank] == 0 and sum(chunk.splits) == chunk.rows_N.numel()
            chunked_XH[chunk.out_rows] = recv_XH[chunk.rows_N]
        chunked_XH[plan.own_out_rows] = recv_XH[plan.own_rows]
        sent = torch.cat([c.rows_N for c in plan.chunks]
                         + [torch.arange(rows)[plan.own_rows]])
        assert sorted(sent.tolist()) == list(range(rows)), "every row exactly once"
        slot_TW = torch.tensor([[s, -1] for s in range(rows)])
        remapped = plan.remap(slot_TW)
        assert torch.equal(chunked_XH[remapped[:, 0]], recv_XH), (rank, remapped)
        assert (remapped[:, 1] == -1).all()


@pytest.mark.parametrize("value,error,match", [
    (0, ValueError, "positive int"), (-2, ValueError, "positive int"),
    (True, ValueError, "positive int"), (2.0, ValueError, "positive int"),
    (CAPACITY + 1, ValueError, f"at most {CAPACITY} chunks")])
def test_bad_chunk_count_is_refused(value, error, match):
    with pytest.raises(error, match=match):
        replace(BASE, backend_options=A2ALLOptions(combine_chunks=value))


def test_chunk_count_without_a_capacity_is_accepted():
    assert replace(BASE, max_tokens_per_rank=None, backend_options=A2ALLOptions(
        combine_chunks=64)).options.combine_chunks == 64


# -- Layer 2: outputs and order in a step ---------------------------------------------

def _all_on_expert_five(logits_TE: torch.Tensor, top_k: int
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    shape, device = (logits_TE.shape[0], top_k), logits_TE.device
    return (torch.ones(shape, device=device),
            torch.full(shape, 5, dtype=torch.int64, device=device))


# name: (MoEConfig overrides, tokens per rank)
SCENARIOS = {
    "basic": (dict(), (13, 7)),
    "shared_experts": (dict(num_shared_experts=1), (11, 5)),
    "rank_with_no_tokens": (dict(num_shared_experts=1), (0, 9)),
    "full_capacity": (dict(), (CAPACITY, 3)),
    "one_expert": (dict(top_k=1, custom_routing_function=_all_on_expert_five), (12, 6)),
}


def make_layer(overrides: dict, *, last_layer: bool = False, device: str = "cpu"
               ) -> MoELayer:
    overrides = dict(overrides)
    chunks = overrides.pop("combine_chunks", None)
    if chunks is not None:
        overrides["backend_options"] = A2ALLOptions(combine_chunks=chunks)
    cfg = replace(BASE, **overrides)
    layer = MoELayer(cfg, group=dist.group.WORLD, last_layer=last_layer)
    layer.load_weights(init_moe_weights(cfg, seed=7))
    if layer.shared_experts is not None:
        layer.shared_experts.load_state_dict(SharedExperts.from_config(cfg, seed=3).state_dict())
    return layer.to(device)


def sbo_errors(rank: int, world_size: int, device: str = "cpu") -> dict[str, float]:
    """max |SBO - no overlap| per scenario, chunk count and last_layer."""
    torch.manual_seed(100 + rank)
    errors = {}
    for name, (overrides, tokens) in SCENARIOS.items():
        x = torch.randn(tokens[rank], BASE.hidden_size).to(device)
        with torch.no_grad():
            want = make_layer(overrides, device=device)(x)
            for chunks in (1, 2, 4):
                for last in (False, True):
                    layer = make_layer({**overrides, "combine_chunks": chunks},
                                       last_layer=last, device=device)
                    (out,) = UBatchScheduler(device).run([lambda: layer(x)])
                    assert out.shape == x.shape
                    errors[f"{name}/chunks={chunks}/last={last}"] = (
                        (out - want).abs().max().item() if out.numel() else 0.0)
    return errors


@pytest.mark.distributed
def test_sbo_with_chunks_equals_no_overlap():
    for rank, errors in enumerate(run_distributed(2, sbo_errors)):
        assert len(errors) == len(SCENARIOS) * 3 * 2
        for case, error in errors.items():
            assert error <= 1e-5, f"rank {rank} {case}: SBO differs by {error}"


@pytest.mark.gpu
@pytest.mark.multigpu
def test_sbo_with_chunks_equals_no_overlap_over_nccl():
    """The same on two GPUs: the chunks' collectives really run on the comm stream,
    under the next chunk's experts on the compute stream."""
    for rank, errors in enumerate(run_distributed(2, sbo_errors, "cuda", backend="nccl")):
        assert len(errors) == len(SCENARIOS) * 3 * 2
        for case, error in errors.items():
            assert error <= 1e-5, f"rank {rank} {case}: SBO differs by {error}"


def step_log(rank: int, world_size: int, chunks: int, mode: str) -> list[tuple]:
    """Experts calls (rows given), collectives and stand-in stream events of one layer's
    step, in issue order: `mode` "sbo" (one ubatch), "dbo" (two) or "none" (no step)."""
    import moe.backends.a2a_ll as a2a_ll_module

    layer = make_layer(dict(num_shared_experts=1, combine_chunks=chunks))
    log: list[tuple] = []
    a2a_ll_module.note_collective = lambda name, group=None: log.append((name,))
    layer.shared_experts.register_forward_hook(lambda *_: log.append(("shared",)))
    kernel = layer._kernel(torch.device("cpu"))
    apply = kernel.experts.apply

    def spy_apply(x_NH, *args, **kwargs):
        log.append(("experts", x_NH.shape[0]))
        return apply(x_NH, *args, **kwargs)

    kernel.experts.apply = spy_apply
    x = torch.randn(6 + rank, BASE.hidden_size)
    with torch.no_grad():
        if mode == "none":
            layer(x)
        else:
            fns = [lambda: layer(x)] if mode == "sbo" else [lambda: layer(x[:3]),
                                                             lambda: layer(x[3:])]
            UBatchScheduler("cpu", log=log).run(fns)
    return log


TO_COMM = [("record", "compute_done[0]", "compute"), ("wait", "comm", "compute_done[0]")]
SENT = [("all_to_all_single",), ("record", "comm_done[0]", "comm")]


@pytest.mark.distributed
@pytest.mark.parametrize("chunks", [2, 4])
def test_each_chunk_is_sent_before_the_next_chunks_experts(chunks):
    rows = CAPACITY // chunks  # slot rows of the one peer per chunk
    want = [*TO_COMM, *SENT, ("shared",), ("wait", "compute", "comm_done[0]")]
    for _ in range(chunks):
        want += [("experts", rows), *TO_COMM, *SENT]
    # The own block last, under the last chunk's transfer; then the sum waits for it.
    want += [("experts", CAPACITY), ("wait", "compute", "comm_done[0]")]
    for rank, log in enumerate(run_distributed(2, step_log, chunks, "sbo")):
        assert log == want, (rank, log)


def unchunked_paths(rank: int, world_size: int) -> list[bool]:
    """Whether 4 chunks leave each of these as with 1: one chunk in SBO, a DBO step,
    a call outside a step."""
    return [step_log(rank, world_size, 4, mode) == step_log(rank, world_size, 1, mode)
            for mode in ("dbo", "none")] + [
        [e for e in step_log(rank, world_size, 1, "sbo") if e[0] == "experts"]
        == [("experts", 2 * CAPACITY), ("experts", CAPACITY)]]


@pytest.mark.distributed
def test_dbo_steps_and_one_chunk_keep_the_unchunked_combine():
    assert run_distributed(2, unchunked_paths) == [[True, True, True]] * 2
