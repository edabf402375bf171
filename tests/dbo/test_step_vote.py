"""Layers 1-2: what a runner's step votes besides the model's fields (`dbo.step_vote`),
and the checks of a step with DBO off.

Layer 1 (CPU): the calibration's digest, the token limit, a disabled runner's plan (the
split mode's checks, its tokens), out-of-vocabulary token ids on CPU.
Layer 2 (two gloo processes): ranks given different calibrations, SBO blockers or token
limits raise `ConfigMismatchError` naming the field on every rank (before, a chunked SBO
combine on one rank and a plain one on the other aborted the process in gloo); a token
limit exceeded on one rank, and every rejected input with DBO off (bad seq_lens, dtype,
capacity, out-of-vocabulary ids, a bare MoE layer's input), stop every rank at the vote,
quickly, and the next step runs; a bare MoE layer called without a runner says that its
peers were not told.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import pytest
import torch

import dbo
from dbo import DBOConfig, DBORunner
from dbo.calibration import Calibration, MeasuredPoint
from dbo.step_vote import TokenLimit, calibration_digest, current_token_limit, step_token_limit
from moe.backends.capacity import exchange_capacity
from moe.models.transformer import make_batch
from tests.dbo.test_agreement import (GROUP_TIMEOUT_S, NEXT_STEP_RUNS, QUICK_S, ep_layer,
                                      outcome, tiny_model)
from tests.dist_utils import run_distributed

# Every mode predicted to take the same time at 8 decode tokens: "none" is chosen.
NO_COMM = dict(attention=1.0, experts=1.0, dispatch=0.0, combine=0.0)


def predicts_none(**figures: Any) -> Calibration:
    return Calibration(points=(MeasuredPoint(tokens=8, decode=True, layers=1,
                                             backend="a2a_ll", **NO_COMM),), **figures)


# ---------------------------------------------------------------------- layer 1 (CPU)
def test_the_calibration_digest_sees_the_figures_not_the_provenance() -> None:
    cal = predicts_none()
    digest = calibration_digest(cal, margin=0.01, sbo_chunks=None)
    assert digest == calibration_digest(Calibration.from_json(cal.to_json()), margin=0.01,
                                        sbo_chunks=None)
    assert digest == calibration_digest(predicts_none(device="H200", date="2026-01-01"),
                                        margin=0.01, sbo_chunks=None)
    for other in (calibration_digest(predicts_none(dense_tflops=600.0), margin=0.01,
                                     sbo_chunks=None),
                  calibration_digest(cal, margin=0.02, sbo_chunks=None),
                  calibration_digest(cal, margin=0.01, sbo_chunks=2),
                  calibration_digest(cal, margin=0.01, sbo_chunks=None, sbo_groups=2)):
        assert other != digest
    assert digest == calibration_digest(cal, margin=0.01, sbo_chunks=None, sbo_groups=None)
    # A point's own SBO form is in the figures: ranks whose points were measured with
    # expert groups and without would predict different SBO times.
    grouped = Calibration(points=(dataclasses.replace(cal.points[0], sbo_groups=2),))
    assert calibration_digest(grouped, margin=0.01, sbo_chunks=None) != digest
    assert calibration_digest(None, margin=0.01, sbo_chunks=None) is None


def test_the_token_limit_is_a_context_and_exchange_capacity_enters_it() -> None:
    assert current_token_limit() is None
    with step_token_limit(8) as outer:
        assert outer == TokenLimit(8, 8) == current_token_limit()
        with exchange_capacity(6, 3):
            assert current_token_limit() == TokenLimit(6, 3)
        assert current_token_limit() == outer
    assert current_token_limit() is None
    with pytest.raises(ValueError, match="tokens_per_rank=0 must be a positive int"):
        with step_token_limit(0):
            pass


def test_a_disabled_runner_checks_and_counts_as_the_split_mode_would() -> None:
    """DBO on or off, the same inputs are refused before the vote; the plan counts the
    step's tokens (what the capacity check reads), "batch" mode in tokens."""
    def model(x: torch.Tensor, *, seq_lens: list[int]) -> torch.Tensor:
        return x

    runner = DBORunner(model, DBOConfig(enabled=False))
    with pytest.raises(ValueError, match="seq_lens sum to 4 tokens but the batch has 5"):
        runner(torch.ones(5, 2), seq_lens=[2, 2])
    out = runner(torch.ones(5, 2), seq_lens=[2, 3])
    plan = runner.last_decision
    assert out.shape == (5, 2) and not plan.split and plan.num_tokens == (5,)
    assert plan.reason == "DBO disabled (DBOConfig.enabled=False)" and not plan.is_decode
    batch = DBORunner(lambda x: x, DBOConfig(enabled=False, split="batch"))
    batch(torch.ones(3, 4, 2))
    assert batch.last_decision.num_tokens == (12,)


