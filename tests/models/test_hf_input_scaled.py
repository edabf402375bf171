"""Layer 1 (CPU): Llama-4's MoE block on the experts path (`moe.hf.input_scaled`): its
experts scale their input by the routing weight and take pre-routed dense rows, so the
whole block is replaced -- its router and shared expert kept, dbo's experts on the
scaled rows; the converted logits match transformers', DBO off and on; top-k > 1 is
refused in one line with the model left as it was.

Tolerance: 1e-5 of the logits' scale (`tests.hf_utils.assert_logits_close`): float32,
the experts' GEMMs over other row groupings (transformers runs every expert on every
token, dbo only the routed rows).
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import dbo  # noqa: E402
import moe.hf  # noqa: E402
from moe.hf import coverage  # noqa: E402
from moe.hf.generic import HFExperts  # noqa: E402
from moe.hf.input_scaled import InputScaledBlock  # noqa: E402
from tests.hf_utils import assert_logits_close, batch, logits  # noqa: E402

DBO_ON = dbo.DBOConfig(split="batch", split_kwargs=("attention_mask",),
                       min_prefill_tokens=1, min_decode_tokens=1)


def _llama4(top_k: int = 1) -> torch.nn.Module:
    config = coverage.tiny_config("llama4")
    config.num_experts_per_tok = top_k
    torch.manual_seed(0)
    return coverage.model_class(config)._from_config(config).eval()


def test_the_block_is_replaced_keeping_its_router_and_shared_expert():
    model = _llama4()
    old = model.model.layers[0].feed_forward
    router, shared = old.router, old.shared_expert
    ids, mask = batch(3, 6, seed=1)
    expected = logits(model, ids, mask)
    moe.hf.convert(model)
    block = model.model.layers[0].feed_forward
    assert isinstance(block, InputScaledBlock) and isinstance(block.experts, HFExperts)
    assert block.router is router and block.shared_expert is shared
    assert "routing weight on the input" in model.dbo_conversion_summary
    # The routed experts' tensors are dbo's now; the block's other names are unchanged.
    names = {k for k in model.state_dict() if ".feed_forward." in k}
    assert "model.layers.0.feed_forward.router.weight" in names
    assert "model.layers.0.feed_forward.experts.w13" in names
    assert_logits_close(logits(model, ids, mask), expected)
    runner = dbo.DBORunner(model, DBO_ON)
    with torch.inference_mode(), pytest.warns(dbo.NoYieldWarning):
        out = runner(input_ids=ids, attention_mask=mask, use_cache=False).logits
    assert runner.last_decision.split
    assert_logits_close(out, expected)


def test_the_scaling_goes_on_the_input_not_the_output():
    # With the weight applied after the experts instead, the logits differ: the test
    # above could not pass by accident of the weights.
    model = _llama4()
    ids, mask = batch(2, 5, seed=2)
    expected = logits(model, ids, mask)
    moe.hf.convert(model)
    for module in model.modules():
        if isinstance(module, InputScaledBlock):
            module.forward = _output_scaled_forward(module)
    got = logits(model, ids, mask)
    assert (got - expected).abs().max() > 1e-3 * expected.abs().max()


def _output_scaled_forward(block: InputScaledBlock):
    def forward(hidden_states):
        x = hidden_states.reshape(-1, block.hidden_dim)
        scores, router_logits = block.router(x)
        ids = torch.topk(router_logits, block.top_k, dim=1).indices
        routed = block.experts(x, ids, scores.gather(1, ids).float())
        return block.shared_expert(x) + routed, router_logits
    return forward


def test_top_k_above_one_is_refused_with_nothing_converted():
    model = _llama4(top_k=2)
    before = [(name, type(m)) for name, m in model.named_modules()]
    with pytest.raises(ValueError, match=r"feed_forward.*top_k=2.*top-1"):
        moe.hf.convert(model)
    assert [(name, type(m)) for name, m in model.named_modules()] == before
    assert not hasattr(model, "dbo_conversion")


def test_generate_on_the_static_cache_with_chunked_attention():
    # Llama-4's chunked-attention layers cache in StaticSlidingWindowLayers: taken while
    # the chunk holds every slot (then it never rolls), refused in one line otherwise.
    from tests.models.test_hf_generate import NEW_TOKENS, SPLIT_ALWAYS, reference
    ids, mask = batch(4, 7, seed=4)
    expected = reference(_llama4(), ids, mask)
    runner = dbo.DBORunner(moe.hf.convert(_llama4()), SPLIT_ALWAYS)
    with pytest.warns(dbo.NoYieldWarning):
        out = moe.hf.generate(runner, ids, attention_mask=mask, max_new_tokens=NEW_TOKENS,
                              static_cache=True)
    assert torch.equal(out, expected)
    small = _llama4()
    small.config.attention_chunk_size = 8
    runner = dbo.DBORunner(moe.hf.convert(small), SPLIT_ALWAYS)
    with pytest.raises(ValueError, match=r"a window of 8 tokens .* fewer than the \d+ the prompt and"):
        moe.hf.generate(runner, ids, attention_mask=mask, max_new_tokens=NEW_TOKENS,
                        static_cache=True)


def test_a_repeated_static_step_gives_the_same_logits_with_chunked_attention():
    # A CUDA graph's warm-up and capture repeat a decode step at its slot (five times
    # here, past the cache's free slots): the chunked layers' host counts must not
    # reach the cache size, or they roll the cache and shift the mask.
    import transformers

    from moe.hf.generate import GroupedDecoder, RowGroup
    from moe.hf.static_decode import StaticDecoder, mask_buffer, slot_tensor
    from moe.hf.static_kv import static_cache_from_prompt
    model = moe.hf.convert(_llama4())
    ids, mask = batch(3, 5, seed=6)
    prompt = transformers.DynamicCache(config=model.config)
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    with torch.no_grad():
        GroupedDecoder(model)(ids, mask, positions,
                              groups=(RowGroup(rows=slice(0, 3), cache=prompt),))
    slots = 7
    kv = static_cache_from_prompt(model, prompt, max_cache_len=slots, split_at=None)
    step_mask = mask_buffer(mask, slots)
    step_mask[:, 5] = 1
    step = StaticDecoder(model)
    with torch.no_grad():
        outs = [step(ids[:, -1:], step_mask, positions[:, -1:] + 1, slot_tensor(5, ids.device),
                     kv=kv) for _ in range(5)]
        full = model(input_ids=torch.cat([ids, ids[:, -1:]], 1),
                     attention_mask=step_mask[:, :6], use_cache=False).logits[:, -1].float()
    assert all(torch.equal(out, outs[0]) for out in outs)
    torch.testing.assert_close(outs[0], full, rtol=1e-5, atol=1e-5 * full.abs().max().item())
