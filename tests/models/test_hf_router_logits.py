"""Layer 1 (CPU): `output_router_logits=True` on a converted transformers model returns
the router logits (and, where the model computes one, the aux loss) of the unconverted
model, for the four architectures, whether or not the model had recorded outputs before
it was converted; a DBO step asked for them refuses in the merge, naming the output.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import dbo  # noqa: E402
import moe.hf  # noqa: E402
from tests.hf_utils import ARCHS, assert_logits_close, batch, tiny_model  # noqa: E402


def _call(model, ids, mask):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, use_cache=False,
                     output_router_logits=True)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("hooked_before", [False, True], ids=["fresh", "hooked-before"])
def test_router_logits_equal_the_unconverted_model(arch, hooked_before):
    ids, mask = batch(3, 6, seed=1)
    expected = _call(tiny_model(arch), ids, mask)
    model = tiny_model(arch)
    if hooked_before:  # transformers installs its hooks on the first call that records
        _call(model, ids, mask)
    moe.hf.convert(model)
    out = _call(model, ids, mask)
    num_moe = 1 if arch == "deepseek_v3" else 2
    assert len(expected.router_logits) == len(out.router_logits) == num_moe
    for got, want in zip(out.router_logits, expected.router_logits):
        assert got.shape == want.shape == (3 * 6, want.shape[1])
        assert got.dtype == want.dtype
        assert_logits_close(got, want)
    if getattr(expected, "aux_loss", None) is not None:
        torch.testing.assert_close(out.aux_loss, expected.aux_loss, rtol=1e-5, atol=0.0)


def test_deepseek_router_logits_stay_float32_in_a_bf16_model():
    ids, mask = batch(2, 4, seed=2)
    model = moe.hf.convert(tiny_model("deepseek_v3").to(torch.bfloat16))
    (logits_TE,) = _call(model, ids, mask).router_logits
    assert logits_TE.dtype == torch.float32


def test_router_logits_under_dbo_refuse_in_the_merge_naming_the_output():
    ids, mask = batch(4, 6, seed=1)
    model = moe.hf.convert(tiny_model("qwen3_moe"))
    runner = dbo.DBORunner(model, dbo.DBOConfig(
        split="batch", split_kwargs=("attention_mask",), min_prefill_tokens=1,
        min_decode_tokens=1))
    with pytest.raises((TypeError, ValueError), match=r"aux_loss|router_logits") as err:
        _call(runner, ids, mask)
    assert "DBOConfig(merge=fn)" in str(err.value)
