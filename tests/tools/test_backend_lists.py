"""The tools' backend lists, derived from the backends' declared traits
(`moe.backends.backends_with`), are the ones they kept by hand before: same names, same
order. A backend added to the registry changes these only through its traits."""
from __future__ import annotations

from dbo.cli import run_config
from dbo.cli.bench import config as bench_config
from dbo.cli.bench import hf_config, workload
from dbo.cli.soak import config as soak_config


def test_run_graph_backends():
    assert run_config.GRAPH_BACKENDS == (
        "auto", "local", "naive", "naive_mono", "a2a_ll", "symm_mem", "deepep_ll")


def test_soak_graph_backends():
    assert soak_config.GRAPH_BACKENDS == ("naive", "naive_mono", "a2a_ll", "symm_mem",
                                          "deepep_ll")


def test_bench_graph_and_opt_in_backends():
    assert bench_config.GRAPH_BACKENDS == ("a2a_ll", "symm_mem", "deepep_ll")
    assert bench_config.OPT_IN_BACKENDS == ("symm_mem", "deepep_ht", "deepep_ll")
    assert bench_config.DEFAULT_BACKENDS == ("a2a", "a2a_ll", "naive", "naive_mono")
    assert bench_config.DEFAULT_GRAPH_BACKENDS == ("a2a_ll",)


def test_padded_backends():
    assert hf_config.PADDED_BACKENDS == ("a2a_ll", "deepep_ll")
    assert workload.FIXED_CAPACITY_BACKENDS == ("a2a_ll", "deepep_ll")


def test_multi_rank_backends():
    from moe.bench.comm_engines import RAW_DEEPEP, bench_names
    assert bench_config.BENCH_BACKENDS == ("a2a", "a2a_ll", "deepep_ht", "deepep_ll", "naive",
                                           "naive_mono", "symm_mem")
    assert soak_config.BACKENDS == ("naive", "naive_mono", "a2a", "a2a_ll", "symm_mem",
                                    "deepep_ht", "deepep_ll")
    assert bench_names() == ("naive", "naive_mono", "a2a", "a2a_ll", "symm_mem", "deepep_ht",
                             "deepep_ll", "deepep_v2", *RAW_DEEPEP)
