"""Layer 2 (CPU, two gloo ranks): bench-comm's raw DeepEP v2 engines (`moe.bench.
comm_raw_deepep_v2`) on the fake `ElasticBuffer` (tests/moe/fake_elastic_buffer.py, which
reproduces DeepEP v2's contract): each mode's combine of the rows it dispatched returns
what that identity gives. On GPUs they time the real library (`dbo bench-comm
--backends deepep_v2,deepep_v2_raw_prefill,...`)."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from moe.bench.comm_engines import RAW_DEEPEP_V2, Shapes, bench_names
from moe.bench.comm_raw_deepep_v2 import DeepEPV2RawSource
from tests.dist_utils import run_distributed
from tests.moe.fake_elastic_buffer import FakeElasticBuffer

SHAPES = Shapes(hidden=16, top_k=2, num_experts=8, dtype=torch.float32)


def raw_v2(rank: int, world_size: int) -> dict:
    gen = torch.Generator().manual_seed(5 + rank)
    x = torch.randn(12, SHAPES.hidden, generator=gen)
    ids = torch.rand(12, SHAPES.num_experts, generator=gen).topk(SHAPES.top_k).indices
    weights = torch.rand(12, SHAPES.top_k, generator=gen)
    per_rank = SHAPES.num_experts // world_size
    ranks_of = torch.tensor([[len(set((row // per_rank).tolist()))] for row in ids])
    # prefill expands a token into one row per expert; the combine adds them unweighted
    expected = {"deepep_v2_raw_prefill": x * SHAPES.top_k, "deepep_v2_raw_decode": x * ranks_of}
    errors, rows = {}, {}
    for name in RAW_DEEPEP_V2:
        source = DeepEPV2RawSource(name, SHAPES, dist.group.WORLD, tokens=(12,),
                                   buffer_cls=FakeElasticBuffer)
        engine = source.bind(x, weights, ids)
        state = engine.dispatch()
        errors[name] = (engine.combine(state) - expected[name]).abs().max().item()
        rows[name] = engine.rows_delivered(state)
        source.close()
    return {"errors": errors, "rows": rows}


@pytest.mark.distributed
def test_raw_v2_engines_return_what_they_dispatched():
    assert set(RAW_DEEPEP_V2) <= set(bench_names())
    for rank, out in enumerate(run_distributed(2, raw_v2)):
        # float32 sums of equal rows: exact up to the order of a few additions
        assert max(out["errors"].values()) <= 1e-5, (rank, out)
        assert out["rows"]["deepep_v2_raw_decode"] == 2 * 12  # W * C, the worst case


def test_prefill_cannot_be_graphed_and_one_rank_is_refused():
    with pytest.raises(ValueError, match="needs a process group of at least 2 ranks"):
        DeepEPV2RawSource("deepep_v2_raw_decode", SHAPES, None, tokens=(4,),
                          buffer_cls=FakeElasticBuffer)
    with pytest.raises(ValueError, match="unknown DeepEP v2 raw engine"):
        DeepEPV2RawSource("deepep_v2_raw", SHAPES, None, tokens=(4,))
    from moe.bench.comm_raw_deepep_v2 import _Engine
    assert "cannot be captured" in _Engine(None, True, 8, *([None] * 3)).graph_blocker()
    assert _Engine(None, False, 8, *([None] * 3)).graph_blocker() is None
