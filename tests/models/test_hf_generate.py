"""Layer 1 (CPU) and Layer 2 (two gloo processes): `moe.hf.generate`, greedy decoding of
converted tiny transformers models through a `DBORunner` with one KV cache per ubatch,
gives the tokens of `model.generate(do_sample=False)` on the unconverted model: 16 new
tokens for left-padded batches of varying lengths, DBO off and on (every step split),
steps that run unsplit on the ubatches' caches (too few tokens, one sequence, a peer's
vote), sequences that finish on an eos token, and two expert-parallel ranks with
different batches (6 new tokens); with a2a_ll, decode steps exchange slots for the
largest batch over the ranks, not the prompt's.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import dbo  # noqa: E402
import moe.hf  # noqa: E402
from moe.hf.generate import GroupedDecoder, RowGroup  # noqa: E402
from tests.dist_utils import run_distributed  # noqa: E402
from tests.hf_utils import ARCHS, batch, tiny_model  # noqa: E402

SPLIT_ALWAYS = dbo.DBOConfig(min_prefill_tokens=1, min_decode_tokens=1)
NEW_TOKENS = 16
# On two ranks: the prompt and 5 decode steps, each exchanging over the ranks what the
# first one did (what is checked holds per step, not over many).
EP_NEW_TOKENS = 6


def reference(model, ids, mask, new_tokens=NEW_TOKENS):
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens,
                              do_sample=False)


def converted(arch, **overrides):
    return moe.hf.convert(tiny_model(arch, **overrides))


class StepLog:
    """Counts the calls of the transformers model (two per split step, one unsplit)."""

    def __init__(self, model):
        self.calls = 0
        model.register_forward_pre_hook(self._count)

    def _count(self, module, args):
        self.calls += 1


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("config", [dbo.DBOConfig(enabled=False), SPLIT_ALWAYS],
                         ids=["dbo_off", "dbo_on"])
@pytest.mark.parametrize("static", [False, True], ids=["dynamic_cache", "static_cache"])
def test_greedy_tokens_equal_transformers(arch, config, static):
    original = tiny_model(arch)
    ids, mask = batch(5, 6, seed=3)  # rows left-padded by 0, 1, 2, 0, 1 tokens
    expected = reference(original, ids, mask)
    model = moe.hf.convert(original)
    log = StepLog(model)
    runner = dbo.DBORunner(model, config)
    out = moe.hf.generate(runner, ids, attention_mask=mask, max_new_tokens=NEW_TOKENS,
                          static_cache=static)
    assert torch.equal(out, expected)
    # Split: two model calls per step (ubatch 0's rows, then ubatch 1's); off: one.
    assert log.calls == NEW_TOKENS * (2 if config.enabled else 1)
    assert runner.last_decision.split == config.enabled


@pytest.mark.parametrize("prefill, decode", [(1, 10**6), (10**6, 1)],
                         ids=["decode_unsplit", "prefill_unsplit"])
def test_unsplit_steps_run_on_the_ubatches_caches(prefill, decode):
    """Steps below the runner's thresholds run unsplit, as one model call on the joined
    caches of both ubatches; the split steps before or after them continue on those
    caches, so every token still equals transformers'."""
    arch = "qwen3_moe"
    ids, mask = batch(4, 6, seed=4)
    expected = reference(tiny_model(arch), ids, mask)
    model = converted(arch)
    log = StepLog(model)
    config = dbo.DBOConfig(min_prefill_tokens=prefill, min_decode_tokens=decode)
    out = moe.hf.generate(dbo.DBORunner(model, config), ids, attention_mask=mask,
                          max_new_tokens=NEW_TOKENS)
    assert torch.equal(out, expected)
    split_steps = 1 if prefill == 1 else NEW_TOKENS - 1
    assert log.calls == NEW_TOKENS + split_steps  # one call unsplit, two split


