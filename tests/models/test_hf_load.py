"""Layer 1 (CPU) and Layer 2 (two gloo processes): `moe.hf.load` of tiny checkpoints that
the tests save themselves (no download): the loaded model's logits equal the saved
model's for the four architectures, from per-expert tensors (what `save_pretrained`
writes), fused ones and shards; under EP each rank holds and reads only its own experts
(tested with two ranks in tests/models/test_hf_convert.py, beside convert); a missing tensor and a config that does not match the weights are refused by name.
"""
from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

import moe.hf  # noqa: E402
from tests.hf_utils import (ARCHS, assert_logits_close, batch, logits, rewrite_without,  # noqa: E402
                            save, tiny_model)


@pytest.mark.parametrize("arch", ARCHS)
def test_loaded_logits_equal_the_saved_model(arch, tmp_path):
    model = tiny_model(arch)
    path = save(model, tmp_path)
    ids, mask = batch(3, 6, seed=2)
    loaded = moe.hf.load(path)
    assert not loaded.training
    assert_logits_close(logits(loaded, ids, mask), logits(model, ids, mask))


def test_fused_and_sharded_checkpoints_load(tmp_path):
    model = tiny_model("qwen2_moe")
    ids, mask = batch(2, 5, seed=3)
    expected = logits(model, ids, mask)
    fused = tmp_path / "fused"
    model.config.save_pretrained(fused)  # the in-memory names: experts.gate_up_proj [E, 2I, H]
    safetensors_torch.save_file({k: v.contiguous() for k, v in model.state_dict().items()},
                                os.fspath(fused / "model.safetensors"), metadata={"format": "pt"})
    assert_logits_close(logits(moe.hf.load(fused), ids, mask), expected)
    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, max_shard_size="40KB")
    assert (sharded / "model.safetensors.index.json").exists()
    assert_logits_close(logits(moe.hf.load(sharded), ids, mask), expected)


def test_a_missing_expert_tensor_is_named(tmp_path):
    path = save(tiny_model("mixtral"), tmp_path)
    name = "model.layers.1.block_sparse_moe.experts.2.w3.weight"
    rewrite_without(path, lambda k: k == name)
    with pytest.raises(ValueError, match=f"has no tensor '{name}' .*block 'model.layers.1.mlp'"):
        moe.hf.load(path)


def test_config_and_checkpoint_shapes_must_agree(tmp_path):
    path = save(tiny_model("qwen3_moe"), tmp_path)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["moe_intermediate_size"] = 24
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match=r"'model.layers.0.mlp.experts.0.gate_proj.weight'.*"
                                         r"has shape \[16, 32\].*needs \[24, 32\].*"
                                         r"config.json and the weights disagree"):
        moe.hf.load(path)
