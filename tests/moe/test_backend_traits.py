"""The backends' declared traits (`moe.backends.traits`): the table, its consistency with
what a built backend says, and the name lists the tools derive from it."""
from __future__ import annotations

import pytest

from moe.backends import (BACKENDS, TRAITS, backend_class, backend_traits, backends_with)

# The trait table, as the backends declare it. A new backend adds its row here.
# Columns: graph_safe, graph_safe_with_capacity, pads_to_capacity, reads_counts_on_host,
# comm_recordable, needs_capacity, opt_in.
TABLE = {
    "local":      (1, 1, 0, 0, 1, 0, 0),
    "naive":      (0, 1, 0, 1, 1, 0, 0),
    "naive_mono": (0, 1, 0, 1, 1, 0, 0),
    "a2a":        (0, 0, 0, 1, 1, 0, 0),
    "a2a_ll":     (1, 1, 1, 0, 1, 1, 0),
    "symm_mem":   (1, 1, 0, 0, 0, 1, 1),
    "deepep_ht":  (0, 0, 0, 1, 0, 0, 1),
    "deepep_ll":  (1, 1, 1, 0, 0, 1, 1),
    "deepep_v2":  (0, 0, 0, 1, 0, 1, 1),
}
COLUMNS = ("graph_safe", "graph_safe_with_capacity", "pads_to_capacity",
           "reads_counts_on_host", "comm_recordable", "needs_capacity", "opt_in")


def test_every_registered_backend_has_a_row():
    assert set(TABLE) == set(BACKENDS)


@pytest.mark.parametrize("name", list(BACKENDS))
def test_declared_traits(name):
    traits = backend_traits(name)
    assert tuple(int(getattr(traits, c)) for c in COLUMNS) == TABLE[name]
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
    assert backends_with(pads_to_capacity=True) == ("a2a_ll", "deepep_ll")
    assert backends_with(opt_in=True, among=("a2a", "symm_mem")) == ("symm_mem",)
    assert backends_with() == tuple(BACKENDS)
    with pytest.raises(ValueError, match="unknown backend trait.*pads_to_capacity"):
        backends_with(padded=True)
    with pytest.raises(ValueError, match="unknown MoE backend 'nope'"):
        backend_traits("nope")
    assert set(TRAITS) >= set(COLUMNS)


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
