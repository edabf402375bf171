"""Layer 1 (CPU): `dbo bench-comm --backends` entries with a backend's options
(`NAME:FIELD=VALUE`, `moe.bench.comm_engines.parse_spec`), checked before any rank
starts; and NCCL EP's raw calls offered beside DeepEP's."""
from __future__ import annotations

import pytest
import torch

from moe.backends import A2ALLOptions, NCCLEPOptions
from moe.bench.comm import CommBenchConfig
from moe.bench.comm_engines import (RAW_NCCL_EP, BackendSource, Shapes, bench_names,
                                    make_source, parse_spec)

SHAPES = Shapes(hidden=16, top_k=2, num_experts=4, dtype=torch.float32)


def test_a_plain_name_and_one_with_options():
    assert parse_spec("a2a") == ("a2a", {})
    assert parse_spec("nccl_ep:mode=ht:num_sms=24") == ("nccl_ep", {"mode": "ht", "num_sms": 24})
    assert parse_spec("a2a_ll:combine_groups=2:max_tokens_per_ubatch=8")[1] == {
        "combine_groups": 2, "max_tokens_per_ubatch": 8}
    assert set(RAW_NCCL_EP) <= set(bench_names())


@pytest.mark.parametrize("spec,message", [
    ("nope", "unknown backend 'nope': choose from"),
    ("deepep_raw_ll:x=1", "unknown backend 'deepep_raw_ll:x=1'"),
    ("a2a_ll:nope=1", "backend 'a2a_ll' has no option 'nope': its options (A2ALLOptions) are"),
    ("a2a:combine_groups=2", "backend 'a2a' has no option 'combine_groups': its options"),
    ("nccl_ep:mode", "options are FIELD=VALUE, got 'mode'"),
    ("nccl_ep:mode=fast", "'fast' is not an nccl_ep mode"),
])
def test_bad_entries_are_refused_in_one_line(spec, message):
    with pytest.raises(ValueError) as exc:
        parse_spec(spec)
    assert message in str(exc.value) and "\n" not in str(exc.value)
    with pytest.raises(ValueError, match="nope|has no option|FIELD=VALUE|not an nccl_ep"):
        CommBenchConfig(backends=(spec,))


def test_the_source_builds_the_backend_with_its_options():
    source = make_source("nccl_ep:mode=ht", SHAPES, None, tokens=(8,))
    assert isinstance(source, BackendSource)
    assert source.name == "nccl_ep:mode=ht" and source.backend == "nccl_ep"
    assert source.options == NCCLEPOptions(mode="ht")
    grouped = make_source("a2a_ll:combine_groups=2", SHAPES, None, tokens=(8,))
    assert grouped.options == A2ALLOptions(combine_groups=2)
    assert make_source("a2a", SHAPES, None, tokens=(8,)).options is None
    # ...and each point's backend is built with them (one rank: nothing is exchanged)
    engine = grouped.bind(torch.randn(8, 16), torch.rand(8, 2), torch.randint(0, 4, (8, 2)))
    assert engine.backend.options == A2ALLOptions(combine_groups=2)
    assert parse_spec("deepep_ht:worst_case_dispatch=true")[1] == {"worst_case_dispatch": True}
    assert CommBenchConfig(backends=("a2a_ll:combine_groups=2", "a2a")).names == (
        "a2a_ll:combine_groups=2", "a2a")
