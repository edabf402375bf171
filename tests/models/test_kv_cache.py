"""Layers 1-2: the KV-cache decode path of `MoETransformer` (`moe.models.kv_cache`).

Layer 1 (CPU, one process): a prefill into per-request caches then decode steps of one
token per request give the logits of recomputing the whole sequences without a cache
(fp32, tight tolerance), with DBO off and on (each ubatch its requests' cache views);
a prefill split over two calls; bad caches refused. Layer 2 (two gloo processes,
backend a2a): the same equality on every rank, DBO off and on.
"""
from __future__ import annotations

import pytest
import torch

from dbo import DBOConfig, DBORunner
from moe.models import KVCache, MoETransformer, get_preset, with_cache_split
from tests.dist_utils import run_distributed

ATOL = 2e-5  # fp32: only the attention kernel (masked vs causal SDPA) and row blocking differ
PROMPTS = (5, 3, 7, 2)
STEPS = 3


def _sequences(config, prompts: tuple[int, ...], seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, config.vocab_size, (n + STEPS,), generator=gen) for n in prompts]


def _recompute(model, seqs: list[torch.Tensor], lengths: list[int]) -> torch.Tensor:
    """Logits of every request's last token, recomputed without a cache: [B, V]."""
    ids = torch.cat([s[:n] for s, n in zip(seqs, lengths)])
    pos = torch.cat([torch.arange(n) for n in lengths])
    ends = torch.tensor(lengths).cumsum(0) - 1
    return model(ids, pos, seq_lens=list(lengths))[ends]


def _decode_against_recompute(model, call, seqs: list[torch.Tensor],
                              prompts: tuple[int, ...]) -> tuple[float, list[bool]]:
    """Prefill and STEPS decode steps through `call`; the largest difference to the
    recomputed logits, and whether each call's runner split (if a runner)."""
    num = len(prompts)
    cache = KVCache.empty(model.config, num_requests=num, capacity=max(prompts) + STEPS)
    ids = torch.cat([s[:n] for s, n in zip(seqs, prompts)])
    pos = torch.cat([torch.arange(n) for n in prompts])
    ends = torch.tensor(prompts).cumsum(0) - 1
    out = call(ids, pos, seq_lens=list(prompts), cache=cache)[ends]
    worst = (out - _recompute(model, seqs, list(prompts))).abs().max().item()
    splits = [getattr(call, "last_decision", None) is not None and call.last_decision.split]
    for t in range(STEPS):
        assert cache.lengths == tuple(n + t for n in prompts)
        ids = torch.stack([s[n + t] for s, n in zip(seqs, prompts)])
        out = call(ids, cache.next_positions(), seq_lens=[1] * num, cache=cache)
        expected = _recompute(model, seqs, [n + t + 1 for n in prompts])
        worst = max(worst, (out - expected).abs().max().item())
        splits.append(getattr(call, "last_decision", None) is not None
                      and call.last_decision.split)
    assert cache.lengths == tuple(n + STEPS for n in prompts)
    return worst, splits


def _model(backend: str = "local", group=None) -> MoETransformer:
    model = MoETransformer(get_preset("tiny", backend=backend, experts="reference"),
                           group=group)
    model.init_weights(seed=0)
    return model


def _runner(model, group=None) -> DBORunner:
    return DBORunner(model, with_cache_split(DBOConfig(min_prefill_tokens=2,
                                                       min_decode_tokens=2)), group=group)


@pytest.mark.parametrize("dbo_on", [False, True])
def test_decode_equals_full_recompute(dbo_on: bool) -> None:
    model = _model()
    seqs = _sequences(model.config, PROMPTS, seed=1)
    with torch.inference_mode():
        call = _runner(model) if dbo_on else model
        worst, splits = _decode_against_recompute(model, call, seqs, PROMPTS)
    assert worst < ATOL, worst
    assert all(splits) if dbo_on else not any(splits)


def test_dbo_ubatches_write_only_their_requests_cache() -> None:
    model = _model()
    seqs = _sequences(model.config, PROMPTS, seed=2)
    runner = _runner(model)
    cache = KVCache.empty(model.config, num_requests=4, capacity=16)
    with torch.inference_mode():
        ids = torch.stack([s[0] for s in seqs])
        runner(ids, cache.next_positions(), seq_lens=[1, 1, 1, 1], cache=cache)
    assert runner.last_decision.split and cache.lengths == (1, 1, 1, 1)
    with torch.inference_mode():  # only the second ubatch's requests get a token
        runner(torch.stack([s[1] for s in seqs[2:]]), torch.tensor([1, 1]),
               seq_lens=[0, 0, 1, 1], cache=cache)
    assert cache.lengths == (1, 1, 2, 2)
    for keys in cache.keys:
        assert keys[:2, :, 1].abs().sum() == 0 and keys[2:, :, 1].abs().sum() > 0


def test_prefill_in_two_calls_equals_one() -> None:
    model = _model()
    seqs = _sequences(model.config, (6, 4), seed=3)
    cache = KVCache.empty(model.config, num_requests=2, capacity=8)
    with torch.inference_mode():
        model(torch.cat([seqs[0][:2], seqs[1][:3]]), torch.tensor([0, 1, 0, 1, 2]),
              seq_lens=[2, 3], cache=cache)
        out = model(torch.cat([seqs[0][2:6], seqs[1][3:4]]),
                    torch.tensor([2, 3, 4, 5, 3]), seq_lens=[4, 1], cache=cache)
        expected = _recompute(model, seqs, [6, 4])
    assert (out[[3, 4]] - expected).abs().max().item() < ATOL


@pytest.mark.parametrize("seq_lens, capacity, message", [
    ([1, 1, 1], 8, "seq_lens has 3 requests but the KV cache 2"),
    ([9, 1], 8, "request 0 would hold 9 tokens, more than the KV cache's capacity 8"),
])
def test_bad_cache_is_refused_before_the_vote(seq_lens: list[int], capacity: int,
                                              message: str) -> None:
    model = _model()
    cache = KVCache.empty(model.config, num_requests=2, capacity=capacity)
    tokens = sum(seq_lens)
    with pytest.raises(ValueError, match=message):
        _runner(model)(torch.zeros(tokens, dtype=torch.long), torch.arange(tokens),
                       seq_lens=seq_lens, cache=cache)
    assert cache.lengths == (0, 0)
    with pytest.raises(TypeError, match="cache must be a moe.models.kv_cache.KVCache"):
        model(torch.zeros(2, dtype=torch.long), torch.arange(2), seq_lens=[1, 1],
              cache="nope")


def _decode_on_ranks(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    group = dist.group.WORLD
    model = _model("a2a", group)
    prompts = PROMPTS if rank == 0 else (4, 6, 2)  # the ranks' batches differ
    seqs = _sequences(model.config, prompts, seed=10 + rank)
    out = {}
    with torch.inference_mode():
        out["off"] = _decode_against_recompute(model, model, seqs, prompts)
        out["on"] = _decode_against_recompute(model, _runner(model, group), seqs, prompts)
    return out


@pytest.mark.distributed
def test_decode_equals_full_recompute_on_two_ranks_a2a() -> None:
    for result in run_distributed(2, _decode_on_ranks):
        worst_off, _ = result["off"]
        worst_on, splits = result["on"]
        assert worst_off < ATOL and worst_on < ATOL, result
        assert all(splits), splits
