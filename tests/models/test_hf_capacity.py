"""Layer 1 (CPU) and Layer 2 (two gloo processes): `moe.hf.convert(...,
max_tokens_per_rank=N)` and `moe.hf.load(...)` with it. Over two expert-parallel ranks,
a model converted with backend `a2a_ll` (no host read in its MoE layers) gives the
unconverted model's logits with DBO off and on, every layer carrying the capacity, and
a step over it raises on both ranks at the vote (likewise a ubatch over
`max_tokens_per_ubatch`); a backend that needs a capacity without
one, and a capacity that is not a positive int, are refused naming the keyword with the
model unchanged; every registered backend's `needs_capacity` says what its constructor
does.
"""
from __future__ import annotations

import importlib

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers")

import dbo  # noqa: E402
import moe.hf  # noqa: E402
from moe.config import MoEConfig  # noqa: E402
from moe.hf import HFMoEBlock  # noqa: E402
from moe.backends.registry import BACKENDS  # noqa: E402
from tests.dist_utils import run_distributed  # noqa: E402
from tests.hf_utils import ARCHS, assert_logits_close, batch, logits, save, tiny_model  # noqa: E402
from tests.models.test_hf_convert import run_dbo  # noqa: E402
from moe.hf.coverage import tiny_model as coverage_tiny_model  # noqa: E402

CAPACITY_MESSAGE = "backend 'a2a_ll' needs max_tokens_per_rank"


def _unchanged(model: torch.nn.Module, before: dict[str, torch.Tensor]) -> bool:
    after = model.state_dict()
    return (not any(isinstance(m, HFMoEBlock) for m in model.modules())
            and after.keys() == before.keys()
            and all(torch.equal(after[k], v) for k, v in before.items()))


@pytest.mark.parametrize("backend", ["a2a_ll", "symm_mem", "deepep_ll"])
def test_a_capacity_backend_without_a_capacity_is_refused_and_nothing_changes(backend):
    model = tiny_model("qwen3_moe")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=f"moe.hf.convert: backend '{backend}' needs "
                                         f"max_tokens_per_rank .* pass max_tokens_per_rank=N"):
        moe.hf.convert(model, backend=backend)
    assert _unchanged(model, before)


@pytest.mark.parametrize("bad", [0, -1, True, 2.5, "8"])
def test_a_capacity_that_is_not_a_positive_int_is_refused(bad):
    model = tiny_model("mixtral")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=f"max_tokens_per_rank={bad!r} must be a positive int"):
        moe.hf.convert(model, backend="a2a_ll", max_tokens_per_rank=bad)
    assert _unchanged(model, before)


def test_load_refuses_before_building_the_model(tmp_path, monkeypatch):
    path = save(tiny_model("qwen3_moe"), tmp_path)
    import transformers

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the model was built")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_config", refuse)
    with pytest.raises(ValueError, match="moe.hf.load: backend 'a2a_ll' needs "
                                         "max_tokens_per_rank"):
        moe.hf.load(path, backend="a2a_ll")
    with pytest.raises(ValueError, match="moe.hf.load: max_tokens_per_rank=0 must be"):
        moe.hf.load(path, max_tokens_per_rank=0)


def test_the_capacity_goes_into_every_layer_and_load_keeps_it(tmp_path):
    model = tiny_model("deepseek_v3", num_hidden_layers=3)
    path = save(model, tmp_path)
    ids, mask = batch(2, 5, seed=4)
    expected = logits(model, ids, mask)
    for converted in (moe.hf.convert(model, max_tokens_per_rank=10),
                      moe.hf.load(path, max_tokens_per_rank=10)):
        layers = [m.moe for m in converted.modules() if isinstance(m, HFMoEBlock)]
        assert len(layers) == 2
        assert [layer.dbo_max_tokens_per_rank() for layer in layers] == [10, 10]
        assert_logits_close(logits(converted, ids, mask), expected)


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_needs_capacity_says_what_the_backend_refuses(name):
    """A backend declares `needs_capacity` exactly when its constructor refuses a config
    without `max_tokens_per_rank`: built here without one, it is refused for that, or
    built. One refused first for something else (its library, CUDA, an EP group: the
    DeepEP backends on this machine) cannot tell here and is skipped."""
    module_name, cls_name = BACKENDS[name].split(":")
    cls = getattr(importlib.import_module(module_name), cls_name)
    config = MoEConfig(num_experts=4, top_k=2, hidden_size=8, intermediate_size=8,
                       backend=name)
    try:
        cls(config, None)
        refused = False
    except (ImportError, ValueError) as exc:
        if "needs MoEConfig.max_tokens_per_rank" not in str(exc):
            pytest.skip(f"{name} is refused here for another reason first: {exc}")
        refused = True
    assert cls.needs_capacity == refused, name


