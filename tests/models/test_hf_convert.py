"""Layer 1 (CPU) and Layer 2 (two gloo processes): `moe.hf.convert` on tiny random
transformers models of the four architectures (Mixtral, Qwen2-MoE, Qwen3-MoE,
DeepSeek-V3): the converted model's logits equal the original's with DBO off and on, on
one process and on two expert-parallel ranks with different batches (and, there,
`moe.hf.load` under EP: half the experts' bytes per rank, and each rank reads only its
own experts); what it refuses, with nothing converted.

DBO splits the Hugging Face forward with `split="batch"`: its inputs are padded
[B, S] (input_ids, attention_mask), every row is computed on its own, and positions come
from the row itself, so two ubatches of whole rows give the rows of the whole batch.
A rank with zero sequences is not tested: the transformers forward itself rejects an
empty batch (its attention reshapes [0, S, -1, D]).
"""
from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers")

import dbo  # noqa: E402
import moe.hf  # noqa: E402
from moe.hf import coverage  # noqa: E402
from moe.hf import HFMoEBlock, expert_bytes  # noqa: E402
from tests.dist_utils import run_distributed  # noqa: E402
from tests.hf_utils import (ARCHS, assert_logits_close, batch, logits, rewrite_without,  # noqa: E402
                            save, tiny_model)

# input_ids= gives the rows; attention_mask= is [B, S] too, declared so (no warning).
DBO_ON = dbo.DBOConfig(split="batch", split_kwargs=("attention_mask",),
                       min_prefill_tokens=1, min_decode_tokens=1)


def run_dbo(model, ids, mask, group=None):
    runner = dbo.DBORunner(model, DBO_ON, group=group)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", dbo.SplitArgumentWarning)
        out = runner(input_ids=ids, attention_mask=mask, use_cache=False)
    return out.logits, runner.last_decision


@pytest.mark.parametrize("arch", ARCHS)
def test_converted_logits_equal_the_original_dbo_off_and_on(arch):
    model = tiny_model(arch)
    ids, mask = batch(3, 6, seed=1)
    expected = logits(model, ids, mask)
    assert moe.hf.convert(model) is model
    blocks = [m for m in model.modules() if isinstance(m, HFMoEBlock)]
    assert len(blocks) == (1 if arch == "deepseek_v3" else 2)
    assert [b.moe.last_layer for b in blocks] == [False] * (len(blocks) - 1) + [True]
    assert_logits_close(logits(model, ids, mask), expected)
    out, decision = run_dbo(model, ids, mask)
    assert decision.split, decision.reason
    assert_logits_close(out, expected)


def test_routing_follows_the_config():
    qwen = tiny_model("qwen2_moe")  # norm_topk_prob defaults to False
    assert not moe.hf.convert(qwen).model.layers[0].mlp.moe.config.renormalize
    ds = moe.hf.convert(tiny_model("deepseek_v3")).model.layers[1].mlp.moe
    cfg = ds.config
    assert (cfg.scoring, cfg.n_group, cfg.topk_group, cfg.use_correction_bias,
            cfg.routed_scaling_factor, cfg.renormalize) == ("sigmoid", 4, 2, True, 2.5, True)
    assert ds.router.fp32_logits and ds.shared_experts is not None


def test_unsupported_block_is_refused_naming_it_and_what():
    # JetMoE's mixture of attention heads takes its layer input, not the routing: neither
    # path runs it. (GPT-OSS, OLMoE and Llama-4, refused before, convert now:
    # tests/models/test_hf_coverage.py checks them.)
    jetmoe = coverage.tiny_model("jetmoe")
    with pytest.raises(ValueError, match=r"block 'model.layers.0.self_attention' \(JetMoeAttention, "
                                         r"experts JetMoeMoA\): its experts take "
                                         r"forward\(layer_input\), not the routing"):
        moe.hf.convert(jetmoe)
    olmoe = moe.hf.convert(tiny_model("olmoe", intermediate_size=16, num_experts=4,
                                      num_experts_per_tok=2))
    assert [r.route for r in olmoe.dbo_conversion] == ["experts", "experts"]
    assert olmoe.dbo_conversion_summary == (
        "moe.hf.convert: olmoe: 2 MoE blocks, 2 on the experts path (OlmoeExperts: "
        "silu(gate) * up)")


def test_nothing_is_converted_when_a_later_block_is_refused():
    model = tiny_model("mixtral")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    blocks = [model.model.layers[0].mlp, model.model.layers[1].mlp]
    model.model.layers[1].mlp.experts.has_bias = True  # only the last block is bad
    with pytest.raises(ValueError, match="model.layers.1.mlp.*biased experts"):
        moe.hf.convert(model)
    assert [model.model.layers[0].mlp, model.model.layers[1].mlp] == blocks
    after = model.state_dict()
    assert after.keys() == before.keys()
    assert all(torch.equal(after[k], v) for k, v in before.items())


