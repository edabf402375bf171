"""Layer 2 (two gloo processes): the cross-rank split vote, alone and through DBORunner.

The in-process tests at the end check the no-process-group path (layer 1).
"""
from __future__ import annotations

import dataclasses

from typing import Any

import pytest
import torch
import torch.distributed as dist

from dbo.agreement import PeerInputError
from dbo.config import DBOConfig
from dbo.runner import DBORunner
from dbo.split import plan_token_split
from dbo.vote import apply_vote, vote_device, vote_split
from dbo.yield_points import dbo_yield
from tests.dist_utils import run_distributed

CONFIG = DBOConfig(min_decode_tokens=16)


class CollectiveModel:
    """Row-wise model that all-reduces each call's row count, as an MoE layer's
    dispatch would: the ranks' ubatches must meet in the same collectives."""

    def __init__(self) -> None:
        self.counts: list[int] = []

    def __call__(self, x: torch.Tensor, seq_lens: Any = None) -> torch.Tensor:
        y = x * 2 + 1
        dbo_yield()
        count = torch.tensor([x.shape[0]])
        dist.all_reduce(count)
        self.counts.append(int(count.item()))
        dbo_yield()
        return y.tanh()

    def dbo_can_split_inside_request(self) -> bool:
        return True  # every row is computed on its own


def _vote_worker(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {"device": str(vote_device())}
    out["disagree"] = vote_split(rank == 0)
    out["agree"] = vote_split(True)
    out["none"] = vote_split(False)
    group = dist.new_group([0, 1])
    out["group"] = vote_split(rank == 1, group)

    plan = apply_vote(plan_token_split(64 if rank == 0 else 4, CONFIG))
    out["plan"] = (plan.split, plan.vetoed, plan.reason, plan.num_tokens)

    # Through the runner: one rank below the threshold, both above, one empty.
    torch.manual_seed(rank)
    model = CollectiveModel()
    runner = DBORunner(model, CONFIG)
    steps = []
    for num_tokens in ((64, 4), (40, 33), (0, 40)):
        n = num_tokens[rank]
        x = torch.randn(n, 8)
        y = runner(x)
        d = runner.last_decision
        steps.append((d.split, d.vetoed, d.reason, d.num_tokens, list(model.counts),
                      torch.equal(y, (x * 2 + 1).tanh())))
        model.counts.clear()
    requests = DBORunner(model, DBOConfig(split="requests", min_prefill_tokens=20))
    lens = [[30, 10], [5, 5]][rank]
    y = requests(torch.ones(sum(lens), 8), seq_lens=lens)
    d = requests.last_decision
    steps.append((d.split, d.vetoed, d.reason, d.num_tokens, list(model.counts),
                  torch.equal(y, torch.full((sum(lens), 8), 3.0).tanh())))
    out["steps"] = steps

    # Bad input on rank 1: it still votes ("not ok"), so both stop in the vote.
    plain = DBORunner(lambda x, seq_lens: x * 2, DBOConfig(split="requests",
                                                             min_prefill_tokens=0))
    try:
        plain(torch.ones(40, 2), seq_lens=[20, 20] if rank == 0 else [20, 21])
        out["bad_input"] = (plain.last_decision.split, plain.last_decision.vetoed)
    except (ValueError, PeerInputError) as exc:
        out["bad_input"] = f"{type(exc).__name__}: {exc}"
    return out


@pytest.mark.distributed
def test_vote_and_runner_on_two_ranks() -> None:
    r0, r1 = run_distributed(2, _vote_worker)
    assert r0["device"] == "cpu"  # gloo votes on the CPU
    for key, expected in (("disagree", False), ("agree", True), ("none", False),
                          ("group", False)):
        assert r0[key] is expected and r1[key] is expected, key

    split0, vetoed0, reason0, tokens0 = r0["plan"]
    split1, vetoed1, reason1, _ = r1["plan"]
    assert not split0 and not split1
    assert vetoed0 and "peer rank vetoed" in reason0 and tokens0 == (64,)
    assert not vetoed1 and reason1 == "4 tokens < min_decode_tokens=16 (decode)"

    s0, s1 = r0["steps"], r1["steps"]
    assert all(step[5] for step in s0 + s1), "DBO output differs from the model's"
    # 64 vs 4 tokens: rank 1 is below the threshold and vetoes rank 0.
    assert (s0[0][0], s1[0][0]) == (False, False)
    assert s0[0][1] and "peer rank vetoed" in s0[0][2] and not s1[0][1]
    assert s0[0][4] == s1[0][4] == [68]  # one unsplit call each
    # 40 vs 33: both split; ubatch k of each rank meets ubatch k of the other.
    assert (s0[1][0], s1[1][0]) == (True, True)
    assert s0[1][3] == (20, 20) and s1[1][3] == (16, 17)
    assert s0[1][4] == s1[1][4] == [36, 37]
    # 0 tokens still votes (and vetoes): nobody splits, nothing hangs.
    assert (s0[2][0], s1[2][0]) == (False, False)
    assert "0 tokens" in s0[2][2] and s1[2][1]
    # requests mode, 40 vs 10 tokens with min_prefill_tokens=20: rank 1 vetoes.
    assert (s0[3][0], s1[3][0]) == (False, False) and s0[3][1]
    assert s0[3][4] == s1[3][4] == [50]

    assert r0["bad_input"].startswith("PeerInputError: rank 1 of the group rejected")
    assert r1["bad_input"].startswith("ValueError: seq_lens sum to 41 tokens but the batch "
                                      "has 40")


def test_vote_without_process_group() -> None:
    assert not dist.is_initialized()
    assert vote_split(True) is True and vote_split(False) is False
    plan = plan_token_split(64, CONFIG)
    # Unchanged but for the group's largest token count: with no group, this rank's own.
    assert apply_vote(plan) == dataclasses.replace(plan, group_max_tokens=64)
    with pytest.raises(RuntimeError, match="not initialised"):
        vote_split(True, object())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="must be a bool"):
        vote_split(1)  # type: ignore[arg-type]


def _twin_worker(rank: int, world_size: int) -> dict[str, Any]:
    from dbo.groups import new_group, twin_group

    world = dist.group.WORLD
    sub = new_group([0, 1], timeout_s=30)
    twin = twin_group(world, backend="gloo")
    return {"distinct": twin is not world, "cached": twin_group(world, backend="gloo") is twin,
            "size": dist.get_world_size(twin), "subgroup": twin_group(sub) is None,
            "vote": vote_split(rank != 2)}


@pytest.mark.distributed
def test_twin_groups() -> None:
    for out in run_distributed(3, _twin_worker):
        assert out == {"distinct": True, "cached": True, "size": 3, "subgroup": True,
                       "vote": False}, out


def _device_vote_worker(rank: int, world_size: int) -> dict[str, Any]:
    from dbo.vote import vote_step

    vote_step(True, 1, dist.group.WORLD)  # the side communicator's lazy set-up
    torch.cuda.synchronize()
    # ~0.5 s of GPU sleep on the compute stream: the vote must not wait for it.
    torch.cuda._sleep(1_000_000_000)
    both = vote_step(True, 10 + rank, dist.group.WORLD)
    busy = not torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    return {"both": both, "one": vote_step(rank == 0, 5, dist.group.WORLD),
            "busy_after_vote": busy}


@pytest.mark.gpu
@pytest.mark.multigpu
def test_device_vote_agrees_without_waiting_for_the_compute_stream() -> None:
    for out in run_distributed(2, _device_vote_worker, backend="nccl"):
        assert out["both"] == (True, 11) and out["one"] == (False, 5), out
        assert out["busy_after_vote"], out
