"""Layer 1 (CPU): `moe.routing_log`, which tells a routing near-tie between two runs of a
model (whole, and as DBO ubatches) from a real mismatch."""
from __future__ import annotations

import pytest
import torch

from dbo import DBOConfig, DBORunner
from moe.layer import MoELayer
from moe.models.transformer import MoETransformer, get_preset, make_batch
from moe.routing_log import RoutingLog, record_routing, routing_ties

DBO = DBOConfig(split="requests", min_prefill_tokens=1, min_decode_tokens=1, max_imbalance=1.0)


def _log(per_layer: dict[int, list[tuple[torch.Tensor, torch.Tensor]]]) -> RoutingLog:
    """A log whose layer L ran once per ubatch with the given (logits, ids)."""
    log = RoutingLog()
    for layer, parts in per_layer.items():
        for ubatch, (logits, ids) in enumerate(parts):
            log.calls[(layer, ubatch)] = [(logits, ids)]
    return log


def test_a_dbo_step_s_routing_lines_up_with_the_whole_batch_s() -> None:
    model = MoETransformer(get_preset("tiny"))
    model.init_weights(0)
    batch = make_batch(model.config, num_tokens=40, num_requests=5, seed=3, device="cpu")
    runner = DBORunner(model, DBO)
    args, kwargs = (batch.input_ids_T, batch.positions_T), {"seq_lens": batch.seq_lens}
    with torch.no_grad(), record_routing(model) as off:
        model(*args, **kwargs)
    with torch.no_grad(), record_routing(model) as on:
        runner(*args, **kwargs)
    assert runner.last_decision.split
    moe_ids = [m.layer_id for m in model.modules() if isinstance(m, MoELayer)]
    assert off.layers() == on.layers() == sorted(moe_ids) and moe_ids
    assert {ub for _, ub in on.calls} == {0, 1} and {ub for _, ub in off.calls} == {0}
    for layer in off.layers():
        logits_off, ids_off = off.of_layer(layer)
        logits_on, ids_on = on.of_layer(layer)
        assert ids_off.shape[0] == 40 and torch.equal(ids_off, ids_on)
        torch.testing.assert_close(logits_off, logits_on, atol=1e-5, rtol=1e-5)
    assert not routing_ties(off, on, num_tokens=40, logit_atol=1e-4).any()
    # Recording stops on leaving the block.
    assert all(m.routing_log is None for m in model.modules() if isinstance(m, MoELayer))


def test_ties_are_tokens_routed_apart_whose_logits_agree_at_the_first_difference() -> None:
    logits = torch.zeros(5, 4)
    ids = torch.tensor([[0, 1]] * 5)
    far = logits.clone()
    far[2] += 1.0   # token 2's logits differ where its experts first differ: not a tie
    far[3] += 1.0   # token 3's logits differ, but its experts first differ in layer 1
    near = logits + 1e-3
    ids_b0 = ids.clone()
    ids_b0[1] = torch.tensor([0, 2])   # token 1: another expert, logits close -> tie
    ids_b0[2] = torch.tensor([0, 3])   # token 2: another expert, logits far -> no tie
    ids_b0[4] = torch.tensor([1, 3])   # token 4: first differs here, logits close -> tie
    ids_b1 = ids.clone()
    ids_b1[3] = torch.tensor([2, 3])   # token 3: first differs in layer 1, logits close
    ids_b1[2] = torch.tensor([1, 2])   # token 2 again: decided in layer 0 already
    logits_b1 = near.clone()
    logits_b1[4] += 5.0                # token 4 diverged after its tie: still a tie
    a = _log({0: [(logits[:3], ids[:3]), (logits[3:], ids[3:])],
              1: [(logits[:3], ids[:3]), (logits[3:], ids[3:])]})
    b = _log({0: [(near[:2], ids_b0[:2]), (torch.cat([far[2:3], near[3:]]), ids_b0[2:])],
              1: [(logits_b1[:3], ids_b1[:3]), (logits_b1[3:], ids_b1[3:])]})
    ties = routing_ties(a, b, num_tokens=5, logit_atol=1e-2)
    assert ties.tolist() == [False, True, False, True, True]
    # A tolerance below the rounding makes nothing a tie.
    assert not routing_ties(a, b, num_tokens=5, logit_atol=1e-4).any()


def test_logs_that_cannot_be_lined_up_are_refused() -> None:
    logits, ids = torch.zeros(3, 4), torch.zeros(3, 2, dtype=torch.long)
    one = _log({0: [(logits, ids)]})
    with pytest.raises(ValueError, match="different MoE layers"):
        routing_ties(one, _log({1: [(logits, ids)]}), num_tokens=3, logit_atol=0.1)
    with pytest.raises(ValueError, match="routed 3 and 3 tokens in the two runs, not 4"):
        routing_ties(one, one, num_tokens=4, logit_atol=0.1)
    twice = RoutingLog()
    twice.add(0, logits, ids)
    twice.add(0, logits, ids)
    with pytest.raises(ValueError, match="ran 2 times in ubatch 0"):
        twice.of_layer(0)
    with pytest.raises(ValueError, match="did not run"):
        one.of_layer(5)
    assert RoutingLog().logit_scale() == 0.0
    assert _log({0: [(torch.tensor([[1.0, -3.0]]), ids[:1])]}).logit_scale() == 3.0


def test_a_tie_spreads_to_the_later_tokens_of_its_request_only():
    """Causal attention carries a flipped token to the later tokens of its request."""
    from moe.routing_log import spread_in_requests

    ties = torch.tensor([False, True, False, False, False, False, True])
    got = spread_in_requests(ties, [3, 2, 2])
    assert got.tolist() == [False, True, True, False, False, False, True]
    assert spread_in_requests(torch.zeros(4, dtype=torch.bool), [4]).tolist() == [False] * 4
