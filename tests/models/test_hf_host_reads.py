"""Layer 1 (CPU) and Layer 2 (two gloo processes): host reads of device data in a
converted transformers model's DBO step (`dbo.host_reads`), and `moe.hf.batch_attention_mask`.

A DBO step overlaps only while neither ubatch blocks the host. In a converted model
dbo's own code (moe/, dbo/) reads device data on the host only where it must: the a2a
backend's split sizes (`moe.backends.counts`, read after yielding) and the vote, before
the split. transformers' mask creation reads once per ubatch (its padding or packed-
sequence check) unless it is given the batch's 4D mask (`batch_attention_mask`).
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers")

import dbo  # noqa: E402
import moe.hf  # noqa: E402
from dbo.host_reads import HostRead, format_host_reads, record_host_reads  # noqa: E402
from tests.dist_utils import run_distributed  # noqa: E402
from tests.hf_utils import ARCHS, assert_logits_close, batch, logits, tiny_model  # noqa: E402

DBO_ON = dbo.DBOConfig(split="batch", split_kwargs=("attention_mask",),
                       min_prefill_tokens=1, min_decode_tokens=1)
# Where dbo's own code may read on the host: (module, function) of the innermost frame.
EXPECTED_IN_UBATCH = {("moe.backends.counts", "result")}  # a2a's split sizes
EXPECTED_BEFORE_SPLIT = {("dbo.vote", "vote_min")}  # every rank splits or none


def _place(read: HostRead) -> tuple[str, str]:
    module_line, _, function = read.where.partition(" ")
    return module_line.split(":")[0], function


def _ours(reads: list[HostRead]) -> list[HostRead]:
    return [r for r in reads if r.owner in ("moe", "dbo")]


def _step_reads(rank: int, world: int) -> dict:
    """A converted tiny Qwen3-MoE (2 MoE layers, a2a over both ranks): the host reads of
    one DBO step and one plain call, after a warm-up call of each; then a DBO step given
    the batch's 4D mask: its logits and host reads."""
    group = dist.group.WORLD
    model = tiny_model("qwen3_moe")
    ids, mask = batch(4, 6, seed=rank)
    expected = logits(model, ids, mask)
    moe.hf.convert(model, group=group, backend="a2a")
    runner = dbo.DBORunner(model, DBO_ON, group=group)
    mask_4d = moe.hf.batch_attention_mask(model, ids, mask)
    out = {}
    with torch.no_grad():
        for name, call, m in (("dbo", runner, mask), ("plain", model, mask),
                              ("dbo 4d", runner, mask_4d)):
            call(input_ids=ids, attention_mask=m, use_cache=False)
            with record_host_reads() as reads:
                result = call(input_ids=ids, attention_mask=m, use_cache=False).logits
            assert_logits_close(result, expected)
            out[name] = reads
    assert runner.last_decision.split, runner.last_decision.reason
    return out


def test_dbo_step_of_a_converted_model_reads_on_the_host_only_where_expected():
    for rank, out in enumerate(run_distributed(2, _step_reads)):
        dbo_reads, plain, dbo_4d = out["dbo"], out["plain"], out["dbo 4d"]
        report = format_host_reads(dbo_reads)
        in_step = [r for r in dbo_reads if r.ubatch_id is not None]
        # Ours: the a2a count read, once per MoE layer (2) and ubatch, and the vote.
        assert sorted((r.ubatch_id, _place(r)) for r in _ours(in_step)) == sorted(
            (ub, place) for ub in (0, 1) for place in EXPECTED_IN_UBATCH for _ in range(2)), report
        assert {_place(r) for r in _ours(dbo_reads) if r.ubatch_id is None} \
            == EXPECTED_BEFORE_SPLIT, report
        assert [_place(r) for r in _ours(plain)] == [("moe.backends.counts", "result")] * 2
        # transformers' mask creation reads in each ubatch (the recorder is active in
        # both greenlets), the second's while the first has work queued ...
        theirs = [r for r in in_step if r.owner == "transformers"]
        assert {(r.ubatch_id, r.other_started) for r in theirs} == {(0, False), (1, True)}
        assert all(_place(r)[0] == "transformers.masking_utils" for r in theirs), report
        # ... and not given the batch's 4D mask: then only the expected reads are left.
        assert [r for r in dbo_4d if r.owner not in ("moe", "dbo")] == [], \
            format_host_reads(dbo_4d)
        assert {_place(r) for r in dbo_4d} == EXPECTED_IN_UBATCH | EXPECTED_BEFORE_SPLIT


@pytest.mark.parametrize("arch", ARCHS)
def test_batch_attention_mask_gives_the_2d_masks_logits_under_dbo(arch):
    model = tiny_model(arch)
    ids, mask = batch(3, 6, seed=1)  # rows 1 and 2 left-padded
    expected = logits(model, ids, mask)
    mask_4d = moe.hf.batch_attention_mask(model, ids, mask)
    assert mask_4d.shape == (3, 1, 6, 6) and mask_4d.dtype == torch.bool
    assert torch.equal(logits(model, ids, mask_4d), expected)
    moe.hf.convert(model)
    runner = dbo.DBORunner(model, DBO_ON)
    with torch.no_grad():
        out = runner(input_ids=ids, attention_mask=mask_4d, use_cache=False).logits
    assert runner.last_decision.split, runner.last_decision.reason
    assert_logits_close(out, expected)


def test_batch_attention_mask_leaves_masks_the_model_uses_as_they_are():
    model = tiny_model("qwen3_moe")
    ids, _ = batch(2, 5, seed=0)
    ones = torch.ones_like(ids)  # no padding: sdpa runs causal, without a mask
    assert moe.hf.batch_attention_mask(model, ids, ones) is ones
    assert moe.hf.batch_attention_mask(model, ids, None) is None
    with pytest.raises(ValueError, match=r"input_ids \(2, 5\) and attention_mask \(2, 4\)"):
        moe.hf.batch_attention_mask(model, ids, ones[:, :4])


def test_batch_attention_mask_refuses_layers_of_mixed_attention_kinds():
    model = tiny_model("qwen2_moe", layer_types=["full_attention", "sliding_attention"],
                       use_sliding_window=True, sliding_window=4)
    ids, mask = batch(2, 5, seed=0)
    with pytest.raises(ValueError, match="mix attention kinds.*pass the 2D attention mask"):
        moe.hf.batch_attention_mask(model, ids, mask)