def _ep_a2a_ll(rank: int, world: int) -> dict:
    """EP 2, backend a2a_ll with a capacity of 18 rows (3 x 6): every architecture's
    logits equal the unconverted model's, DBO off and on (rank 1's 8 rows, rank 0's 18:
    the capacity); then a step whose larger ubatch has 26 rows (2 x 13) on rank 1 only is
    refused on both ranks at the vote (the capacity bounds each DBO ubatch)."""
    group = dist.group.WORLD
    result: dict = {}
    shape = [(3, 6), (2, 4)][rank]
    for arch in ARCHS:
        model = tiny_model(arch)
        ids, mask = batch(*shape, seed=20 + rank)
        expected = logits(model, ids, mask)
        moe.hf.convert(model, group=group, backend="a2a_ll", max_tokens_per_rank=18)
        layers = [m.moe for m in model.modules() if isinstance(m, HFMoEBlock)]
        assert all(layer.backend.name == "a2a_ll" and layer.config.max_tokens_per_rank == 18
                   for layer in layers)
        assert_logits_close(logits(model, ids, mask), expected)
        out, decision = run_dbo(model, ids, mask, group)
        assert_logits_close(out, expected)
        result[arch] = decision.split
    over = batch(*[(3, 6), (3, 13)][rank], seed=30)
    try:
        run_dbo(model, *over, group)
        result["over"] = "ran"
    except ValueError as exc:
        result["over"] = str(exc)
    # A ubatch capacity of 10 rows: (2, 6) splits into ubatches of 6 and fits; rank 0's
    # (3, 6) splits 12 + 6, over it, and both ranks stop at the vote.
    model = tiny_model("qwen3_moe")
    ids, mask = batch(*[(2, 6), (2, 4)][rank], seed=40 + rank)
    expected = logits(model, ids, mask)
    moe.hf.convert(model, group=group, backend="a2a_ll", max_tokens_per_rank=18,
                   max_tokens_per_ubatch=10)
    layers = [m.moe for m in model.modules() if isinstance(m, HFMoEBlock)]
    result["ubatch_capacity"] = sorted({layer.backend.ubatch_capacity for layer in layers})
    out, decision = run_dbo(model, ids, mask, group)
    assert_logits_close(out, expected)
    result["ubatch_split"] = decision.split
    try:
        run_dbo(model, *batch(*[(3, 6), (2, 4)][rank], seed=50), group)
        result["ubatch_over"] = "ran"
    except ValueError as exc:
        result["ubatch_over"] = str(exc)
    return result


@pytest.mark.distributed
def test_a2a_ll_with_a_capacity_over_two_ranks_equals_the_unconverted_model():
    results = run_distributed(2, _ep_a2a_ll)
    for result in results:
        assert all(result[arch] is True for arch in ARCHS), result
        assert ("of the group has 26 tokens in one model call this step"
                in result["over"]), result["over"]
        assert "max_tokens_per_rank=18" in result["over"]
        assert result["ubatch_capacity"] == [10] and result["ubatch_split"], result
        assert "has 12 tokens in one model call this step (its largest ubatch" in \
            result["ubatch_over"], result["ubatch_over"]
        assert "max_tokens_per_ubatch=10" in result["ubatch_over"]


def _sbo_groups(rank: int, world_size: int) -> dict:
    """A tiny Qwen3-MoE (fused blocks) and OLMoE (experts path) converted with a2a_ll's
    combine by expert group: an SBO step gives the unconverted model's logits."""
    from moe.backends.a2a_ll import A2ALLOptions
    from moe.hf.block import converted_experts
    group = dbo.new_group()
    result = {}
    for name, make in (("qwen3_moe", lambda: tiny_model("qwen3_moe")),
                       ("olmoe", lambda: coverage_tiny_model("olmoe", seed=5))):
        model = make()
        ids, mask = batch(*[(2, 6), (2, 4)][rank], seed=60 + rank)
        expected = logits(model, ids, mask)
        moe.hf.convert(model, group=group, backend="a2a_ll", max_tokens_per_rank=12,
                       backend_options=A2ALLOptions(combine_groups=2))
        result[name + "/groups"] = sorted({m.config.options.combine_groups
                                          for m in converted_experts(model)})
        runner = dbo.DBORunner(model, dbo.DBOConfig(overlap="sbo"), group=group)
        with torch.no_grad():
            out = runner(input_ids=ids, attention_mask=mask, use_cache=False).logits
        assert_logits_close(out, expected)
        result[name + "/overlap"] = runner.last_decision.overlap
    return result


@pytest.mark.distributed
def test_backend_options_reach_every_layer_and_sbo_by_expert_group_matches():
    for result in run_distributed(2, _sbo_groups):
        assert result == {"qwen3_moe/groups": [2], "qwen3_moe/overlap": "sbo",
                          "olmoe/groups": [2], "olmoe/overlap": "sbo"}, result


def test_backend_options_are_checked_before_anything_changes(tmp_path):
    from moe.backends.a2a_ll import A2ALLOptions
    model = tiny_model("qwen3_moe")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="give the ubatch capacity inside the options"):
        moe.hf.convert(model, backend="a2a_ll", max_tokens_per_rank=8,
                       max_tokens_per_ubatch=4, backend_options=A2ALLOptions())
    with pytest.raises(TypeError, match="pass a backend's options object"):
        moe.hf.convert(model, backend_options={"combine_groups": 2})
    with pytest.raises(ValueError, match="are the options of backend 'a2a_ll', not of "
                                         "backend 'a2a'"):
        moe.hf.convert(model, backend="a2a", backend_options=A2ALLOptions(combine_groups=2))
    assert _unchanged(model, before)
    path = save(tiny_model("qwen3_moe"), tmp_path)
    with pytest.raises(ValueError, match="give the ubatch capacity inside the options"):
        moe.hf.load(path, backend="a2a_ll", max_tokens_per_rank=8, max_tokens_per_ubatch=4,
                    backend_options=A2ALLOptions())