def test_out_of_vocabulary_ids_are_refused_on_cpu() -> None:
    model = tiny_model()
    ids = torch.tensor([0, 1, model.config.vocab_size, 2])
    with pytest.raises(ValueError, match=rf"input_ids_T\[2\]={model.config.vocab_size} is "
                                         rf"outside the vocabulary \[0, vocab_size="):
        model(ids, torch.arange(4), seq_lens=[4])
    with pytest.raises(ValueError, match=r"input_ids_T\[0\]=-1 is outside"):
        model.dbo_check_inputs(torch.tensor([-1, 1, 2, 3]), torch.arange(4), seq_lens=[4])


# ------------------------------------------------------------- layer 2 (two gloo ranks)
def differing_calibrations(rank: int, world_size: int) -> dict[str, Any]:
    """An a2a_ll layer with a chunked SBO combine: a rank that runs single-batch overlap
    issues two combine collectives where one that runs none issues one."""
    group = dbo.new_group(timeout_s=GROUP_TIMEOUT_S)
    layer = ep_layer(group, backend="a2a_ll", combine_chunks=2)
    auto = DBOConfig(split="tokens", overlap="auto", min_decode_tokens=64)  # 8: unsplit

    def runner(calibration: Any) -> DBORunner:
        return DBORunner(layer, auto, group=group, calibration=calibration)

    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(rank))
    one = rank == 1
    cases = {  # rank 0 predicts no overlap; rank 1 takes SBO, or predicts from other figures
        "one rank without": runner(None if one else predicts_none()),
        "other figures": runner(predicts_none(dense_tflops=600.0 if one else 700.0)),
    }
    out = {name: outcome(lambda: r(x)) for name, r in cases.items()}
    alike = runner(Calibration.from_json(predicts_none().to_json()))  # loaded apart
    with torch.no_grad():
        alike(x)
    out["alike"] = alike.last_decision.overlap
    return out


@pytest.mark.distributed
def test_ranks_given_different_calibrations_raise_a_named_mismatch() -> None:
    for rank, out in enumerate(run_distributed(2, differing_calibrations)):
        for case in ("one rank without", "other figures"):
            result = out[case]
            assert result["type"] == "ConfigMismatchError", (rank, case, result)
            assert result["fields"] == ("calibration",), (rank, case, result)
            assert "calibration: rank 0: " in result["text"], result
            assert result["elapsed"] < QUICK_S and NEXT_STEP_RUNS in result["notes"], result
        assert "rank 1: None" in out["one rank without"]["text"]
        assert out["alike"] == "none", out


class Blocked:
    """A model with no collectives whose SBO blocker is `reason`."""

    def __init__(self, reason: Any) -> None:
        self.reason = reason

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def dbo_sbo_blocker(self) -> Any:
        return self.reason


def differing_sbo_blockers(rank: int, world_size: int) -> dict[str, Any]:
    group = dbo.new_group(timeout_s=GROUP_TIMEOUT_S)
    runner = DBORunner(Blocked("a reason" if rank == 1 else None),
                       DBOConfig(overlap="auto"), group=group)
    return outcome(lambda: runner(torch.ones(4, 2)))


@pytest.mark.distributed
def test_ranks_whose_models_offer_sbo_differently_raise_a_named_mismatch() -> None:
    for result in run_distributed(2, differing_sbo_blockers):
        assert result["type"] == "ConfigMismatchError", result
        assert result["fields"] == ("sbo_blocker",), result
        assert "sbo_blocker: rank 0: None, rank 1: a reason" in result["text"], result


