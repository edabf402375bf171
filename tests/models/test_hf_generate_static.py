"""Layer 1 (CPU), Layer 2 (two gloo processes) and GPU: `moe.hf.generate` over one static
KV cache (`static_cache=True`, the steps `cuda_graph=True` replays), run eagerly on CPU:
the tokens of `model.generate(do_sample=False)` for left-padded batches of varying
lengths with split prompts and unsplit decode steps and the reverse (DBO off and every
step split: `test_hf_generate.py`'s token test, run with the static cache too), on one
process and on two expert-parallel ranks (6 new tokens there); the ubatches' caches are
row views of the one cache, which no decode step reallocates, and a decode step reads
nothing on the host. GPU (gpu; multigpu for two ranks over a2a_ll): `cuda_graph=True`
gives the eager path's tokens, with split and unsplit graphs.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import dbo  # noqa: E402
import moe.hf  # noqa: E402
from dbo.host_reads import format_host_reads, record_host_reads  # noqa: E402
from moe.hf.generate import GroupedDecoder, RowGroup  # noqa: E402
from moe.hf.static_decode import mask_buffer, slot_tensor, static_step_runner  # noqa: E402
from moe.hf.static_kv import static_cache_from_prompt  # noqa: E402
from tests.dist_utils import run_distributed  # noqa: E402
from tests.hf_utils import ARCHS, batch, tiny_model  # noqa: E402
from tests.models.test_hf_generate import (EP_NEW_TOKENS, NEW_TOKENS,  # noqa: E402
                                           SPLIT_ALWAYS, StepLog, reference)


@pytest.mark.parametrize("prefill, decode", [(1, 10**6), (10**6, 1)],
                         ids=["decode_unsplit", "prefill_unsplit"])
def test_static_cache_split_and_unsplit_steps_share_it(prefill, decode):
    """A split prompt followed by unsplit decode steps (on the batch's cache), and an
    unsplit prompt followed by split ones (on the ubatches' views): the same tokens."""
    arch = "qwen3_moe"
    ids, mask = batch(4, 7, seed=4)
    expected = reference(tiny_model(arch), ids, mask)
    model = moe.hf.convert(tiny_model(arch))
    log = StepLog(model)
    config = dbo.DBOConfig(min_prefill_tokens=prefill, min_decode_tokens=decode)
    out = moe.hf.generate(dbo.DBORunner(model, config), ids, attention_mask=mask,
                          max_new_tokens=NEW_TOKENS, static_cache=True)
    assert torch.equal(out, expected)
    split_steps = 1 if prefill == 1 else NEW_TOKENS - 1
    assert log.calls == NEW_TOKENS + split_steps


def test_a_single_sequence_decodes_unsplit_on_the_static_cache():
    arch = "deepseek_v3"
    ids, mask = batch(1, 5, seed=5)
    expected = reference(tiny_model(arch), ids, mask)
    runner = dbo.DBORunner(moe.hf.convert(tiny_model(arch)), SPLIT_ALWAYS)
    out = moe.hf.generate(runner, ids, attention_mask=mask, max_new_tokens=NEW_TOKENS,
                          static_cache=True)
    assert torch.equal(out, expected) and not runner.last_decision.split


def test_finished_sequences_get_the_pad_token_on_the_static_cache():
    arch = "mixtral"
    ids, mask = batch(3, 6, seed=7)
    original = tiny_model(arch)
    free = reference(original, ids, mask)
    original.generation_config.eos_token_id = sorted(set(free[:, 6 + 2].tolist()))
    original.generation_config.pad_token_id = 0
    expected = reference(original, ids, mask)
    assert expected.shape[1] < free.shape[1]
    out = moe.hf.generate(dbo.DBORunner(moe.hf.convert(original), SPLIT_ALWAYS), ids,
                          attention_mask=mask, max_new_tokens=NEW_TOKENS, static_cache=True)
    assert torch.equal(out, expected)


def _prompt_then_static(arch, num_rows, prompt_len, max_cache_len, *, split_at):
    """A converted model, its prompt run on one DynamicCache, and the static cache made
    from it; the decode inputs of the first step."""
    import transformers
    model = moe.hf.convert(tiny_model(arch))
    ids, mask = batch(num_rows, prompt_len, seed=6)
    prompt = transformers.DynamicCache(config=model.config)
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    with torch.no_grad():
        GroupedDecoder(model)(ids, mask, positions,
                              groups=(RowGroup(rows=slice(0, num_rows), cache=prompt),))
    kv = static_cache_from_prompt(model, prompt, max_cache_len=max_cache_len,
                                  split_at=split_at)
    return model, kv, prompt, ids[:, -1:], mask_buffer(mask, max_cache_len), positions[:, -1:] + 1


def test_ubatch_caches_are_row_views_of_the_one_static_cache_and_no_step_reallocates():
    arch = "deepseek_v3"  # keys and values of different widths (the latents)
    num_rows, prompt_len, slots = 5, 4, 8
    model, kv, prompt, ids, mask, positions = _prompt_then_static(
        arch, num_rows, prompt_len, slots, split_at=3)
    part0, part1 = kv.parts
    for i, layer in enumerate(kv.cache.layers):
        assert layer.keys.shape[:3] == (num_rows, 1, slots)
        torch.testing.assert_close(layer.keys[:, :, :prompt_len], prompt.layers[i].keys,
                                   rtol=0, atol=0)
        assert not layer.values[:, :, prompt_len:].any()
        for part, rows in ((part0, slice(0, 3)), (part1, slice(3, 5))):
            view = part.cache.layers[i]
            assert view.keys.data_ptr() == layer.keys[rows].data_ptr()
            assert view.values.data_ptr() == layer.values[rows].data_ptr()
            assert view.keys.untyped_storage().data_ptr() \
                == layer.keys.untyped_storage().data_ptr()
            assert view.cumulative_length.data_ptr() != layer.cumulative_length.data_ptr()
    pointers = [(layer.keys.data_ptr(), layer.values.data_ptr()) for layer in kv.cache.layers]
    split = static_step_runner(model, dbo.DBORunner(model, SPLIT_ALWAYS), cuda_graph=False)
    unsplit = static_step_runner(model, dbo.DBORunner(model, dbo.DBOConfig(enabled=False)),
                                 cuda_graph=False)
    with torch.no_grad():
        for step, runner in enumerate((split, unsplit, split)):
            slot = prompt_len + step
            mask[:, slot] = 1
            runner(ids, mask, positions + step, slot_tensor(slot, ids.device), kv=kv)
            # Every row's keys landed at this slot of the one cache, split or not.
            assert all(layer.keys[:, :, slot].abs().sum(dim=(1, 2)).gt(0).all()
                       for layer in kv.cache.layers), (step, runner.last_decision)
            assert not kv.cache.layers[0].keys[:, :, slot + 1:].any()
        assert split.last_decision.split and not unsplit.last_decision.split
    assert pointers == [(layer.keys.data_ptr(), layer.values.data_ptr())
                        for layer in kv.cache.layers]


def test_a_static_decode_step_reads_nothing_on_the_host():
    """Split or not, a static decode step (the graphed step, run eagerly) reads no device
    value on the host (a capture would fail at one); a DynamicCache step over padding
    does (transformers' mask check), which shows the recorder sees them."""
    model, kv, prompt, ids, mask, positions = _prompt_then_static(
        "qwen3_moe", 4, 6, 9, split_at=2)
    with torch.no_grad():
        for step, config in enumerate((SPLIT_ALWAYS, dbo.DBOConfig(min_decode_tokens=10**6))):
            runner = static_step_runner(model, dbo.DBORunner(model, config), cuda_graph=False)
            slot = 6 + step
            mask[:, slot] = 1
            with record_host_reads() as reads:
                runner(ids, mask, positions + step, slot_tensor(slot, ids.device), kv=kv)
            assert runner.last_decision.split == (step == 0)
            assert reads == [], format_host_reads(reads)
        dynamic_mask = mask[:, :6 + 3]
        with record_host_reads() as reads:
            GroupedDecoder(model)(ids, dynamic_mask, positions + 2,
                                  groups=(RowGroup(rows=slice(0, 4), cache=prompt),))
    assert any(r.owner == "transformers" for r in reads)


class EagerReplays:
    """A CPU stand-in for `dbo.graphs.GraphedRunner`: per split decision, the step it
    would capture (`decided_step` over its own copies of the first call's inputs), which
    every later call with that decision copies its inputs into and runs again -- what a
    replay does. One process, so no vote."""

    made: list = []

    def __init__(self, runner):
        self.runner = runner
        self.steps = {}
        EagerReplays.made.append(self)

    @property
    def last_decision(self):
        return self.runner.last_decision

    def __call__(self, *args, **kwargs):
        from dbo.graphs import decided_step
        plan = self.runner.plan(args, kwargs).plan
        self.runner.last_decision = plan
        if plan.split not in self.steps:
            inputs = tuple(a.clone() for a in args)
            self.steps[plan.split] = (inputs, decided_step(self.runner, inputs, dict(kwargs),
                                                           split=plan.split))
        inputs, step = self.steps[plan.split]
        for static, new in zip(inputs, args, strict=True):
            static.copy_(new)
        return step().clone()


@pytest.mark.parametrize("min_decode_tokens", [1, 10**6], ids=["split", "unsplit"])
def test_replaying_one_step_per_split_decision_gives_the_tokens(min_decode_tokens):
    """`cuda_graph=True`'s path on CPU with replays imitated (`EagerReplays`): every
    decode step runs the one step made at the first, on its tensors, with only the
    inputs copied in -- the tokens of transformers."""
    from unittest import mock
    arch = "qwen3_moe"
    ids, mask = batch(5, 6, seed=12)
    expected = reference(tiny_model(arch), ids, mask)
    runner = dbo.DBORunner(moe.hf.convert(tiny_model(arch)),
                           dbo.DBOConfig(min_decode_tokens=min_decode_tokens))
    EagerReplays.made.clear()
    with mock.patch("moe.hf.static_decode.GraphedRunner", EagerReplays), \
            mock.patch("moe.hf.generate.check_cuda_graph"):
        out = moe.hf.generate(runner, ids, attention_mask=mask, max_new_tokens=NEW_TOKENS,
                              cuda_graph=True)
    assert torch.equal(out, expected)
    (replays,) = EagerReplays.made
    assert list(replays.steps) == [min_decode_tokens == 1]


def _static_generate_under_ep(rank, world, rows_per_rank):
    group = torch.distributed.group.WORLD
    ids, mask = batch(rows_per_rank[rank], 5, seed=10 + rank)
    original = tiny_model("qwen3_moe")
    expected = reference(original, ids, mask, EP_NEW_TOKENS)
    runner = dbo.DBORunner(moe.hf.convert(original, group=group), SPLIT_ALWAYS, group=group)
    out = moe.hf.generate(runner, ids, attention_mask=mask, max_new_tokens=EP_NEW_TOKENS,
                          static_cache=True)
    return torch.equal(out, expected), runner.last_decision.split


@pytest.mark.parametrize("rows_per_rank, split", [((3, 4), True), ((1, 4), False)],
                         ids=["split", "peer_votes_unsplit"])
def test_static_cache_on_two_expert_parallel_ranks(rows_per_rank, split):
    results = run_distributed(2, _static_generate_under_ep, rows_per_rank)
    assert results == [(True, split)] * 2


# ------------------------------------------------------------------------------- GPU
class _Decisions(dbo.DBORunner):
    """The user's runner, keeping each step's split decision as `generate` sets it."""

    def __init__(self, model, config, group=None):
        self.splits = []
        super().__init__(model, config, group=group)

    def __setattr__(self, name, value):
        if name == "last_decision" and value is not None:
            self.splits.append(bool(value.split))
        super().__setattr__(name, value)


def _eager_and_graphed(model, ids, mask, config, group=None):
    """(eager static tokens, graphed tokens, each graphed step's split, Python calls of
    the model while graphed: the eager prompt's, then `warmup` + 1 per captured graph,
    none per replay)."""
    eager = moe.hf.generate(dbo.DBORunner(model, config, group=group), ids,
                            attention_mask=mask, max_new_tokens=NEW_TOKENS, static_cache=True)
    runner = _Decisions(model, config, group=group)
    log = StepLog(model)
    graphed = moe.hf.generate(runner, ids, attention_mask=mask, max_new_tokens=NEW_TOKENS,
                              cuda_graph=True)
    calls = log.calls
    log.calls = -10**6  # later uses of the model no longer count
    return eager, graphed, runner.splits, calls


# A prompt run unsplit, then decode steps split (a split graph) or not (an unsplit one).
GRAPH_CONFIGS = {"split": dbo.DBOConfig(min_prefill_tokens=10**6, min_decode_tokens=1),
                 "unsplit": dbo.DBOConfig(min_prefill_tokens=10**6, min_decode_tokens=10**6)}
# The model's Python calls of a graphed generate: the prompt (1), then 2 warmup steps and
# the capture of the one decode graph, each 2 calls split, 1 unsplit.
GRAPHED_CALLS = {"split": 1 + 3 * 2, "unsplit": 1 + 3 * 1}


@pytest.mark.gpu
def test_cuda_graph_tokens_equal_the_eager_static_path_and_transformers():
    """One GPU, backend local, Triton experts, float32 (ieee dots): every decode step
    replayed from one captured graph, split and unsplit."""
    device = torch.device("cuda")
    original = tiny_model("qwen3_moe").to(device)
    ids, mask = batch(6, 7, seed=11)
    ids, mask = ids.to(device), mask.to(device)
    expected = reference(original, ids, mask)
    model = moe.hf.convert(original, experts="triton")
    for name, config in GRAPH_CONFIGS.items():
        eager, graphed, splits, calls = _eager_and_graphed(model, ids, mask, config)
        assert torch.equal(graphed, eager), (name, graphed, eager)
        assert torch.equal(graphed, expected), (name, graphed, expected)
        assert splits == [False] + [name == "split"] * (NEW_TOKENS - 1), (name, splits)
        assert calls == GRAPHED_CALLS[name], (name, calls)


def _graphed_under_ep(rank, world):
    group = torch.distributed.group.WORLD
    device = torch.device("cuda", rank)
    ids, mask = batch(4 + rank, 6, seed=20 + rank)
    ids, mask = ids.to(device), mask.to(device)
    original = tiny_model("qwen3_moe").to(device)
    expected = reference(original, ids, mask)
    # The same capacities on both ranks (they are voted on): the largest prompt's rows.
    model = moe.hf.convert(original, group=group, backend="a2a_ll", experts="triton",
                           max_tokens_per_rank=5 * 6,
                           max_tokens_per_ubatch=moe.hf.ubatch_capacity(5, 6))
    out = {}
    for name, config in GRAPH_CONFIGS.items():
        eager, graphed, splits, calls = _eager_and_graphed(model, ids, mask, config, group)
        out[name] = {"eager": torch.equal(graphed, eager),
                     "transformers": torch.equal(graphed, expected),
                     "splits": splits == [False] + [name == "split"] * (NEW_TOKENS - 1),
                     "calls": calls == GRAPHED_CALLS[name]}
    return out


@pytest.mark.gpu
@pytest.mark.multigpu
def test_cuda_graph_on_two_gpus_over_a2a_ll():
    """Two ranks with batches of 4 and 5 sequences, backend a2a_ll: graphed decode steps,
    split and unsplit, give the eager static path's tokens and transformers'."""
    results = run_distributed(2, _graphed_under_ep, backend="nccl")
    ok = {"eager": True, "transformers": True, "splits": True, "calls": True}
    for rank, out in enumerate(results):
        assert out == {"split": ok, "unsplit": ok}, (rank, out)
