"""Layers 1-2 (two gloo processes): a process group after a failed step, and a vote that a
peer never joins (`dbo.failures`, `dbo.vote`).

- A step that failed after collectives had started (one rank raised inside the model
  between dispatch and combine; its peer was left in a collective) leaves the group
  unusable: the next step on it (runner or bare layer), and a new layer built on it,
  raise `GroupUnusableError` in one line before issuing any collective, on every rank
  and every backend (`naive` used to abort the process in gloo, `a2a` and `a2a_ll` to
  wait for the timeout); a re-created group works.
- A step that every rank stopped at the vote (a rank's rejected inputs) leaves it usable.
- A rank that never calls the runner: its peer's vote fails in one line naming the vote,
  the group, its timeout and the likely cause, gloo's error kept as `__cause__`.
"""
from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import dbo
from dbo import DBOConfig, DBORunner, GroupUnusableError, PeerInputError
from dbo.failures import record_collectives
from moe import MoEConfig, MoELayer, init_moe_weights
from tests.dbo.test_failures import Injected, fail_in
from tests.dist_utils import run_distributed

pytestmark = pytest.mark.distributed

# The group's collective timeout: what frees the rank left waiting in the failed step.
TIMEOUT_S = 2.0
HIDDEN = 16


def ep_layer(group, backend: str) -> MoELayer:
    cfg = MoEConfig(num_experts=4, top_k=2, hidden_size=HIDDEN, intermediate_size=8,
                    max_tokens_per_rank=16 if backend == "a2a_ll" else None,
                    backend=backend, experts="reference")
    layer = MoELayer(cfg, group=group)
    layer.load_weights(init_moe_weights(cfg, seed=2))
    return layer


def attempt(call) -> dict:
    """Run `call`; what it raised (type, message, cause, seconds) and the collectives it
    noted on this rank."""
    start = time.monotonic()
    with record_collectives() as log:
        try:
            with torch.no_grad():
                call()
        except Exception as exc:  # noqa: BLE001 - reported to the test
            cause = exc.__cause__
            return {"type": type(exc).__name__, "message": str(exc), "issued": list(log),
                    "cause": None if cause is None else f"{type(cause).__name__}: {cause}",
                    "elapsed": time.monotonic() - start}
    return {"type": None, "issued": list(log)}


def reuse_after_failure(rank: int, world_size: int, backend: str, driver: str) -> dict:
    group = dbo.new_group(timeout_s=TIMEOUT_S)
    layer = ep_layer(group, backend)
    runner = DBORunner(layer, DBOConfig(split="tokens", min_decode_tokens=2), group=group)
    kernel = layer._kernel(torch.device("cpu"))
    real_apply = kernel.experts.apply
    if rank == 0:  # ubatch 1's experts: both ubatches have dispatched, none has combined
        kernel.experts.apply = fail_in(1, real_apply)
    x = torch.randn(12, HIDDEN, generator=torch.Generator().manual_seed(rank))
    if driver == "runner":
        failed = attempt(lambda: runner(x))
    else:  # a bare layer in a scheduler of its own: no runner notes the failure
        failed = attempt(lambda: dbo.UBatchScheduler("cpu").run(
            [lambda: layer(x[:6]), lambda: layer(x[6:])]))
    kernel.experts.apply = real_apply
    result = {"failed": failed, "runner": attempt(lambda: runner(x)),
              "layer": attempt(lambda: layer(x)),
              "new_layer": attempt(lambda: ep_layer(group, backend))}
    # Re-created on every rank: the same step runs, and matches the model without DBO.
    # (new_group waits up to its timeout for every rank: rank 1 may still be in its
    # failed step's collective for up to TIMEOUT_S.)
    dbo.destroy_group(group)
    fresh = dbo.new_group(timeout_s=60)
    layer = ep_layer(fresh, backend)
    runner = DBORunner(layer, DBOConfig(split="tokens", min_decode_tokens=2), group=fresh)
    with torch.no_grad():
        expected = layer(x)
        out = runner(x)
    result["split"] = runner.last_decision.split
    # Same weights and rows; only the summation order differs (each ubatch's GEMMs
    # block by its own row count): fp32 rounding, far below 1e-5.
    result["max_diff"] = (out - expected).abs().max().item()
    return result


@pytest.mark.parametrize("backend, driver", [("naive", "runner"), ("a2a", "runner"),
                                             ("a2a_ll", "runner"), ("a2a_ll", "layer")])
