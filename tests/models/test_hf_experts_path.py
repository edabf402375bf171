"""Layer 1 (CPU): the experts path of `moe.hf.convert` (`moe.hf.generic`) -- on the four
architectures that have a fused path too (`conversion="experts"`), the expert form it
reads from each experts module (GPT-OSS's clamped interleaved biased SwiGLU, Nemotron-H's
ungated relu2, MuseSpark's post-expert norm, Inkling2's own gate, LongCat-Flash's
zero-compute experts), the hooks the DBO runner reads, the record of which path each
block took, GPT-OSS's form on the Triton experts (interpreted on CPU) -- and the bad input it refuses in one line, naming the block and what is
missing, with nothing converted: a block lacking what its flags promise, an
experts-interface option dbo cannot serve, a kernel or backend that cannot run the form,
a gate that does not run, weights of another model. `moe.hf.load` of the path's
checkpoints is tested in tests/models/test_hf_load.py.

Every model family of transformers is checked end to end (one process, two ranks,
generate) in tests/models/test_hf_coverage.py; these are the path's own properties.
"""
from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("transformers")

import moe.hf  # noqa: E402
from moe.hf import HFExperts, coverage, expert_bytes  # noqa: E402
from moe.hf import generic  # noqa: E402
from tests.hf_utils import ARCHS, assert_logits_close, batch, dbo_logits, logits, tiny_model  # noqa: E402


def _experts(model: torch.nn.Module) -> list[HFExperts]:
    return [m for m in model.modules() if isinstance(m, HFExperts)]


def _snapshot(model: torch.nn.Module) -> tuple[dict, list]:
    return ({k: v.clone() for k, v in model.state_dict().items()},
            [(name, type(m)) for name, m in model.named_modules()])


def _assert_unchanged(model: torch.nn.Module, snapshot: tuple[dict, list]) -> None:
    state, modules = snapshot
    assert [(name, type(m)) for name, m in model.named_modules()] == modules
    after = model.state_dict()
    assert after.keys() == state.keys()
    assert all(torch.equal(after[k], v) for k, v in state.items())
    assert not hasattr(model, "dbo_conversion")


@pytest.mark.parametrize("arch", ARCHS)
def test_the_experts_path_on_the_fused_architectures(arch):
    model = tiny_model(arch)
    ids, mask = batch(3, 6, seed=1)
    expected = logits(model, ids, mask)
    moe.hf.convert(model, conversion="experts")
    assert {r.route for r in model.dbo_conversion} == {"experts"}
    assert "not fused: conversion='experts'" in model.dbo_conversion_summary
    assert_logits_close(logits(model, ids, mask), expected)
    for joined in (False, True):
        assert_logits_close(dbo_logits(model, ids, mask, joined=joined), expected)


@pytest.mark.parametrize("model_type, form, identity", [
    ("gpt_oss", dict(activation="swiglu_oai", swiglu_alpha=1.702, swiglu_limit=7.0,
                     interleaved=True, bias=True), 0),
    ("nemotron_h", dict(gated=False, activation="relu2"), 0),
    ("muse_spark", dict(post_norm=True), 0),
    ("inkling2", dict(activation="custom"), 0),  # act_fn(gate, up): no name for it
    ("longcat_flash", dict(), 2),
])
def test_the_form_is_read_from_the_experts_module(model_type, form, identity):
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    if model_type not in CONFIG_MAPPING_NAMES:
        pytest.skip(f"this transformers has no {model_type!r} (5.24 has)")
    model = coverage.tiny_model(model_type)
    moe.hf.convert(model)
    for experts in _experts(model):
        assert experts.form == generic.ExpertForm(**form)
        assert experts.identity_experts == identity


def test_the_runner_reads_the_layer_hooks_of_the_experts_path():
    model = coverage.tiny_model("gpt_oss")
    moe.hf.convert(model, experts="reference")
    experts = _experts(model)
    assert [e.last_layer for e in experts] == [False, True]
    agreement = experts[0].dbo_agreement()
    assert agreement["expert_form"] == experts[0].form.describe()
    assert agreement["num_experts"] == 4 and agreement["top_k"] == 2
    assert "experts 'reference'" in experts[0].cuda_graph_blocker
    assert experts[0].dbo_sbo_blocker() is not None  # one rank: nothing to overlap
    tensors = [t for e in experts for t in (e.w13, e.w2, e.bias13, e.bias2)]
    assert expert_bytes(model) == sum(t.numel() * t.element_size() for t in tensors)


def test_a_later_refused_block_leaves_the_model_as_it_was():
    model = coverage.tiny_model("olmoe")
    model.model.layers[1].mlp.experts.has_bias = True  # promises biases it does not have
    snapshot = _snapshot(model)
    with pytest.raises(ValueError, match=r"^moe.hf.convert: block 'model.layers.1.mlp' "
                                         r"\(OlmoeSparseMoeBlock, experts OlmoeExperts\): "
                                         r"biased experts \(has_bias=True\) without the tensor "
                                         r"experts.gate_up_proj_bias$"):
        moe.hf.convert(model)
    _assert_unchanged(model, snapshot)