def token_limits(rank: int, world_size: int) -> dict[str, Any]:
    group = dbo.new_group(timeout_s=GROUP_TIMEOUT_S)
    layer = ep_layer(group, backend="a2a_ll")  # capacity 16
    runners = {dbo_on: DBORunner(layer, DBOConfig(enabled=dbo_on, split="tokens",
                                                  min_decode_tokens=64), group=group)
               for dbo_on in (True, False)}
    x = torch.randn(6, 16, generator=torch.Generator().manual_seed(rank))
    over = torch.randn(7, 16) if rank == 1 else x
    one = rank == 1
    cases = {  # (limit entered on this rank, or None; input; DBO on)
        "entered on one rank": (6 if one else None, x, True),
        "other values": (6 if one else 8, x, True),
        "other values, DBO off": (6 if one else 8, x, False),
        "over it on one rank": (6, over, True),
        "over it on one rank, DBO off": (6, over, False),
    }
    out: dict[str, Any] = {}
    with torch.no_grad():
        expected = layer(x)
    for case, (limit, inputs, dbo_on) in cases.items():
        entered = exchange_capacity(limit) if limit is not None else contextlib.nullcontext()
        with entered:
            out[case] = outcome(lambda: runners[dbo_on](inputs))
    with torch.no_grad(), exchange_capacity(6):
        # Smaller slots, the same rows through the same experts: equal to rounding.
        out["next_step"] = torch.allclose(runners[True](x), expected, rtol=1e-5, atol=1e-6)
    return out


@pytest.mark.distributed
def test_token_limits_are_voted_and_checked_on_every_rank() -> None:
    for rank, out in enumerate(run_distributed(2, token_limits)):
        for case in ("entered on one rank", "other values", "other values, DBO off"):
            result = out[case]
            assert result["type"] == "ConfigMismatchError", (rank, case, result)
            assert result["fields"] == ("step_token_limit",), (rank, case, result)
            assert result["elapsed"] < QUICK_S and NEXT_STEP_RUNS in result["notes"], result
        assert "step_token_limit: rank 0: None, rank 1: (6, 6)" in \
            out["entered on one rank"]["text"]
        for case in ("over it on one rank", "over it on one rank, DBO off"):
            result = out[case]
            assert result["type"] == "ValueError", (rank, case, result)
            assert result["text"].startswith(
                "rank 1 of the group has 7 tokens in one model call this step (unsplit; "
                "each rank: rank 0: 6, rank 1: 7), more than the step_token_limit in force "
                "(tokens_per_rank)=6"), result
            assert result["elapsed"] < QUICK_S and NEXT_STEP_RUNS in result["notes"], result
            assert result["collectives"] == ["all_reduce"], result  # the vote
        assert out["next_step"], rank