def test_a_group_reused_after_a_failed_step_refuses_in_one_line(backend, driver):
    results = run_distributed(2, reuse_after_failure, backend, driver)
    assert results[0]["failed"]["type"] == Injected.__name__, results[0]["failed"]
    # Rank 1 was left in the step's collectives: gloo's timeout (or rank 0 leaving the
    # group) freed it.
    assert results[1]["failed"]["type"] == "RuntimeError", results[1]["failed"]
    for rank, result in enumerate(results):
        for what in ("runner", "layer", "new_layer"):
            refused = result[what]
            assert refused["type"] == GroupUnusableError.__name__, (rank, what, refused)
            message = refused["message"]
            assert "\n" not in message and refused["issued"] == [], (rank, what, refused)
            assert refused["elapsed"] < 1.0, (rank, what, refused["elapsed"])
            assert "is unusable: a step failed on rank" in message, message
            assert f"timeout {TIMEOUT_S:g} s" in message and "dbo.new_group" in message
        # Each rank names its own failure: rank 0 its error, rank 1 gloo's (docs/errors.md
        # quotes rank 0's).
        own = ("a step failed on rank 0 (Injected: 'boom'), after collectives on it had "
               "started" if rank == 0 else "a step failed on rank 1 (RuntimeError: ")
        assert own in result["runner"]["message"], result["runner"]
        assert result["split"] and result["max_diff"] <= 1e-5, (rank, result)


class Checked(torch.nn.Module):
    """An MoE layer whose inputs the runner checks before the vote (`dbo_check_inputs`)."""

    def __init__(self, layer: MoELayer) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x_TH: torch.Tensor) -> torch.Tensor:
        return self.layer(x_TH)

    def dbo_check_inputs(self, x_TH: torch.Tensor) -> None:
        if x_TH.shape[-1] != HIDDEN:
            raise ValueError(f"rows of {x_TH.shape[-1]} values, expected {HIDDEN}")


def stop_at_the_vote(rank: int, world_size: int) -> dict:
    group = dbo.new_group(timeout_s=TIMEOUT_S)
    runner = DBORunner(Checked(ep_layer(group, "naive")),
                       DBOConfig(split="tokens", min_decode_tokens=2), group=group)
    x = torch.randn(12, HIDDEN, generator=torch.Generator().manual_seed(rank))
    # Rank 1's rows are too wide: it rejects them before the vote, and votes "not ok".
    bad = attempt(lambda: runner(torch.randn(12, HIDDEN + 1) if rank == 1 else x))
    with torch.no_grad():
        out = runner(x)
    return {"bad": bad, "split": runner.last_decision.split, "rows": out.shape[0]}


def test_a_step_stopped_at_the_vote_keeps_the_group_usable():
    results = run_distributed(2, stop_at_the_vote)
    assert results[0]["bad"]["type"] == PeerInputError.__name__, results[0]["bad"]
    assert results[1]["bad"]["type"] == "ValueError", results[1]["bad"]
    for result in results:
        assert result["split"] and result["rows"] == 12, result


def vote_without_a_peer(rank: int, world_size: int, peer: str) -> dict:
    group = dbo.new_group(timeout_s=TIMEOUT_S)
    layer = ep_layer(group, "a2a")
    store = dist.distributed_c10d._get_default_store()
    if rank == 1:
        if peer == "stays":  # connected, but never calls the runner: only the timeout
            # frees rank 0. Stay until it is done, at most 3 timeouts (then rank 0 is late).
            try:
                store.wait(["rank 0 done"], timedelta(seconds=3 * TIMEOUT_S))
            except RuntimeError:
                pass
        return {}  # "leaves": the ranks end and destroy their groups
    runner = DBORunner(layer, DBOConfig(split="tokens", min_decode_tokens=2), group=group)
    x = torch.randn(12, HIDDEN)
    result = {"vote": attempt(lambda: runner(x)), "next": attempt(lambda: runner(x))}
    store.set("rank 0 done", "1")
    return result


@pytest.mark.parametrize("peer", ["stays", "leaves"])
def test_a_peer_that_never_calls_the_runner_fails_the_vote_in_one_line(peer):
    result = run_distributed(2, vote_without_a_peer, peer)[0]
    vote = result["vote"]
    message = vote["message"]
    assert vote["type"] == "RuntimeError" and "\n" not in message, vote
    assert message.startswith("the DBO vote, the step's first collective (an all_reduce "
                              "over process group '"), message
    assert f"ranks [0, 1], gloo, timeout {TIMEOUT_S:g} s" in message
    assert "a rank of the group likely never called the runner for this step" in message
    assert vote["cause"].startswith("RuntimeError: "), vote["cause"]  # gloo's own error
    if peer == "stays":
        assert "), timed out: " in message and "Timed out" in vote["cause"]
        assert TIMEOUT_S * 0.9 <= vote["elapsed"] < TIMEOUT_S * 2.5, vote["elapsed"]
    else:
        assert "), failed (RuntimeError: " in message
    # This rank had issued the vote: the group refuses the next step.
    assert result["next"]["type"] == GroupUnusableError.__name__, result["next"]
    assert result["next"]["issued"] == []