def test_an_interface_option_dbo_cannot_serve_is_refused(monkeypatch):
    model = coverage.tiny_model("olmoe")
    snapshot = _snapshot(model)
    # transformers' own expert parallelism (5.24 marks its experts so)
    model.model.layers[0].mlp.experts._is_expert_parallel = True
    with pytest.raises(ValueError, match=r"block 'model.layers.0.mlp' .*: transformers' own "
                                         r"expert parallelism is on"):
        moe.hf.convert(model)
    del model.model.layers[0].mlp.experts._is_expert_parallel
    # an option a later transformers adds, set on this module
    options = {**generic.interface_options(), "has_router_scale": False}
    monkeypatch.setattr(generic, "interface_options", lambda: options)
    model.model.layers[1].mlp.experts.has_router_scale = True
    with pytest.raises(ValueError, match=r"block 'model.layers.1.mlp' .*: experts-interface "
                                         r"option has_router_scale=True, which dbo cannot serve"):
        moe.hf.convert(model)
    del model.model.layers[1].mlp.experts.has_router_scale
    _assert_unchanged(model, snapshot)


def _has_model_type(model_type: str) -> bool:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    return model_type in CONFIG_MAPPING_NAMES


@pytest.mark.skipif(not _has_model_type("inkling2"), reason="this transformers has no "
                    "'inkling2' (5.24 has)")
def test_a_kernel_that_cannot_run_the_form_is_refused():
    model = coverage.tiny_model("inkling2")
    snapshot = _snapshot(model)
    with pytest.raises(ValueError, match=r"block 'model.layers.0.mlp' .*: the triton experts "
                                         r"compute the named activations .*, not the model's "
                                         r"own activation callable \(activation='custom'\): "
                                         r"use experts 'grouped' or 'reference'$"):
        moe.hf.convert(model, experts="triton")
    _assert_unchanged(model, snapshot)


@pytest.mark.triton
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="runs the Triton experts on CPU tensors, which needs the "
                           "interpreter (conftest sets TRITON_INTERPRET=1 without CUDA)")
def test_gpt_oss_experts_run_on_the_triton_kernels():
    """GPT-OSS's interleaved, biased, clamped SwiGLU in the Triton GEMM epilogues, chosen
    by experts="triton" (on CUDA, "auto" picks it too): the model's logits."""
    model = coverage.tiny_model("gpt_oss")
    ids, mask = batch(2, 5, seed=1)
    expected = logits(model, ids, mask)
    moe.hf.convert(model, experts="triton")
    kernels = [e._kernel(torch.device("cpu")).experts for e in _experts(model)]
    assert [k.name for k in kernels] == ["triton", "triton"]
    assert_logits_close(logits(model, ids, mask), expected)


def test_a_backend_or_conversion_that_cannot_run_the_block_is_refused():
    model = coverage.tiny_model("gpt_oss")
    snapshot = _snapshot(model)
    with pytest.raises(ValueError, match=r"backend 'naive_mono' routes gathered router logits "
                                         r"itself"):
        moe.hf.convert(model, backend="naive_mono")
    with pytest.raises(ValueError, match=r"conversion='fused': use one of"):
        moe.hf.convert(model, conversion="fused")
    _assert_unchanged(model, snapshot)


def test_a_gate_that_does_not_run_is_refused_naming_it():
    model = coverage.tiny_model("gpt_oss")
    experts = model.model.layers[0].mlp.experts

    def broken(gate_up: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("needs a tensor the module does not have")

    experts._apply_gate = broken
    snapshot = _snapshot(model)
    with pytest.raises(ValueError, match=r"its activation \(GptOssExperts._apply_gate\) fails "
                                         r"on a probe: RuntimeError: needs a tensor"):
        moe.hf.convert(model)
    _assert_unchanged(model, snapshot)


def test_weights_of_another_model_are_refused():
    model = coverage.tiny_model("olmoe")  # built for 4 experts
    experts = model.model.layers[0].mlp.experts
    with torch.no_grad():  # as a checkpoint of an 8-expert model loaded into it
        experts.gate_up_proj = torch.nn.Parameter(experts.gate_up_proj.repeat(2, 1, 1))
        experts.down_proj = torch.nn.Parameter(experts.down_proj.repeat(2, 1, 1))
    snapshot = _snapshot(model)
    with pytest.raises(ValueError, match=r"block 'model.layers.0.mlp' .*: its tensors hold 8 "
                                         r"for the experts but the module was built for "
                                         r"num_experts=4: the weights do not match the model "
                                         r"config"):
        moe.hf.convert(model)
    _assert_unchanged(model, snapshot)


@pytest.mark.gpu
@pytest.mark.parametrize("model_type, kernel", [
    ("olmoe", "triton"), ("gpt_oss", "triton"), ("inkling2", "grouped"), ("dbrx", "triton")])
def test_the_experts_path_on_cuda_takes_the_kernel_that_computes_the_form(model_type, kernel):
    """experts="auto" on CUDA: the Triton experts for dbo's SwiGLU (OLMoE) and for the
    variants they compute (GPT-OSS's clamped, interleaved, biased SwiGLU; DBRX's experts
    stored in their own layout), the grouped experts for a form Triton refuses (Inkling2's
    own activation); logits as the unconverted model's, DBO off, on and joined."""
    if not _has_model_type(model_type):
        pytest.skip(f"this transformers has no {model_type!r}")
    model = coverage.tiny_model(model_type).cuda()
    ids, mask = batch(3, 6, seed=1, vocab=64)
    ids, mask = ids.cuda(), mask.cuda()
    expected = logits(model, ids, mask)
    moe.hf.convert(model)
    assert {e._kernel(ids.device).experts.name for e in _experts(model)} == {kernel}
    # float32 on the GPU: TF32 is off by default for matmuls, the sums in another order.
    assert_logits_close(logits(model, ids, mask), expected)
    for joined in (False, True):
        assert_logits_close(dbo_logits(model, ids, mask, joined=joined), expected)