def test_a_single_sequence_runs_unsplit():
    arch = "deepseek_v3"
    ids, mask = batch(1, 5, seed=5)
    expected = reference(tiny_model(arch), ids, mask)
    model = converted(arch)
    log = StepLog(model)
    runner = dbo.DBORunner(model, SPLIT_ALWAYS)
    out = moe.hf.generate(runner, ids, attention_mask=mask, max_new_tokens=NEW_TOKENS)
    assert torch.equal(out, expected)
    assert log.calls == NEW_TOKENS and not runner.last_decision.split


def test_the_unsplit_step_joins_and_parts_the_caches():
    """An unsplit step's model call sees both groups' rows in one cache; afterwards each
    group's cache holds its own rows, one position longer."""
    import transformers
    model = converted("qwen3_moe")
    decoder = GroupedDecoder(model)
    ids, mask = batch(3, 4, seed=6)
    groups = tuple(RowGroup(rows=rows, cache=transformers.DynamicCache(config=model.config))
                   for rows in (slice(0, 2), slice(2, 3)))
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        decoder(ids, mask, positions, groups=groups)
        keys0, keys1 = groups[0].cache.layers[0].keys, groups[1].cache.layers[0].keys
        assert keys0.shape[:1] == (2,) and keys1.shape[:1] == (1,) and keys0.shape[2] == 4
        # The next step, split: each group alone on its cache.
        step = torch.tensor([[1], [2], [3]])
        ones = mask.new_ones(3, 1)
        out0 = decoder(step[:2], torch.cat([mask, ones], 1)[:2], positions[:2, -1:] + 1,
                       groups=groups[:1])
        both = decoder.model(input_ids=torch.cat([ids, step], 1),
                             attention_mask=torch.cat([mask, ones], 1),
                             position_ids=torch.cat([positions, positions[:, -1:] + 1], 1),
                             use_cache=False).logits[:2, -1]
    assert groups[0].cache.layers[0].keys.shape[2] == 5
    assert groups[1].cache.layers[0].keys.shape[2] == 4
    torch.testing.assert_close(out0, both, rtol=1e-5, atol=1e-5)


def test_sequences_that_finish_get_the_pad_token_and_generation_stops():
    arch = "mixtral"
    ids, mask = batch(3, 6, seed=7)
    original = tiny_model(arch)
    free = reference(original, ids, mask)
    # Every row's third new token ends it: later tokens are padding, and once all rows
    # have finished the output stops.
    eos = sorted(set(free[:, 6 + 2].tolist()))
    original.generation_config.eos_token_id = eos
    original.generation_config.pad_token_id = 0
    expected = reference(original, ids, mask)
    assert expected.shape[1] < free.shape[1]
    model = moe.hf.convert(original)
    out = moe.hf.generate(dbo.DBORunner(model, SPLIT_ALWAYS), ids, attention_mask=mask,
                          max_new_tokens=NEW_TOKENS)
    assert torch.equal(out, expected)


def test_right_padding_and_bad_arguments_are_refused():
    model = converted("qwen3_moe")
    runner = dbo.DBORunner(model, SPLIT_ALWAYS)
    ids, mask = batch(2, 4, seed=8)
    mask[1] = torch.tensor([1, 1, 1, 0])
    with pytest.raises(ValueError, match="row 1 is right-padded.*padding_side = 'left'"):
        moe.hf.generate(runner, ids, attention_mask=mask, max_new_tokens=2)
    with pytest.raises(ValueError, match="max_new_tokens=0 must be an int >= 1"):
        moe.hf.generate(runner, ids, max_new_tokens=0)
    with pytest.raises(ValueError, match=r"input_ids must be a \[B, S\] int64 tensor"):
        moe.hf.generate(runner, ids.float(), max_new_tokens=2)
    with pytest.raises(TypeError, match="takes a dbo.DBORunner"):
        moe.hf.generate(model, ids, max_new_tokens=2)


