"""Layer 1 (CPU) and Layer 2 (two gloo processes): `moe.hf.load` of tiny checkpoints that
the tests save themselves (no download): the loaded model's logits equal the saved
model's for the four fused architectures and for families of the experts path, one for
each way their checkpoints hold the experts (per expert under their own names, fused
under other names, interleaved, transposed and biased, ungated, with zero-compute
experts), from per-expert tensors (what `save_pretrained` writes), fused ones and
shards; under EP each rank holds and reads only its own experts (tested with two ranks
in tests/models/test_hf_convert.py and tests/models/test_hf_save.py); bad input is
refused in one line naming the tensor, before the model is returned: a missing tensor,
a config that does not match the weights, a checkpoint of another architecture than
its config.json names, a quantized checkpoint, a family without a causal LM, a
conversion not known to keep the experts apart, and a tensor an experts module computes
when built (experts modules are built on the meta device).
"""
from __future__ import annotations

import json
import os

import pytest
import torch

pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

import moe.hf  # noqa: E402
from moe.hf import coverage  # noqa: E402
from tests.hf_utils import (ARCHS, assert_logits_close, batch, logits, rewrite_without,  # noqa: E402
                            save, tiny_model)

# Families of the experts path, each for a way its checkpoints hold the experts.
GENERIC = {
    "olmoe": "experts.{e}.gate_proj / up_proj / down_proj, stacked and joined on load",
    "phimoe": "block_sparse_moe.experts.{e}.w1 / w3 / w2, renamed to mlp.experts",
    "granitemoe": "input_linear / output_linear over all experts, renamed",
    "gpt_oss": "gate_up_proj [E, H, 2I] interleaved, transposed, with biases",
    "inkling2": "model.llm.*.experts.w13_weight, interleaved on load",
    "nemotron_h": "backbone.*.experts.{e}.up_proj / down_proj: no gate",
    "longcat_flash": "gate_up_proj of E + Z experts, Z of them zero-compute",
}


def _one_line(exc: pytest.ExceptionInfo) -> str:
    message = str(exc.value)
    assert "\n" not in message, message
    return message


def _edit_config(path, **fields) -> None:
    file = os.path.join(path, "config.json")
    with open(file) as f:
        config = json.load(f)
    config.update(fields)
    with open(file, "w") as f:
        json.dump(config, f)


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


@pytest.mark.parametrize("family", sorted(GENERIC))
def test_checkpoints_of_the_experts_path_load(family, tmp_path):
    model = coverage.tiny_model(family)
    path = save(model, tmp_path)
    ids, mask = batch(3, 6, seed=4, vocab=64)
    loaded = moe.hf.load(path)
    assert {r.route for r in loaded.dbo_conversion} == {"experts"}
    assert_logits_close(logits(loaded, ids, mask), logits(model, ids, mask))


def test_the_fused_architectures_load_on_the_experts_path(tmp_path):
    model = tiny_model("deepseek_v3")
    ids, mask = batch(2, 5, seed=5)
    loaded = moe.hf.load(save(model, tmp_path), conversion="experts")
    assert {r.route for r in loaded.dbo_conversion} == {"experts"}
    assert_logits_close(logits(loaded, ids, mask), logits(model, ids, mask))


def test_a_missing_tensor_of_an_experts_path_checkpoint_is_named(tmp_path):
    path = save(coverage.tiny_model("olmoe"), tmp_path / "olmoe")
    name = "model.layers.1.mlp.experts.3.up_proj.weight"
    rewrite_without(path, lambda k: k == name)
    with pytest.raises(ValueError) as exc:
        moe.hf.load(path)
    assert f"has no tensor '{name}' (expert 3 of block 'model.layers.1.mlp')" in _one_line(exc)
    path = save(coverage.tiny_model("olmoe"), tmp_path / "dense")
    name = "model.layers.0.self_attn.q_norm.weight"
    rewrite_without(path, lambda k: k == name)
    with pytest.raises(ValueError) as exc:
        moe.hf.load(path)
    assert f"has no tensor for '{name}'" in _one_line(exc)


