"""Layer 1 (CPU): `moe.config` -- MoEConfig validation (every ValueError path, and the
TypeError of a boolean field given a non-bool) and round_up_hidden."""
from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from moe.backend_options import NoOptions
from moe.backends.a2a_ll import A2ALLOptions
from moe.backends.deepep_ht import DeepEPHTOptions
from moe.backends.deepep_v2 import DeepEPV2Options
from moe.backends.registry import BACKENDS
from moe.config import MoEConfig, round_up_hidden

BASE = dict(num_experts=8, top_k=2, hidden_size=16, intermediate_size=8)


def make(**overrides: object) -> MoEConfig:
    return MoEConfig(**{**BASE, **overrides})


def test_defaults_and_frozen() -> None:
    config = make()
    assert config.scoring == "softmax" and config.renormalize and config.n_group is None
    assert config.experts_per_group == 8
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.top_k = 3  # type: ignore[misc]
    with pytest.raises(TypeError):
        MoEConfig(8, 2, 16, 8)  # type: ignore[misc]  # keyword-only


def test_valid_variants() -> None:
    make(scoring="sigmoid", use_correction_bias=True, n_group=4, topk_group=2,
         routed_scaling_factor=2.5, num_shared_experts=1, dtype=torch.bfloat16)
    make(top_k=1, apply_router_weight_on_input=True, max_tokens_per_rank=64)
    make(custom_routing_function=lambda logits, k: torch.topk(logits, k)[::-1])
    make(top_k=8, n_group=8, topk_group=8)
    assert make(n_group=4, topk_group=1).experts_per_group == 2


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (dict(num_experts=0), "num_experts=0"),
        (dict(hidden_size=-4), "hidden_size=-4"),
        (dict(intermediate_size=0), "intermediate_size=0"),
        (dict(hidden_size=16.0), "hidden_size=16.0"),
        (dict(top_k=0), "top_k=0"),
        (dict(top_k=True), "top_k=True"),
        (dict(top_k=9), "top_k=9 exceeds num_experts=8"),
        (dict(num_shared_experts=-1), "num_shared_experts=-1"),
        (dict(scoring="relu"), "scoring='relu'"),
        (dict(n_group=3, topk_group=1), "n_group=3 does not divide num_experts=8"),
        (dict(n_group=0, topk_group=1), "n_group=0"),
        (dict(n_group=4), "topk_group=None with n_group=4"),
        (dict(topk_group=2), "topk_group=2 given without n_group"),
        (dict(n_group=4, topk_group=5), r"topk_group=5: must be an int in \[1, n_group=4\]"),
        (dict(n_group=4, topk_group=0), "topk_group=0"),
        (dict(top_k=5, n_group=4, topk_group=2), "raise topk_group to at least 3"),
        (dict(n_group=8, topk_group=2, use_correction_bias=True), "top-2"),
        (dict(routed_scaling_factor=0.0), "routed_scaling_factor=0.0"),
        (dict(routed_scaling_factor=float("inf")), "routed_scaling_factor=inf"),
        (dict(routed_scaling_factor="2"), "routed_scaling_factor='2'"),
        (dict(apply_router_weight_on_input=True), "needs top_k=1, got top_k=2"),
        (dict(custom_routing_function=3), "custom_routing_function=3 is not callable"),
        (dict(custom_routing_function=lambda l, k: None, n_group=4, topk_group=2), "n_group=4"),
        (dict(custom_routing_function=lambda l, k: None, use_correction_bias=True),
         "use_correction_bias=True"),
        (dict(dtype=torch.float64), "dtype=torch.float64"),
        (dict(dtype="bfloat16"), "dtype='bfloat16'"),
        (dict(max_tokens_per_rank=0), "max_tokens_per_rank=0"),
        (dict(expert_chunk_size=0), "expert_chunk_size=0"),
        (dict(backend="a2a_ll", backend_options=A2ALLOptions(max_tokens_per_ubatch=4)),
         r"A2ALLOptions.max_tokens_per_ubatch=4 needs MoEConfig.max_tokens_per_rank >= 4 "
         r"\(got None\)"),
        (dict(backend="a2a_ll", max_tokens_per_rank=4,
              backend_options=A2ALLOptions(combine_chunks=5)),
         "A2ALLOptions.combine_chunks=5 exceeds MoEConfig.max_tokens_per_rank=4"),
        (dict(backend="naive", max_tokens_per_rank=8,
              backend_options=A2ALLOptions(max_tokens_per_ubatch=4)),
         r"A2ALLOptions\(...\) are the options of backend 'a2a_ll', not of backend 'naive' "
         r"\(which takes NoOptions\)"),
        (dict(backend="deepep"), r"unknown MoE backend 'deepep' \(MoEConfig.backend\): "
                                 + re.escape(f"choose one of {[*sorted(BACKENDS), 'auto']}")),
        (dict(experts="cutlass"), r"unknown experts kernel 'cutlass' \(MoEConfig.experts\)"),
    ],
)
def test_invalid(overrides: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make(**overrides)


@pytest.mark.parametrize("name", ["renormalize", "use_correction_bias",
                                  "apply_router_weight_on_input", "split_last_combine",
                                  "check_finite_logits"])
@pytest.mark.parametrize("value", ["false", "True", 1, 0, None])
def test_booleans_must_be_bools(name: str, value: object) -> None:
    # A string is truthy: "false" would otherwise switch the option on. The type error is
    # raised before any other check reads the field (apply_router_weight_on_input="false"
    # would otherwise be reported as needing top_k=1).
    with pytest.raises(TypeError, match=f"MoEConfig.{name}={value!r}: must be True or False"):
        make(**{name: value})


def test_booleans_accept_bools() -> None:
    config = make(renormalize=False, use_correction_bias=True, split_last_combine=False,
                  check_finite_logits=True)
    assert (config.renormalize, config.use_correction_bias) == (False, True)
    assert make(top_k=1, apply_router_weight_on_input=True).apply_router_weight_on_input


@pytest.mark.parametrize(("build", "match"), [
    (lambda: A2ALLOptions(max_tokens_per_ubatch=0), "max_tokens_per_ubatch=0: must be a positive"),
    (lambda: A2ALLOptions(max_tokens_per_ubatch=2.0), "max_tokens_per_ubatch=2.0"),
    (lambda: A2ALLOptions(combine_chunks=0), "combine_chunks=0: must be a positive int"),
    (lambda: A2ALLOptions(combine_chunks=True), "combine_chunks=True"),
    (lambda: DeepEPV2Options(mode="eager"), "mode='eager' is not a deepep_v2 mode"),
])
def test_invalid_backend_options(build, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        build()


def test_backend_options_default_and_refusals() -> None:
    """Omitted options are the backend's defaults; options of another backend, or not
    options at all, are refused naming both."""
    assert make(backend="a2a_ll", max_tokens_per_rank=8).options == A2ALLOptions()
    assert make(backend="deepep_v2").options == DeepEPV2Options(mode="prefill")
    assert make().options == NoOptions() and make(backend="naive").options == NoOptions()
    given = A2ALLOptions(max_tokens_per_ubatch=4, combine_chunks=2)
    assert make(backend="a2a_ll", max_tokens_per_rank=8, backend_options=given).options is given
    make(backend="auto", backend_options=NoOptions())
    with pytest.raises(ValueError, match=r"DeepEPHTOptions\(...\) are the options of backend "
                                         r"'deepep_ht', not of backend 'deepep_ll' \(which takes "
                                         r"DeepEPLLOptions\)"):
        make(backend="deepep_ll", backend_options=DeepEPHTOptions())
    with pytest.raises(ValueError, match=r"NoOptions\(...\) are the options of the backends "
                                         r"without options, not of backend 'a2a_ll'"):
        make(backend="a2a_ll", backend_options=NoOptions())
    with pytest.raises(TypeError, match="MoEConfig.backend_options=2"):
        make(backend_options=2)


def test_round_up_hidden() -> None:
    assert round_up_hidden(7168, torch.bfloat16) == 7168
    assert round_up_hidden(7000, torch.bfloat16) == 7168
    assert round_up_hidden(1, torch.float32) == 128
    assert round_up_hidden(129, torch.float32) == 256
    assert round_up_hidden(13, torch.float16, align_bytes=16) == 16
    for bad in (dict(hidden_size=0), dict(align_bytes=3), dict(align_bytes=0)):
        kwargs = {"hidden_size": 8, "dtype": torch.float32, "align_bytes": 512, **bad}
        with pytest.raises(ValueError):
            round_up_hidden(**kwargs)
    with pytest.raises(ValueError, match="torch.dtype"):
        round_up_hidden(8, "bf16")  # type: ignore[arg-type]


def test_backend_and_experts_are_config_fields() -> None:
    """The layer takes its backend and expert kernel from its config (one config tree)."""
    from moe import MoELayer

    config = make(backend="naive", experts="reference", max_tokens_per_rank=4)
    layer = MoELayer(config)
    assert layer.backend.name == "naive"
    assert layer.dbo_agreement()["experts"] == "reference"
    assert layer.dbo_max_tokens_per_rank() == 4
    assert make().backend == "auto" and make().experts == "auto"