def _generate_under_ep(rank, world, rows_per_rank, arch):
    group = torch.distributed.group.WORLD
    ids, mask = batch(rows_per_rank[rank], 5, seed=10 + rank)
    original = tiny_model(arch)
    expected = reference(original, ids, mask, EP_NEW_TOKENS)
    model = moe.hf.convert(original, group=group)
    runner = dbo.DBORunner(model, SPLIT_ALWAYS, group=group)
    out = moe.hf.generate(runner, ids, attention_mask=mask, max_new_tokens=EP_NEW_TOKENS)
    return torch.equal(out, expected), runner.last_decision.split


@pytest.mark.parametrize("rows_per_rank, split", [((3, 4), True), ((1, 4), False)],
                         ids=["split", "peer_votes_unsplit"])
def test_two_expert_parallel_ranks(rows_per_rank, split):
    """Each rank holds half the experts and its own batch; with a single sequence on
    rank 0, its vote keeps every step of both ranks unsplit, on the same caches."""
    results = run_distributed(2, _generate_under_ep, rows_per_rank, "qwen3_moe")
    assert results == [(True, split)] * 2


def _generate_a2a_ll(rank, world, static, runner_group=True):
    """a2a_ll sized for the prompt (4 x 5 tokens per rank, ubatches of 10): the prompt's
    exchanges send its slots, every decode step's those of the largest batch over the
    ranks (4 sequences: ubatches of 2 tokens), with transformers' tokens. Without a
    runner group the runner votes over the default group, the capacity too, and the
    decode steps run unsplit (4 tokens on each rank, though rank 0 has 3)."""
    from tests.moe.test_ubatch_capacity import ExchangeRows
    group = torch.distributed.group.WORLD
    ids, mask = batch([3, 4][rank], 5, seed=30 + rank)
    original = tiny_model("qwen3_moe")
    expected = reference(original, ids, mask, EP_NEW_TOKENS)
    model = moe.hf.convert(original, group=group, backend="a2a_ll", max_tokens_per_rank=20,
                           max_tokens_per_ubatch=moe.hf.ubatch_capacity(4, 5))
    config = SPLIT_ALWAYS if runner_group else dbo.DBOConfig(min_prefill_tokens=1,
                                                             min_decode_tokens=10**6)
    runner = dbo.DBORunner(model, config, group=group if runner_group else None)
    with ExchangeRows() as spy:
        out = moe.hf.generate(runner, ids, attention_mask=mask, max_new_tokens=EP_NEW_TOKENS,
                              static_cache=static)
    return torch.equal(out, expected), runner.last_decision.split, spy.rows


@pytest.mark.parametrize("static, runner_group", [(False, True), (True, True), (False, False)],
                         ids=["dynamic_cache", "static_cache", "runner_without_group"])
def test_decode_steps_exchange_slots_for_the_largest_batch_not_the_prompt(static,
                                                                          runner_group):
    results = run_distributed(2, _generate_a2a_ll, static, runner_group)
    layers = 2 * 2  # the tiny model's MoE layers x (dispatch, combine), per ubatch
    decode_rows = [2 * 2] * (2 * layers) if runner_group else [2 * 4] * layers  # per step
    for equal, split, rows in results:
        assert equal and split == runner_group, (equal, split)
        prompt, decode = rows[:2 * layers], rows[2 * layers:]
        assert prompt == [2 * 10] * (2 * layers), rows
        assert decode == decode_rows * (EP_NEW_TOKENS - 1), rows


def test_cache_keyword_follows_the_forward_signature():
    """transformers 5.24 takes the KV cache as `cache`, 5.17 as `past_key_values`."""
    from moe.hf.kv import cache_keyword

    class New(torch.nn.Module):
        def forward(self, input_ids, cache=None, past_key_values=None):
            return input_ids

    class Old(torch.nn.Module):
        def forward(self, input_ids, past_key_values=None):
            return input_ids

    assert cache_keyword(New()) == "cache"
    assert cache_keyword(Old()) == "past_key_values"
