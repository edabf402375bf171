"""The tools' backend lists, derived from the backends' declared traits
(`moe.backends.backends_with`), are the ones they kept by hand before: same names, same
order. A backend added to the registry changes these only through its traits (its row
of tests/moe/test_backend_contract.py), so they are compared over today's backends."""
from __future__ import annotations

from typing import Iterable

from dbo.cli import run_config
from dbo.cli.bench import config as bench_config
from dbo.cli.bench import hf_config, workload
from dbo.cli.soak import config as soak_config

#: The backends registered when these lists were written (and the names the tools add).
TODAY = frozenset({"local", "naive", "naive_mono", "a2a", "a2a_ll", "symm_mem", "deepep_ht",
                   "deepep_ll", "deepep_v2", "auto", "deepep_raw_ht", "deepep_raw_ll"})


def today(names: Iterable[str]) -> tuple[str, ...]:
    return tuple(name for name in names if name in TODAY)


def test_run_graph_backends():
    assert today(run_config.GRAPH_BACKENDS) == (
        "auto", "local", "naive", "naive_mono", "a2a_ll", "symm_mem", "deepep_ll")


def test_soak_graph_backends():
    assert today(soak_config.GRAPH_BACKENDS) == ("naive", "naive_mono", "a2a_ll", "symm_mem",
                                          "deepep_ll")


def test_bench_graph_and_opt_in_backends():
    assert today(bench_config.GRAPH_BACKENDS) == ("a2a_ll", "symm_mem", "deepep_ll")
    assert today(bench_config.OPT_IN_BACKENDS) == ("symm_mem", "deepep_ht", "deepep_ll")
    assert today(bench_config.DEFAULT_BACKENDS) == ("a2a", "a2a_ll", "naive", "naive_mono")
    assert today(bench_config.DEFAULT_GRAPH_BACKENDS) == ("a2a_ll",)


def test_padded_backends():
    assert today(hf_config.PADDED_BACKENDS) == ("a2a_ll", "deepep_ll")
    assert today(workload.FIXED_CAPACITY_BACKENDS) == ("a2a_ll", "deepep_ll")


def test_multi_rank_backends():
    from moe.bench.comm_engines import RAW_DEEPEP, bench_names
    assert today(bench_config.BENCH_BACKENDS) == ("a2a", "a2a_ll", "deepep_ht", "deepep_ll", "naive",
                                           "naive_mono", "symm_mem")
    assert today(soak_config.BACKENDS) == ("naive", "naive_mono", "a2a", "a2a_ll", "symm_mem",
                                    "deepep_ht", "deepep_ll")
    assert today(bench_names()) == ("naive", "naive_mono", "a2a", "a2a_ll", "symm_mem", "deepep_ht",
                             "deepep_ll", "deepep_v2", *RAW_DEEPEP)