def rejected_with_dbo_off(rank: int, world_size: int) -> dict[str, Any]:
    """A good step first (the runner of old then stopped voting), then steps whose inputs
    only rank 1 gets wrong, then a good step again."""
    group = dbo.new_group(timeout_s=GROUP_TIMEOUT_S)
    model = tiny_model(group, backend="a2a")

    def without_hook(*args: Any, **kwargs: Any) -> Any:  # only the runner checks seq_lens
        return model(*args, **kwargs)

    off = DBOConfig(enabled=False)
    layer = ep_layer(group)
    runners = {"requests": DBORunner(without_hook, DBOConfig(enabled=False, split="requests"),
                                     group=group),
               "model": DBORunner(model, off, group=group),
               "model, DBO on": DBORunner(model, DBOConfig(min_prefill_tokens=2), group=group),
               "capacity": DBORunner(tiny_model(group, backend="a2a", max_tokens_per_rank=12),
                                     off, group=group),
               "layer": DBORunner(layer, off, group=group)}
    batch = make_batch(model.config, num_tokens=10 + rank, num_requests=3, seed=rank)
    ids, positions, lens = batch.input_ids_T, batch.positions_T, batch.seq_lens
    x = torch.randn(5, 16)
    good = {name: ((x,), {}) if name == "layer" else ((ids, positions), {"seq_lens": lens})
            for name in runners}
    one = rank == 1
    bad_lens = (*lens[:-1], lens[-1] + 1) if one else lens
    oov = ids.clone()
    oov[3] = model.config.vocab_size if one else oov[3]
    more = 3 if one else 0  # rank 1: 14 tokens, over the capacity of 12
    cases = {  # (runner, args, kwargs): only rank 1's are bad
        "seq_lens, split mode": ("requests", (ids, positions), {"seq_lens": bad_lens}),
        "seq_lens, model": ("model", (ids, positions), {"seq_lens": bad_lens}),
        "dtype": ("model", (ids.float() if one else ids, positions), {"seq_lens": lens}),
        "token id": ("model", (oov, positions), {"seq_lens": lens}),
        "token id, DBO on": ("model, DBO on", (oov, positions), {"seq_lens": lens}),
        "capacity": ("capacity", (torch.cat([ids, ids[:more]]),
                                  torch.cat([positions, torch.arange(more)])),
                     {"seq_lens": (*lens, more) if more else lens}),
        "layer dtype": ("layer", (x.double() if one else x,), {}),
    }
    out: dict[str, Any] = {}
    with torch.no_grad():
        expected = {name: runners[name](*a, **k) for name, (a, k) in good.items()}
    for case, (name, args, kwargs) in cases.items():
        result = outcome(lambda: runners[name](*args, **kwargs))
        a, k = good[name]
        with torch.no_grad():
            result["next_step"] = torch.equal(runners[name](*a, **k), expected[name])
        out[case] = result
    # Called without a runner, the layer says its peers were not told (rank 0 does not
    # call it, so no collective is left waiting).
    out["bare layer"] = outcome(lambda: layer(x.double())) if one else None
    return out


@pytest.mark.distributed
def test_inputs_rejected_with_dbo_off_stop_every_rank_at_the_vote() -> None:
    rank0, rank1 = run_distributed(2, rejected_with_dbo_off)
    own = {"seq_lens, split mode": "seq_lens sum to 12 tokens but the batch has 11 tokens",
           "seq_lens, model": "sum to 12, but the call has T=11",
           "dtype": "input_ids_T must be a 1-D integer tensor",
           "token id": "input_ids_T[3]=256 is outside the vocabulary [0, vocab_size=256)",
           "token id, DBO on": "input_ids_T[3]=256 is outside the vocabulary",
           "layer dtype": "x is torch.float64 but MoEConfig.dtype is torch.float32"}
    for case, text in own.items():
        peer, rejecting = rank0[case], rank1[case]
        assert rejecting["type"] == "ValueError" and text in rejecting["text"], rejecting
        assert "[dbo] rank 1 of the group rejected its inputs" in rejecting["notes"], rejecting
        assert peer["type"] == "PeerInputError", (case, peer)
        assert peer["text"].startswith("rank 1 of the group rejected its inputs"), peer
        assert text in peer["text"], peer
        for result in (peer, rejecting):
            assert result["elapsed"] < QUICK_S, (case, result)
            assert result["collectives"] == ["all_reduce"], (case, result)  # the vote only
            assert NEXT_STEP_RUNS in result["notes"] and result["next_step"], (case, result)
    for rank, result in enumerate((rank0["capacity"], rank1["capacity"])):
        assert result["type"] == "ValueError", result
        assert result["text"].startswith("rank 1 of the group has 14 tokens in one model "
                                         "call this step (unsplit; each rank: rank 0: 10, "
                                         "rank 1: 14), more than the model's capacity "
                                         "max_tokens_per_rank=12"), result
        assert NEXT_STEP_RUNS in result["notes"] and result["next_step"], (rank, result)
    bare = rank1["bare layer"]
    assert bare["type"] == "ValueError" and "x is torch.float64" in bare["text"], bare
    assert ("[dbo] rank 1: MoELayer layer 0 rejected its input before its first collective, "
            "and the other ranks of its group were not told") in bare["notes"], bare