def test_a_converted_model_is_not_converted_again():
    model = moe.hf.convert(tiny_model("qwen3_moe"))
    with pytest.raises(ValueError, match="'model.layers.0.mlp' is already converted"):
        moe.hf.convert(model)


def _ep_ranks(rank: int, world: int, root: str) -> dict:
    """Under EP 2, every architecture: converted, this rank's experts and logits equal
    the unconverted model's on this rank's own batch, DBO off and on, then a step where
    rank 1 has one sequence (no split anywhere: the vote); loaded from its checkpoint,
    half the experts' bytes and the same logits; a checkpoint lacking rank 1's experts
    loads on rank 0; E=3 refused."""
    group = dist.group.WORLD
    result = {}
    shapes = [(3, 6), (2, 4)][rank], [(3, 6), (1, 5)][rank]
    for arch in ARCHS:
        model = tiny_model(arch)
        steps = [batch(*shape, seed=10 * rank + i) for i, shape in enumerate(shapes)]
        expected = [logits(model, ids, mask) for ids, mask in steps]
        moe.hf.convert(model, group=group)
        first = [m.moe.first_expert for m in model.modules() if isinstance(m, HFMoEBlock)]
        for (ids, mask), ref in zip(steps, expected):
            assert_logits_close(logits(model, ids, mask), ref)
        decisions = []
        for (ids, mask), ref in zip(steps, expected):
            out, decision = run_dbo(model, ids, mask, group)
            assert_logits_close(out, ref)
            decisions.append(decision.split)
        loaded = moe.hf.load(os.path.join(root, arch), group=group)
        assert_logits_close(logits(loaded, *steps[0]), expected[0])
        result[arch] = (first[0], decisions, expert_bytes(model), expert_bytes(loaded))
    try:
        moe.hf.load(os.path.join(root, "half"), group=group)
        result["half"] = "loaded"
    except ValueError as exc:
        result["half"] = str(exc)
    bad = tiny_model("mixtral", num_local_experts=3)
    try:
        moe.hf.convert(bad, group=group)
    except ValueError as exc:
        result["not divisible"] = str(exc)
    assert all(type(m).__name__ == "MixtralSparseMoeBlock" for m in
               (bad.model.layers[0].mlp, bad.model.layers[1].mlp))
    return result


def test_expert_parallel_two_ranks_convert_and_load(tmp_path):
    full_bytes = {}
    for arch in ARCHS:
        model = tiny_model(arch)
        save(model, tmp_path / arch)
        full_bytes[arch] = expert_bytes(moe.hf.convert(model))
    half = save(tiny_model("deepseek_v3"), tmp_path / "half")
    # Experts 4..7 are rank 1's of 2: rank 0 reads none of them.
    rewrite_without(half, lambda k: any(f".experts.{e}." in k for e in range(4, 8)))
    results = run_distributed(2, _ep_ranks, os.fspath(tmp_path))
    for rank, result in enumerate(results):
        for arch in ARCHS:
            num_experts = 8 if arch == "deepseek_v3" else 4
            first, decisions, converted, loaded = result[arch]
            assert (first, decisions) == (rank * num_experts // 2, [True, False]), (rank, arch)
            assert converted * 2 == loaded * 2 == full_bytes[arch], (rank, arch)
        assert ("has num_experts=3, which is not divisible by the EP size 2"
                in result["not divisible"])
    assert results[0]["half"] == "loaded"
    assert "has no tensor 'model.layers.1.mlp.experts.4.gate_proj.weight'" in results[1]["half"]


def test_a_converted_model_is_split_by_sequences_by_default():
    """DBORunner(model) with the default config cuts a converted model's [B, S] batch
    between sequences (its `dbo_split_mode`), and gives the unsplit logits."""
    import dbo
    from tests.hf_utils import tiny_model

    model = moe.hf.convert(tiny_model("qwen3_moe"))
    assert model.dbo_split_mode == "batch"
    ids = torch.randint(0, model.config.vocab_size, (4, 8))
    runner = dbo.DBORunner(model, dbo.DBOConfig(min_prefill_tokens=0))
    with torch.inference_mode():
        out = runner(input_ids=ids, use_cache=False).logits
        expected = model(input_ids=ids, use_cache=False).logits
    assert runner.last_decision.split
    assert "split=None chose 'batch'" in runner.last_decision.reason
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)  # fp32 row blocking
