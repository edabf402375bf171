"""The backends' declared traits (`moe.backends.traits`): each backend's row of
tests/moe/test_backend_contract.py, their consistency with what a built backend says,
the generated table of docs/backends.md, and what a backend declares besides (its
options, the fields it adds to the agreement, its requirements)."""
from __future__ import annotations

import pytest

from moe.backends import (BACKENDS, TRAITS, backend_class, backend_traits, backends_with)
from tests.moe.test_backend_contract import ROWS


def test_every_registered_backend_has_a_row():
    assert set(ROWS) == set(BACKENDS)
    assert all(row <= set(TRAITS) for row in ROWS.values())


@pytest.mark.parametrize("name", list(BACKENDS))
def test_declared_traits(name):
    traits = backend_traits(name)
    assert {t for t in TRAITS if getattr(traits, t)} == ROWS[name]
    assert traits.name == name


@pytest.mark.parametrize("name", list(BACKENDS))
def test_traits_agree_with_the_class(name):
    cls = backend_class(name, 2)
    traits = backend_traits(name)
    # Where the class states `graph_safe` as a plain value (not a property of the config),
    # the trait says the same.
    declared = next(vars(c)["graph_safe"] for c in cls.__mro__ if "graph_safe" in vars(c))
    if isinstance(declared, bool):
        assert declared == traits.graph_safe
    # A backend padded to its capacity needs one; one always capturable reads no counts.
    assert not traits.pads_to_capacity or traits.needs_capacity
    assert traits.graph_safe != traits.reads_counts_on_host
    assert not traits.graph_safe or traits.graph_safe_with_capacity


def test_graph_safe_of_a_built_naive_follows_the_capacity():
    from moe.config import MoEConfig
    cfg = dict(hidden_size=8, intermediate_size=16, num_experts=2, top_k=1)
    assert not backend_class("naive", 1)(MoEConfig(**cfg, backend="naive"), None).graph_safe
    assert backend_class("naive", 1)(MoEConfig(**cfg, backend="naive",
                                               max_tokens_per_rank=4), None).graph_safe


def test_single_rank_and_ubatch_capacity():
    assert backends_with(single_rank=True) == ("local",)
    assert backends_with(takes_ubatch_capacity=True) == ("a2a_ll",)


def test_backends_with():
    # among= keeps the answer to names known here: a new backend changes nothing below
    assert backends_with(pads_to_capacity=True, among=("a2a", "a2a_ll", "deepep_ll")) == (
        "a2a_ll", "deepep_ll")
    assert backends_with(opt_in=True, among=("a2a", "symm_mem")) == ("symm_mem",)
    assert backends_with() == tuple(BACKENDS)
    with pytest.raises(ValueError, match="unknown backend trait.*pads_to_capacity"):
        backends_with(padded=True)
    with pytest.raises(ValueError, match="unknown MoE backend 'nope'"):
        backend_traits("nope")


def test_docs_trait_table_is_the_generated_one():
    """docs/backends.md shows `trait_table()` between its markers: regenerate the table
    there after changing a backend's traits."""
    from pathlib import Path

    from moe.backends.traits import trait_table
    text = (Path(__file__).resolve().parents[2] / "docs" / "backends.md").read_text()
    start = text.index("moe.backends.traits.trait_table()")
    start = text.index("\n", start) + 1
    end = text.index("<!-- end of the generated table -->", start)
    assert text[start:end] == trait_table()


@pytest.mark.parametrize("name", list(BACKENDS))
def test_options_are_the_backend_s_own(name):
    """Each backend names a frozen keyword-only options class; its defaults are what a
    config without options gets, and its fields are what it adds to the agreement."""
    import dataclasses

    from moe.backend_options import BackendOptions, NoOptions
    from moe.config import MoEConfig
    cls = backend_class(name, 2)
    options_type = cls.options_type
    assert issubclass(options_type, BackendOptions)
    params = dataclasses.fields(options_type)
    assert options_type.__dataclass_params__.frozen
    assert all(f.kw_only for f in params)
    assert options_type is NoOptions or options_type.backend_name == name
    config = MoEConfig(num_experts=4, top_k=2, hidden_size=8, intermediate_size=8,
                       backend=name)
    assert config.options == options_type()
    added = cls.agreement_fields(config)
    assert list(added) == [cls.agreement_prefix + f.name for f in params]
    assert not set(added) & set(config.agreement_fields())


def test_the_fields_backends_add_to_the_agreement_keep_their_names():
    from moe.backends.a2a_ll import A2ALLOptions
    from moe.config import MoEConfig

    def added(name, **kw):
        config = MoEConfig(num_experts=4, top_k=2, hidden_size=8, intermediate_size=8,
                           max_tokens_per_rank=8, backend=name, **kw)
        return backend_class(name, 2).agreement_fields(config)

    assert added("a2a_ll", backend_options=A2ALLOptions(combine_chunks=2)) == {
        "max_tokens_per_ubatch": None, "combine_chunks": 2, "combine_groups": 1}
    assert added("deepep_ht") == {"deepep_worst_case_dispatch": False}
    assert added("deepep_ll") == {"deepep_fp8_dispatch": False}
    assert added("deepep_v2") == {"deepep_v2_mode": "prefill"}
    assert added("a2a") == {}


def test_requirements_are_declared_by_the_backends():
    """What the commands check before ranks start, asked of the backend: deepep_ll's
    rows and NVSHMEM queue depth; nothing for a backend of torch's collectives."""
    import torch

    env = {"NVSHMEM_QP_DEPTH": "1024"}
    ll, a2a = backend_class("deepep_ll", 2), backend_class("a2a", 2)
    assert ll.row_dtypes == (torch.bfloat16,) and 2048 in ll.hidden_sizes
    assert a2a.row_dtypes is None and a2a.hidden_sizes is None
    ll.check_max_tokens(510, 2, option="--tokens", backend_option="", env=env)
    with pytest.raises(ValueError, match="--tokens=511 with --backend=deepep_ll on 2 ranks: "
                                         "DeepEP's capacity 512 needs an NVSHMEM queue depth "
                                         "of 1026, above NVSHMEM_QP_DEPTH=1024; use --tokens "
                                         "<= 510"):
        ll.check_max_tokens(511, 2, option="--tokens", backend_option="--backend=deepep_ll",
                            env=env)
    a2a.check_max_tokens(10**6, 2, option="--tokens", backend_option="", env=env)
    with pytest.raises(ValueError, match="hidden_size=1000 is not supported"):
        ll.check_shape(1000, torch.bfloat16, 2)
    a2a.check_shape(1000, torch.float32, 2)


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_bool_options_refuse_anything_but_a_bool(name):
    # BackendOptions checks every field declared bool once, for every backend's options.
    import dataclasses
    options_type = backend_class(name, 2).options_type
    flags = [f.name for f in dataclasses.fields(options_type) if f.type in ("bool", bool)]
    for flag in flags:
        with pytest.raises(TypeError, match=rf"{options_type.__name__}\.{flag}=1: must be "
                                            r"True or False \(a bool, not a int\)"):
            options_type(**{flag: 1})
        assert getattr(options_type(**{flag: True}), flag) is True


def test_options_with_keeps_the_fields_a_backend_has_and_drops_its_defaults():
    from moe.backends import A2ALLOptions, options_with
    assert options_with("a2a_ll", 2, combine_groups=2, combine_chunks=1) == \
        A2ALLOptions(combine_groups=2)
    assert options_with("a2a_ll", 2, max_tokens_per_ubatch=None, combine_chunks=1) is None
    assert options_with("a2a", 2, combine_groups=2) is None  # a2a has no such option
