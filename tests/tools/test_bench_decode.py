"""Layers 1-2: `dbo bench --mode decode` on CPU. The decode stack's attention against an
explicit softmax over the cache, DBO on against off, its split, argument errors, and the
host time of a step (layer 1, in-process); the command end to end on two gloo ranks it
spawns itself, through its `main` (layer 2, marked distributed).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from dbo import DBOConfig, DBORunner
from dbo.cli.bench import main
from dbo.cli.bench.config import CPU_REGIME, NVLINK_REGIME, BenchConfig
from dbo.cli.bench.decode_stack import (DecodeAttention, DecodeStack, SplitRequests,
                                        make_kv_caches)
from dbo.cli.bench.layer_stack import layer_moe_config
from dbo.cli.bench.timing import time_steps
from moe.models.presets import get_preset


def _stack(max_requests: int = 6, context: int = 5) -> DecodeStack:
    preset = get_preset("tiny")
    moe = layer_moe_config(preset.moe, num_experts=8, max_tokens_per_rank=None)
    keys, values = make_kv_caches(preset, max_requests=max_requests, context=context,
                                  device=torch.device("cpu"), seed=0)
    stack = DecodeStack(moe, preset, num_layers=2, keys=keys, values=values, group=None,
                        device=torch.device("cpu"))
    stack.init_weights(0)
    return stack


def test_decode_attention_is_softmax_over_the_cache_and_the_new_token() -> None:
    stack = _stack()
    attention: DecodeAttention = stack.attention[0]
    x_RH = torch.randn(3, 64)
    keys, values = stack.keys[:3].clone(), stack.values[:3].clone()
    with torch.no_grad():
        out = attention(x_RH, keys, values)
        heads, kv_heads, dim = 4, 2, 16
        q, k, v = (x_RH @ attention.w_qkv.t()).split([heads * dim, kv_heads * dim,
                                                      kv_heads * dim], dim=-1)
        expected = []
        for r in range(3):
            k_r = torch.cat([stack.keys[r, :, :-1], k[r].view(kv_heads, 1, dim)], dim=1)
            v_r = torch.cat([stack.values[r, :, :-1], v[r].view(kv_heads, 1, dim)], dim=1)
            rows = []
            for h in range(heads):  # query head h reads kv head h // (heads / kv_heads)
                g = h // (heads // kv_heads)
                w = torch.softmax(k_r[g] @ q[r].view(heads, dim)[h] / math.sqrt(dim), dim=0)
                rows.append(w @ v_r[g])
            expected.append(torch.cat(rows) @ attention.w_o.t())
    torch.testing.assert_close(out, torch.stack(expected), rtol=1e-5, atol=1e-5)
    assert torch.equal(keys[:, :, -1], k.view(3, kv_heads, dim))  # written at slot C


def test_dbo_step_splits_the_requests_and_equals_the_unsplit_step() -> None:
    stack = _stack()
    x_RH = torch.randn(5, 64)
    runner = DBORunner(stack, DBOConfig(split=SplitRequests(), min_decode_tokens=2))
    with torch.no_grad():
        expected = stack(x_RH)
        out = runner(x_RH)
        tail = stack(x_RH[3:], first_request=3)  # rows 3, 4 read caches 3, 4
    assert runner.last_decision.split and runner.last_decision.num_tokens == (3, 2)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(tail, expected[3:], rtol=1e-5, atol=1e-5)
    parts = SplitRequests()((x_RH,), {"first_request": 1})
    assert [(a[0].shape[0], k) for a, k in parts] == [(3, {"first_request": 1}),
                                                      (2, {"first_request": 4})]
    assert SplitRequests()((x_RH[:1],), {}) is None


def test_host_time_is_measured_beside_the_step_time() -> None:
    timing = time_steps(lambda: torch.randn(64, 64) @ torch.randn(64, 64),
                        device=torch.device("cpu"), group=None, warmup=0, iters=3)
    assert len(timing.host_per_rank_ms) == 1 and timing.host_max_ms > 0
    assert timing.host_max_ms == timing.max_ms  # CPU: nothing runs after the call returns


@pytest.mark.parametrize("argv, message", [
    (["--requests", "1,8"], "--mode decode with 1 request(s) per rank: DBO splits a decode "
                            "step's requests between two ubatches"),
    (["--context", "0"], "context=0 must be an int >= 1"),
    (["--tokens", "16"], "--mode decode sweeps --requests"),
])
def test_bad_decode_arguments_exit_with_the_fix(argv: list[str], message: str, tmp_path: Path,
                                                capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--device", "cpu", "--mode", "decode", "--out", str(tmp_path), *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("argv, where", [(["--mode", "model"], "--mode model"),
                                         (["--hf", "qwen3_moe"], "--hf without --mode decode")])
def test_other_modes_take_one_request_count(argv: list[str], where: str, tmp_path: Path,
                                            capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        main(["--device", "cpu", *argv, "--requests", "4,8", "--out", str(tmp_path)])
    assert f"--requests 4,8: {where} takes one count" in capsys.readouterr().err
    assert BenchConfig(mode="decode", tokens=(2, 4), context=1).context == 1


@pytest.mark.distributed
def test_decode_bench_end_to_end_on_two_gloo_ranks(tmp_path: Path,
                                                   capfd: pytest.CaptureFixture) -> None:
    code = main(["--device", "cpu", "--mode", "decode", "--requests", "4,8", "--context",
                 "16", "--backends", "a2a,a2a_ll", "--iters", "1", "--warmup", "1",
                 "--layers", "2", "--no-progress", "--out", str(tmp_path)])
    out = capfd.readouterr().out
    assert code == 0, out
    lines = out.strip().splitlines()
    final = json.loads(lines[-1])
    table = "\n".join(lines[:-1])
    assert final["mode"] == "decode" and final["regime"] == CPU_REGIME
    assert final["world_size"] == 2 and final["shapes"]["context"] == 16
    assert (final["shapes"]["num_heads"], final["shapes"]["num_kv_heads"]) == (4, 2)
    assert " R/rank" in table and "host noDBO" in table and "16 cached tokens" in table
    points = final["points"]
    assert {(p["backend"], p["tokens_per_rank"]) for p in points} == {
        (b, r) for b in ("a2a", "a2a_ll") for r in (4, 8)}
    for p in points:
        assert p["dbo_split"] is True and p["t_nodbo_ms"] > 0 and p["t_dbo_ms"] > 0
        assert p["host_nodbo_ms"] > 0 and p["host_dbo_ms"] > 0
        # DBO with joined experts, timed by default, split on the requests as DBO is.
        assert p["joined_split"] is True and p["t_joined_ms"] > 0 and p["host_joined_ms"] > 0
        assert p["joined_note"] == "" and len(p["joined_trial_speedups"]) == 1, p
        assert "; joined: " in p["gate_reason"], p
    columns = next(line for line in table.splitlines() if "R/rank" in line)
    assert " joined ms" in columns and " SBO ms" in columns
    files = final["files"]
    assert Path(files["csv"]).name == "bench_decode_tiny_w2_cpu.csv"
    doc = json.loads(Path(files["json"]).read_text())
    assert doc["config"]["context"] == 16 and len(doc["points"]) == 4
    assert doc["config"]["overlaps"] == ["dbo", "sbo", "joined"]  # the default
    header = Path(files["csv"]).read_text().splitlines()[0]
    assert "host_nodbo_ms" in header and "t_joined_ms" in header and "host_joined_ms" in header


# ------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
def test_graphed_decode_step_replays_the_eager_dbo_step_on_one_gpu() -> None:
    import dataclasses

    from dbo import GraphedRunner

    device = torch.device("cuda", 0)
    preset = get_preset("tiny", dtype=torch.bfloat16)
    moe = dataclasses.replace(
        layer_moe_config(preset.moe, num_experts=8, max_tokens_per_rank=16),
        experts="triton")
    keys, values = make_kv_caches(preset, max_requests=16, context=64, device=device, seed=0)
    stack = DecodeStack(moe, preset, num_layers=2, keys=keys, values=values, group=None,
                        device=device)
    stack.init_weights(0)
    runner = DBORunner(stack, DBOConfig(split=SplitRequests(), min_decode_tokens=2))
    graphed = GraphedRunner(runner, warmup=1)
    x_RH = torch.randn(16, 64, device=device).to(torch.bfloat16)
    with torch.no_grad():
        eager = runner(x_RH)
        replayed = graphed(x_RH)
        again = graphed(x_RH)
    assert runner.last_decision.split and graphed.num_captures == 1
    torch.testing.assert_close(replayed, eager, rtol=0, atol=0)
    torch.testing.assert_close(again, eager, rtol=0, atol=0)


def _graphed_decode_sweep(rank: int, world_size: int, out_dir: str) -> dict:
    import torch.distributed as dist

    from dbo.cli.bench.report import final_line, write_outputs
    from dbo.cli.bench.sweep import run_sweep

    cfg = BenchConfig(mode="decode", preset="tiny", tokens=(8, 32), context=64,
                      backends=("a2a_ll",), iters=2, warmup=1, rounds=1, device="cuda",
                      regime=NVLINK_REGIME,
                      cuda_graph=True, out_dir=out_dir, plot=False, progress=False,
                      gate_min_tokens=0)
    result = run_sweep(cfg, group=dist.group.WORLD, device=torch.device("cuda", rank))
    return json.loads(final_line(result, write_outputs(result))) if rank == 0 else {}


@pytest.mark.gpu
@pytest.mark.multigpu
def test_graphed_decode_sweep_times_steps_probe_and_host_on_two_gpus(tmp_path: Path) -> None:
    from tests.dist_utils import run_distributed

    final = run_distributed(2, _graphed_decode_sweep, str(tmp_path), backend="nccl")[0]
    assert final["mode"] == "decode" and final["cuda_graph"] is True, final
    for point in final["points"]:
        assert point["dbo_split"], point
        for name in ("t_nodbo_ms", "t_dbo_ms", "t_compute_ms", "t_comm_ms", "t_both_ms",
                     "t_split_ms", "host_nodbo_ms", "host_dbo_ms", "t_sbo_ms", "host_sbo_ms",
                     "speedup_sbo", "t_joined_ms", "host_joined_ms", "speedup_joined"):
            assert point[name] is not None and point[name] > 0, (name, point)
        # SBO ran graphed too: a GraphedRunner of DBOConfig(overlap="sbo"), one trial.
        assert point["sbo_note"] == "" and len(point["sbo_trial_speedups"]) == 1, point
        # Joined experts graphed too: a GraphedRunner of joined_experts=True, split, a trial.
        assert point["joined_note"] == "" and point["joined_split"], point
        assert len(point["joined_trial_speedups"]) == 1, point
