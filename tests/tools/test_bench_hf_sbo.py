"""Layers 1-2: the SBO step of `dbo bench --hf ARCH` (prefill). The backend options each
conversion gets (a2a_ll's ubatch capacity and combine form in one `A2ALLOptions`), a
point without an SBO step saying why (layer 1); `--combine-groups 2` on two gloo ranks,
prefill then decode: the converted layers' SBO steps combine by expert group, and the
SBO step's logits are as close to the unconverted model's as DBO off's (layer 2). The
command line end to end, SBO column included, and the flags' refusals are in
test_bench_hf.py and test_bench_hf_decode.py.
"""
from __future__ import annotations

import dataclasses
import types
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from dbo.cli.bench.config import CPU_REGIME  # noqa: E402
from dbo.cli.bench.hf_config import (Conversion, HFBenchConfig, HFDecodeOptions,  # noqa: E402
                                     layer_options)


def test_each_conversion_gets_the_ubatch_capacity_and_combine_form_in_one_options() -> None:
    from moe.backends.a2a_ll import A2ALLOptions
    plain = HFBenchConfig(arch="qwen3_moe", tokens=(8,), backends=("a2a", "a2a_ll"))
    grouped = HFBenchConfig(arch="qwen3_moe", tokens=(8,), backends=("a2a_ll",),
                            combine_groups=2)
    chunked = HFBenchConfig(arch="qwen3_moe", tokens=(8,), backends=("a2a_ll",),
                            combine_chunks=4)
    ubatch = Conversion(max_tokens_per_rank=8, max_tokens_per_ubatch=4, points=(8,))
    none = Conversion(max_tokens_per_rank=None, points=(8,))
    assert layer_options(plain, "a2a", none, world_size=2) is None
    assert layer_options(plain, "a2a_ll", ubatch, world_size=2) == A2ALLOptions(
        max_tokens_per_ubatch=4)
    assert layer_options(grouped, "a2a_ll", ubatch, world_size=2) == A2ALLOptions(
        max_tokens_per_ubatch=4, combine_groups=2)
    assert layer_options(chunked, "a2a_ll", ubatch, world_size=2) == A2ALLOptions(
        max_tokens_per_ubatch=4, combine_chunks=4)
    assert grouped.summary()["combine_groups"] == 2 and "2 expert groups" in grouped.sbo_form()
    assert "4 row chunks" in chunked.sbo_form()


def test_a_point_without_an_sbo_step_says_why_and_shows_no_time() -> None:
    """The runner's decision decides: a step it did not run as SBO gets its reason, no
    time, and the table a "-" and one line naming the points."""
    from dbo.cli.bench.hf_report import sbo_cell, sbo_lines
    from dbo.cli.bench.hf_sweep import attach_sbo, sbo_not_run
    plan = types.SimpleNamespace(overlap="none", reason="2 tokens: below min_prefill_tokens")
    runner: Any = types.SimpleNamespace(last_decision=plan)
    note = sbo_not_run(runner)
    assert note == "not run: 2 tokens: below min_prefill_tokens"
    assert sbo_not_run(types.SimpleNamespace(  # type: ignore[arg-type]
        last_decision=types.SimpleNamespace(overlap="sbo", reason="x"))) == ""
    point: Any = types.SimpleNamespace(backend="a2a", tokens_per_rank=8, world_size=2,
                                       t_nodbo_ms=4.0, t_sbo_ms=None, per_rank_ms={},
                                       rounds_ms={})
    attach_sbo(point, [], note=note, diff=None, perf=True, total_tokens=16)
    assert point.t_sbo_ms is None and point.sbo_note == note and "t_sbo" not in point.rounds_ms
    assert sbo_cell(point) == "-"
    assert sbo_lines([point, point], lambda p: f"{p.backend} T={p.tokens_per_rank}") == [
        f"  a2a T=8, a2a T=8: SBO {note}"]


def _grouped_sweep(rank: int, world_size: int, out_dir: str) -> dict:
    """The --hf prefill sweep of a2a_ll with --combine-groups 2, then its decode sweep,
    counting the grouped combines (`finalize_grouped_async`) and the groups each was
    asked for."""
    import torch.distributed as dist

    from dbo.cli.bench.hf_decode import run_hf_decode
    from dbo.cli.bench.hf_report import format_table
    from dbo.cli.bench.hf_sweep import run_hf_sweep
    from moe.backends.a2a_ll import AllToAllLLBackend
    groups: list[int] = []
    original = AllToAllLLBackend.finalize_grouped_async

    def counted(self: Any, *args: Any, num_groups: int, **kwargs: Any) -> Any:
        groups.append(num_groups)
        return original(self, *args, num_groups=num_groups, **kwargs)

    AllToAllLLBackend.finalize_grouped_async = counted  # type: ignore[method-assign]
    cfg = HFBenchConfig(arch="qwen3_moe", tokens=(8,), requests=2, backends=("a2a_ll",),
                        combine_groups=2, iters=2, warmup=1, rounds=1, gate_trial_iters=1,
                        device="cpu", regime=CPU_REGIME, out_dir=out_dir, progress=False)
    result = run_hf_sweep(cfg, group=dist.group.WORLD, device=torch.device("cpu"))
    point = result.points[0]
    out = {"groups": list(groups), "t_sbo_ms": point.t_sbo_ms, "sbo_note": point.sbo_note,
           "diffs": (point.logits_diff_nodbo, point.logits_diff_sbo),
           "split": point.dbo_split, "max_tokens_per_ubatch": point.max_tokens_per_ubatch,
           "table": format_table(result) if rank == 0 else ""}
    groups.clear()
    decode = run_hf_decode(dataclasses.replace(cfg, decode=HFDecodeOptions(
        requests=(2,), context=4)), group=dist.group.WORLD, device=torch.device("cpu"))
    step = decode.points[0]
    out["decode"] = {"groups": list(groups), "t_sbo_ms": step.t_sbo_ms,
                     "sbo_note": step.sbo_note,
                     "diffs": (step.logits_diff_nodbo, step.logits_diff_sbo)}
    return out


@pytest.mark.distributed
def test_combine_groups_reach_every_converted_layer_and_sbo_matches_dbo_off(
        tmp_path: Any) -> None:
    from tests.dist_utils import run_distributed
    results = run_distributed(2, _grouped_sweep, str(tmp_path))
    for out in results:
        # Every SBO step (one untimed for the logits; the gate's trial: one warmup, one
        # timed; then one warmup, two timed) ran both MoE layers' combines by expert
        # group, in 2 groups; DBO off and on ran none.
        assert out["groups"] == [2] * 6 * 2, out["groups"]
        assert out["t_sbo_ms"] > 0 and out["sbo_note"] == "", out
        # Both against the unconverted model's logits, float32: the bound the --hf tests
        # use (summing two groups' partials only reorders float additions).
        assert out["diffs"][0] < 1e-5 and out["diffs"][1] < 1e-5, out["diffs"]
        assert out["split"] and out["max_tokens_per_ubatch"] == 4, out
        # Decode: SBO is not gated there, so no trial: one untimed, one warmup, two timed.
        decode = out["decode"]
        assert decode["groups"] == [2] * 4 * 2, decode["groups"]
        assert decode["t_sbo_ms"] > 0 and decode["sbo_note"] == "", decode
        assert decode["diffs"][0] < 1e-5 and decode["diffs"][1] < 1e-5, decode["diffs"]
    assert ("SBO: the DBO-off model through DBOConfig(overlap=\"sbo\"), one ubatch: shared "
            "experts under the dispatch, a2a_ll: the experts in 2 expert groups over every "
            "row") in results[0]["table"]