def test_a_fused_expert_tensor_of_another_shape_is_named(tmp_path):
    path = save(coverage.tiny_model("gpt_oss"), tmp_path)
    _edit_config(path, intermediate_size=16)  # the checkpoint's experts are 64 wide
    with pytest.raises(ValueError) as exc:
        moe.hf.load(path)
    message = _one_line(exc)
    assert ("tensor 'model.layers.0.mlp.experts.gate_up_proj' (a model weight) has shape "
            "[4, 64, 128] in the checkpoint, but the model built from config.json needs "
            "[4, 64, 32]") in message, message


def test_a_quantized_checkpoint_is_refused(tmp_path):
    path = save(tiny_model("qwen3_moe"), tmp_path)
    _edit_config(path, quantization_config={"quant_method": "fp8"})
    with pytest.raises(ValueError) as exc:
        moe.hf.load(path)
    assert "quantization_config" in _one_line(exc) and "'fp8'" in str(exc.value)


def test_a_family_without_a_causal_lm_is_refused(tmp_path):
    path = save(coverage.tiny_model("mistral4"), tmp_path)
    with pytest.raises(ValueError) as exc:
        moe.hf.load(path)
    assert "transformers has no causal LM for a 'mistral4' config" in _one_line(exc)


def test_a_conversion_not_known_to_keep_experts_apart_is_refused(tmp_path):
    path = save(coverage.tiny_model("inkling2_loop"), tmp_path)
    with pytest.raises(ValueError) as exc:
        moe.hf.load(path)
    message = _one_line(exc)
    assert message.startswith("moe.hf.load: inkling2_loop_text checkpoints: transformers "
                              "converts the tensors of 'model.layers.0.mlp.experts.gate_up_proj' "
                              "with Inkling2LoopDequantizeExperts, which dbo cannot apply to one "
                              "rank's experts alone") \
        and "AutoModelForCausalLM.from_pretrained(path)) and convert it" in message, message


def test_a_refused_load_leaves_the_experts_classes_as_they_were(tmp_path):
    """The experts modules are built on the meta device while `load` builds the model;
    after a refusal (here: a tensor the checkpoint lacks) they build on the CPU again."""
    path = save(tiny_model("qwen3_moe"), tmp_path)
    rewrite_without(path, lambda k: k == "model.norm.weight")
    with pytest.raises(ValueError, match="has no tensor for 'model.norm.weight'"):
        moe.hf.load(path)
    experts = tiny_model("qwen3_moe").model.layers[0].mlp.experts
    assert not experts.gate_up_proj.is_meta and experts.gate_up_proj.abs().sum() > 0


def test_a_tensor_an_experts_module_computes_when_built_is_refused(tmp_path, monkeypatch):
    """Experts modules are built on the meta device: a non-persistent buffer one computes
    in its constructor is not in the checkpoint, and a converted block that keeps it
    (Inkling2's own gate keeps its module's buffers) would compute with nothing."""
    model = coverage.tiny_model("inkling2")
    path = save(model, tmp_path)
    cls = type(model.model.layers[0].mlp.experts)
    init = cls.__init__

    def with_table(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.register_buffer("table", torch.arange(4.0), persistent=False)

    monkeypatch.setattr(cls, "__init__", with_table)
    with pytest.raises(ValueError) as exc:
        moe.hf.load(path)
    assert ("tensor 'model.layers.0.mlp.experts.gate_owner.table' is not in the checkpoint "
            "and its module was built on the meta device") in _one_line(exc)


def test_load_refuses_a_checkpoint_of_another_architecture(tmp_path):
    path = save(tiny_model("mixtral"), tmp_path / "mixtral")
    # Mixtral's weights under a Qwen3-MoE config.json (same sizes).
    _edit_config(path, model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"],
                 num_experts=4, moe_intermediate_size=16, head_dim=8)
    with pytest.raises(ValueError) as exc:
        moe.hf.load(path)
    assert ("has no tensor 'model.layers.0.mlp.experts.0.gate_proj.weight' (expert 0 of block "
            "'model.layers.0.mlp')") in _one_line(exc)


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
