"""Layers 1-2: `dbo bench --hf ARCH` on CPU. Argument errors before any rank starts and
the named real-shape architectures (layer 1, in-process; the real shapes are built on
the meta device only); how each backend is converted (`conversions`: a capacity per
point, or the largest, or none); the command line end to end on two gloo ranks at tiny
shapes, float32, with a2a, naive and a2a_ll (converted with the point's capacity): table,
CSV/JSON files and the final JSON line, host issue times included, the ceiling probe's
columns empty and why, each point's gate consistent with its trials and its reason
naming the rule that decided (layer 2). `--cuda-graph` settings, prefill and decode (layer 1).
Two GPUs (gpu, multigpu): the graphed sweep, probe included.
"""
from __future__ import annotations

import csv
import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from dbo.cli.bench import main  # noqa: E402
from dbo.cli.bench.config import CPU_REGIME  # noqa: E402
from dbo.cli.bench.config import NVLINK_REGIME  # noqa: E402
from dbo.cli.bench.gating import GatePolicy  # noqa: E402
from dbo.cli.bench.hf_config import (Conversion, HFBenchConfig, HFDecodeOptions,  # noqa: E402
                                     conversions)
from dbo.cli.bench.hf_probe import PROBE_NA_CPU  # noqa: E402
from moe.hf.named import REAL_SHAPES, named_architectures, named_config  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
VALID = ", ".join(named_architectures())


@pytest.mark.parametrize("argv, message", [
    (["--hf", "llama-moe"], f"unknown architecture 'llama-moe' for --hf: use one of {VALID}"),
    (["--hf", "qwen3-30b-a3b", "--world-size", "3"],
     "128 routed experts of qwen3-30b-a3b do not split over 3 ranks"),
    (["--hf", "qwen3_moe", "--num-experts", "5"],
     "5 routed experts of qwen3_moe do not split over 2 ranks"),
    (["--hf", "qwen3_moe", "--backends", "a2a,symm_mem"], "backend 'symm_mem' "),
    (["--hf", "qwen3_moe", "--backends", "deepep_ll"], "backend 'deepep_ll' needs DeepEP"),
    (["--hf", "qwen3_moe", "--backends", "symm_mem,deepep_ll"],
     "symm_mem cannot run in one process with deepep_ll"),
    (["--hf", "qwen3_moe", "--backends", "deepep_v2"], "backend 'deepep_v2' cannot run a "
                                                       "converted model"),
    (["--hf", "qwen3_moe", "--tokens", "10"], "tokens per rank 10 is not a positive multiple"),
    (["--hf", "qwen3_moe", "--requests", "1"], "requests=1 must be an int >= 2"),
    (["--hf", "qwen3_moe", "--min-gain", "-0.1"], "--min-gain -0.1 must be a fraction >= 0"),
    (["--hf", "qwen3_moe", "--gate-trial-iters", "0"], "gate_trial_iters=0 must be an int >= 1"),
    (["--hf", "qwen3_moe", "--preset", "tiny"], "--preset does not apply to --hf"),
    (["--hf", "qwen3_moe", "--cuda-graph"], "--cuda-graph needs CUDA GPUs: drop it on CPU"),
    (["--hf", "olmoe", "--num-experts", "5"], "5 routed experts of olmoe do not split"),
    (["--hf", "olmoe", "--conversion", "fused"], "argument --conversion: invalid choice"),
    (["--conversion", "experts"], "--conversion applies to --hf"),
    (["--hf", "qwen3_moe", "--combine-groups", "0"], "--combine-groups 0 must be an int >= 1"),
    (["--hf", "qwen3_moe", "--backends", "a2a_ll", "--combine-chunks", "2",
      "--combine-groups", "2"], "--combine-chunks 2 and --combine-groups 2: an SBO step "
                                "chunks its combine by rows or by expert group, not both"),
    (["--hf", "qwen3_moe", "--backends", "a2a_ll,a2a", "--combine-groups", "2"],
     "--combine-groups 2: backend 'a2a' has no such option (a2a_ll's SBO steps take it)"),
    (["--hf", "qwen3_moe", "--combine-chunks", "2"],
     "--combine-chunks 2: backend 'a2a' has no such option"),
    (["--hf", "qwen3_moe", "--backends", "a2a_ll", "--combine-groups", "5"],
     "--combine-groups 5 exceeds the 4 experts each rank holds (8 of qwen3_moe over 2 ranks)"),
    (["--hf", "qwen3_moe", "--backends", "a2a_ll", "--tokens", "8,16", "--combine-chunks",
      "9"], "--combine-chunks 9 exceeds the smallest point's 8 tokens per rank"),
    (["--hf", "qwen3_moe", "--mode", "decode", "--requests", "2,4", "--backends", "a2a_ll",
      "--combine-chunks", "3"], "--combine-chunks 3 exceeds the smallest point's 2 requests "
                                "per rank"),
])
def test_bad_arguments_exit_with_the_fix_before_any_rank(
        argv: list[str], message: str, capsys: pytest.CaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert message in refused_before_any_rank(argv, capsys, monkeypatch)


def refused_before_any_rank(argv: list[str], capsys: pytest.CaptureFixture,
                            monkeypatch: pytest.MonkeyPatch) -> str:
    """`dbo bench --device cpu argv` exits 2 with one line on stderr, spawning no rank:
    that line."""
    import torch.multiprocessing

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("ranks were started")

    monkeypatch.setattr(torch.multiprocessing, "spawn", refuse)
    with pytest.raises(SystemExit) as exc:
        main(["--device", "cpu", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("dbo bench: "), err
    return err


def test_each_backend_is_converted_with_the_capacity_its_points_need() -> None:
    points = (64, 256, 512)
    assert conversions("a2a", points, world_size=2) == [
        Conversion(max_tokens_per_rank=None, points=points)]
    assert conversions("symm_mem", points, world_size=2) == [
        Conversion(max_tokens_per_rank=512, points=points)]
    for padded in ("a2a_ll", "deepep_ll"):
        assert conversions(padded, points, world_size=2) == [
            Conversion(max_tokens_per_rank=p, points=(p,)) for p in points]
    # a2a_ll's DBO ubatches get their own capacity; deepep_ll's share the whole one.
    half = lambda p: p // 2  # noqa: E731
    assert conversions("a2a_ll", points, world_size=2, ubatch_of=half) == [
        Conversion(max_tokens_per_rank=p, max_tokens_per_ubatch=p // 2, points=(p,))
        for p in points]
    assert conversions("deepep_ll", points, world_size=2, ubatch_of=half) == [
        Conversion(max_tokens_per_rank=p, points=(p,)) for p in points]


@pytest.mark.parametrize("fields, message", [
    (dict(device="cpu"), "--cuda-graph needs CUDA GPUs"),
    (dict(backends=("a2a_ll", "a2a")), "--cuda-graph with --backends a2a: that backend "
                                       "reads device values on the host"),
    (dict(cuda_graph=1), "cuda_graph=1 must be True or False"),
    (dict(experts="reference"), "--cuda-graph cannot capture the reference experts"),
])
def test_cuda_graph_refuses_what_a_graph_cannot_replay(fields: dict, message: str) -> None:
    base = dict(arch="qwen3_moe", backends=("a2a_ll",), device="cuda", regime=NVLINK_REGIME,
                cuda_graph=True)
    with pytest.raises((ValueError, TypeError), match=re.escape(message)):
        HFBenchConfig(**{**base, **fields})


def test_cuda_graph_takes_decode_and_its_refusals_still_hold() -> None:
    """Decode steps leave their KV cache as they found it, so they are graphed too; what
    no graph can replay is still refused with decode."""
    base = dict(arch="qwen3_moe", backends=("a2a_ll",), device="cuda", regime=NVLINK_REGIME,
                cuda_graph=True, decode=HFDecodeOptions(requests=(4,)))
    cfg = HFBenchConfig(**base)
    assert cfg.cuda_graph and cfg.decode is not None and cfg.summary()["cuda_graph"] is True
    for fields, message in [(dict(device="cpu", regime=CPU_REGIME), "--cuda-graph needs CUDA GPUs"),
                            (dict(backends=("a2a",)), "--cuda-graph with --backends a2a"),
                            (dict(experts="reference"), "--cuda-graph cannot capture the "
                                                        "reference experts")]:
        with pytest.raises(ValueError, match=re.escape(message)):
            HFBenchConfig(**{**base, **fields})


def test_largest_ubatch_is_the_bigger_half_of_the_sequences() -> None:
    from dbo.cli.bench.hf_sweep import largest_ubatch
    assert largest_ubatch(HFBenchConfig(arch="qwen3_moe", tokens=(12,), requests=4), 12) == 6
    assert largest_ubatch(HFBenchConfig(arch="qwen3_moe", tokens=(15,), requests=3), 15) == 10


def test_deepep_ll_shape_and_queue_depth_are_checked_before_any_rank(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """As on a GPU machine with DeepEP (a stand-in module): a hidden size its kernels
    lack, and more tokens per rank than NVSHMEM's queue depth takes, are refused."""
    import types

    from dbo.cli.bench.hf_config import HFBenchConfig
    from dbo.cli.bench.hf_launch import check_backends_run
    fake = types.ModuleType("deep_ep")
    fake.__spec__ = types.SimpleNamespace(name="deep_ep")  # type: ignore[assignment]
    fake.Buffer = object  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "deep_ep", fake)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)

    def check(arch: str, tokens: int, env: dict[str, str]) -> None:
        cfg = HFBenchConfig(arch=arch, tokens=(tokens,), backends=("deepep_ll",))
        check_backends_run(cfg, cfg.model_config(2), world_size=2, env=env)

    with pytest.raises(ValueError, match="MoEConfig.hidden_size=64 is not supported"):
        check("qwen3_moe", 16, {})
    check("qwen3-30b-a3b", 256, {})
    with pytest.raises(ValueError, match=r"--tokens=4096 with --backends deepep_ll on 2 "
                                         r"ranks: .* needs an NVSHMEM queue depth of 8194, "
                                         r"above NVSHMEM_QP_DEPTH=1024; use --tokens <= 510"):
        check("qwen3-30b-a3b", 4096, {})
    check("qwen3-30b-a3b", 4096, {"NVSHMEM_QP_DEPTH": "8194"})


@pytest.mark.parametrize("name", ["deepseek-v3", "qwen3-30b-a3b"])
def test_real_shapes_convert_with_every_layer_moe(name: str) -> None:
    """The real-shape models (meta device: no memory) are what their checkpoints say, and
    every layer's block converts over 2 ranks (routing dbo can express)."""
    from transformers import AutoModelForCausalLM

    from moe.hf.convert import plan_blocks
    config = named_config(name, num_layers=2)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    plans = plan_blocks(model, world=2, check_weights=False)
    assert [p.path for p in plans] == ["model.layers.0.mlp", "model.layers.1.mlp"]
    moe = plans[0].config
    expected = {"qwen3-30b-a3b": (128, 8, 2048, 768, None), "deepseek-v3": (256, 8, 7168, 2048, 8)}
    assert (moe.num_experts, moe.top_k, moe.hidden_size, moe.intermediate_size,
            moe.n_group) == expected[name]
    if name == "deepseek-v3":
        assert (moe.topk_group, moe.scoring, moe.routed_scaling_factor) == (4, "sigmoid", 2.5)
        assert config.first_k_dense_replace == 0 and config.n_shared_experts == 1
    else:
        assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (
            32, 4, 128)


@pytest.mark.parametrize("name, sizes", [
    ("llama-4-scout", (16, 1, 5120, 8192, "feed_forward")),
    ("minimax-m2", (256, 8, 3072, 1536, "mlp"))])
def test_real_shapes_of_the_experts_path_families(name: str, sizes: tuple) -> None:
    """Llama-4-Scout and MiniMax-M2 (meta device): their checkpoints' sizes, every layer
    an MoE block the experts path plans over 2 ranks."""
    from transformers import AutoModelForCausalLM

    from moe.hf.convert import find_moe_blocks
    from moe.hf.generic import plan_experts
    from moe.hf.named import expert_sizes
    config = named_config(name, num_layers=2)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    blocks = find_moe_blocks(model)
    assert [p for p, _ in blocks] == [f"model.layers.{i}.{sizes[4]}" for i in range(2)]
    for i, (path, block) in enumerate(blocks):
        plan = plan_experts(path, block, model_config=config, world=2, backend="auto",
                            experts="auto", check_weights=False, layer_id=i)
        moe = plan.config
        assert (moe.num_experts, moe.top_k, moe.hidden_size,
                moe.intermediate_size) == sizes[:4]
    assert expert_sizes(config) == (sizes[0], sizes[1], sizes[3])
    assert (config.num_key_value_heads, config.head_dim) == (8, 128)


@pytest.mark.distributed
def test_cli_hf_end_to_end_on_two_gloo_ranks(tmp_path: Path, capfd: pytest.CaptureFixture,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    # main() in this process (the ranks it spawns import torch, this process has):
    # capfd also sees the ranks' stderr. Not under torchrun: it spawns its ranks.
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "NCCL_P2P_DISABLE"):
        monkeypatch.delenv(name, raising=False)
    code = main(["--device", "cpu", "--hf", "deepseek_v3", "--tokens", "8,16", "--requests", "2",
                 "--backends", "a2a,naive,a2a_ll", "--iters", "1", "--warmup", "0", "--rounds",
                 "2", "--gate-min-tokens", "16", "--gate-trial-iters", "1", "--out",
                 str(tmp_path)])
    stdout, stderr = capfd.readouterr()
    assert code == 0, stderr[-3000:]
    lines = stdout.strip().splitlines()
    final = json.loads(lines[-1])
    assert final["mode"] == "hf" and final["arch"] == "deepseek_v3"
    assert final["regime"] == CPU_REGIME and final["world_size"] == 2
    assert final["timings"] == "functional"
    shapes = final["shapes"]
    assert (shapes["num_experts"], shapes["experts_per_rank"], shapes["dtype"]) == (
        8, 4, "float32")
    assert shapes["expert_bytes_per_rank_converted"] == 1 * 4 * 3 * 64 * 32 * 4  # 1 MoE layer
    points = final["points"]
    assert [(p["backend"], p["tokens_per_rank"], p["max_tokens_per_rank"]) for p in points] == [
        ("a2a", 8, None), ("a2a", 16, None), ("naive", 8, None), ("naive", 16, None),
        ("a2a_ll", 8, 8), ("a2a_ll", 16, 16)]
    assert "a2a_ll: max_tokens_per_rank = the point's tokens per rank, " \
        "max_tokens_per_ubatch = its largest DBO ubatch" in final["capacity_note"]
    # Two sequences per rank: a DBO ubatch holds one, half the point's tokens.
    assert [p["max_tokens_per_ubatch"] for p in points] == [None] * 4 + [4, 8]
    for p in points:
        assert p["t_hf_ms"] > 0 and p["t_nodbo_ms"] > 0 and p["t_dbo_ms"] > 0
        assert p["host_hf_ms"] > 0 and p["host_nodbo_ms"] > 0 and p["host_dbo_ms"] > 0
        assert p["dbo_host_bound"] is None  # functional: host time = step time on CPU
        assert p["dbo_split"] is True and p["rounds"] == 2
        assert p["speedup"] is None and p["dbo_vs_hf"] is None  # functional: no ratios
        assert p["logits_diff_nodbo"] < 1e-5 and p["logits_diff_dbo"] < 1e-5
        # SBO: the DBO-off model through DBOConfig(overlap="sbo"), timed beside it; its
        # logits as DBO off's within the same float32 bound (other kernel orders only).
        assert p["t_sbo_ms"] > 0 and p["host_sbo_ms"] > 0 and p["sbo_note"] == "", p
        assert p["speedup_sbo"] is None and p["logits_diff_sbo"] < 1e-5
        # Joined experts: the DBO-on step with joined_experts=True, split as it is; its
        # logits within the same bound (the experts over both ubatches' rows at once).
        assert p["t_joined_ms"] > 0 and p["host_joined_ms"] > 0 and p["joined_split"], p
        assert p["speedup_joined"] is None and p["logits_diff_joined"] < 1e-5
        # No ceiling probe on CPU (nothing overlaps on gloo): its fields null, and why.
        assert [p[k] for k in ("t_compute_ms", "t_comm_ms", "t_both_ms", "t_split_ms",
                               "ceiling", "eta")] == [None] * 6, p
        assert p["probe_note"] == PROBE_NA_CPU
        _check_gate(p)
    table = "\n".join(lines[:-1])
    assert "dbo bench --hf deepseek_v3: world=2 regime=CPU gloo" in table
    assert "functional run" in table and "unconv ms" in table
    assert "host unconv  host noDBO  host DBO" in table and "host-bound" not in table
    assert "  capacity: a2a_ll: max_tokens_per_rank" in table
    assert ("  SBO: the DBO-off model through DBOConfig(overlap=\"sbo\"), one ubatch: shared "
            "experts under the dispatch, own rows under the combine") in table
    assert final["summary"]["points_sbo"] == 6
    assert final["summary"]["gated_never_slower_than_1pct"] is None  # functional: no ratios
    assert final["summary"]["points_gated_on"] == sum(p["gate"] == "dbo" for p in points)
    assert "gate decisions:" in lines and lines[-3].startswith("summary: functional run, 6 "
                                                                "points ran")
    assert [line.split(":")[0].split() for line in lines
            if re.match(r"\s+(a2a|naive|a2a_ll) T=(8|16)\s", line)] == [
        [p["backend"], f"T={p['tokens_per_rank']}", p["gate"]] for p in points]
    # Per point and round: DBO off, SBO's trial, SBO, DBO's trial, DBO on, joined's trial,
    # joined; no probe on CPU.
    total = 2 * (1 + 7 * 3) * 2
    assert f" {total}/{total} " in stderr and f" {total + 1}/" not in stderr
    assert stderr.count(": DBO trial\n") == 6 * 2 and stderr.count(": SBO trial\n") == 6 * 2
    assert stderr.count(": joined trial\n") == 6 * 2
    header = next(line for line in lines if "T/rank" in line)
    assert "comp ms   comm ms   both ms  split ms  ceiling     eta" in header
    assert "DBO ms           SBO ms        joined ms  host unconv" in header
    assert "SBO speedup" not in header and "joined speedup" not in header  # functional
    assert "  host DBO    gate  tok/s DBO" in header and "gated" not in header
    rows = [line for line in lines if re.match(r"\s+(8|16)\s+(a2a|naive|a2a_ll)\s", line)]
    assert len(rows) == 6 and all(re.search(r"(\s+-){6}\s", line) for line in rows), rows
    # unconverted, noDBO, DBO, SBO and joined each as rank0/max.
    assert all(len(re.findall(r"\d+\.\d{3}/\d+\.\d{3}", line)) == 5 for line in rows), rows
    assert "  joined: DBO with joined experts" in table
    assert (f"  a2a T=8, a2a T=16, naive T=8, naive T=16, a2a_ll T=8, a2a_ll T=16: "
            f"{PROBE_NA_CPU}") in lines
    files = final["files"]
    with open(files["csv"]) as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 6 and {r["backend"] for r in rows} == {"a2a", "naive", "a2a_ll"}
    assert all(float(r["host_dbo_ms"]) > 0 for r in rows)
    doc = json.loads(Path(files["json"]).read_text())
    assert doc["config"]["arch"] == "deepseek_v3" and "dbo_vs_hf" in doc["definitions"]
    assert "probe_note" in doc["definitions"] and rows[0]["probe_note"] == PROBE_NA_CPU
    assert all(len(p["rounds_ms"]["t_dbo"]) == 2 for p in doc["points"])
    assert all(len(p["rounds_ms"]["t_sbo"]) == 2 for p in doc["points"])
    assert "t_sbo" in doc["definitions"] and doc["config"]["combine_groups"] == 1
    assert all(len(p["trial_speedups"]) == 2 for p in doc["points"])
    assert all(len(p["rounds_ms"]["t_joined"]) == 2 and len(p["joined_trial_speedups"]) == 2
               for p in doc["points"])
    assert "t_joined" in doc["definitions"] and float(rows[0]["t_joined_ms"]) > 0
    assert [(r["gate"], r["gate_reason"]) for r in rows] == [
        (p["gate"], p["gate_reason"]) for p in points]
    assert (doc["config"]["gate_min_tokens"], doc["config"]["gate_trial_iters"]) == (16, 1)


def _check_gate(p: dict) -> None:
    """A point's gate (`dbo.cli.bench.hf_gate`) as the end-to-end run reports it: two
    trials of each mode (one per round), the mode's reported time as the gated time, and
    a reason naming the rule that decided each mode. Which mode wins depends on this
    machine's CPU timings (nothing overlaps on gloo), so the decision is checked against
    its own trials, not fixed."""
    assert len(p["trial_speedups"]) == 2 and len(p["sbo_trial_speedups"]) == 2, p
    assert len(p["joined_trial_speedups"]) == 2, p
    assert p["gated_speedup"] is None  # functional: no ratios
    assert p["t_gated_ms"] == {"off": p["t_nodbo_ms"], "sbo": p["t_sbo_ms"],
                               "dbo": p["t_dbo_ms"], "joined": p["t_joined_ms"]}[p["gate"]], p
    worst = {mode: min(p[key]) for mode, key in (
        ("sbo", "sbo_trial_speedups"), ("joined", "joined_trial_speedups"),
        ("dbo", "trial_speedups"))}
    sbo, rest = p["gate_reason"].split("; DBO: ")
    dbo, joined = rest.split("; joined: ")
    assert sbo.startswith("SBO: trial SBO ") and (" >= 1.010x" in sbo) == (
        worst["sbo"] >= 1.01), sbo
    for name, reason in (("DBO", dbo), ("joined", joined)):  # the same split rules
        trials_ok = worst[name.lower()] >= 1.01
        if p["tokens_per_rank"] < 16:  # --gate-min-tokens 16: off, whatever its trials
            assert reason == "threshold: 8 tokens/rank < 16", p
        elif trials_ok:  # no probe on CPU: the gate skips that rule and says so
            assert reason.startswith(f"16 tokens/rank >= 16; probe skipped on CPU; trial "
                                     f"{name} "), reason
        else:
            assert reason.startswith(f"trial: {name} "), reason
    # Of the modes that pass, the fastest worst trial; SBO, joined, DBO on a tie.
    passing = {mode: w for mode, w in worst.items()
               if w >= 1.01 and (mode == "sbo" or p["tokens_per_rank"] >= 16)}
    assert p["gate"] == (max(passing, key=lambda m: passing[m]) if passing else "off"), p


def _graphed_hf_sweep(rank: int, world_size: int, out_dir: str) -> dict:
    import torch.distributed as dist

    from dbo.cli.bench.hf_report import final_line, format_table, write_outputs
    from dbo.cli.bench.hf_sweep import run_hf_sweep
    # --gate-min-tokens 0: the tiny points reach the gate's probe rule.
    cfg = HFBenchConfig(arch="qwen3_moe", tokens=(16, 32), requests=4, backends=("a2a_ll",),
                        iters=2, warmup=1, rounds=1, device="cuda", regime=NVLINK_REGIME,
                        cuda_graph=True, gate_min_tokens=0, out_dir=out_dir, progress=False)
    device = torch.device("cuda", rank)
    result = run_hf_sweep(cfg, group=dist.group.WORLD, device=device)
    replays = _replays_equal_eager(cfg, device)
    if rank:
        return {}
    return {"final": json.loads(final_line(result, write_outputs(result))),
            "table": format_table(result), "replays": replays}


def _replays_equal_eager(cfg: Any, device: torch.device) -> dict[str, bool]:
    """The converted model's steps as the sweep replays them (a captured forward; a
    GraphedRunner) against the same steps run eagerly: bit for bit."""
    import torch.distributed as dist

    import moe.hf
    from dbo import DBOConfig, DBORunner, GraphedRunner
    from dbo.cli.bench.hf_graphs import replayed
    from dbo.cli.bench.hf_sweep import _step, build_model, largest_ubatch
    from dbo.graphs import capture_graph
    model = build_model(cfg, cfg.model_config(2), device=device, dtype=torch.bfloat16)
    tokens = cfg.tokens[-1]
    moe.hf.convert(model, group=dist.group.WORLD, backend="a2a_ll", max_tokens_per_rank=tokens,
                   max_tokens_per_ubatch=largest_ubatch(cfg, tokens))
    torch.manual_seed(dist.get_rank())
    ids = torch.randint(0, model.config.vocab_size, (cfg.requests, tokens // cfg.requests),
                        device=device)
    kwargs = {"input_ids": ids, "use_cache": False, "logits_to_keep": 1}
    runner = DBORunner(model, DBOConfig(split="batch", min_prefill_tokens=2,
                                        min_decode_tokens=2))
    off, on = _step(model, kwargs), _step(runner, kwargs)
    eager_off, eager_on = off().logits, on().logits
    graph_off = replayed(capture_graph(off, device=device, warmup=2))().logits
    graph_on = _step(GraphedRunner(runner), kwargs)().logits
    return {"off": torch.equal(graph_off, eager_off), "on": torch.equal(graph_on, eager_on),
            "split": bool(runner.last_decision.split)}


@pytest.mark.gpu
@pytest.mark.multigpu
def test_graphed_hf_sweep_replays_the_converted_model_on_two_gpus(tmp_path: Path) -> None:
    """`--cuda-graph`: DBO off and on replayed from graphs give exactly what the same
    converted steps give eagerly; the sweep's points carry the graph fields, a2a_ll's
    ubatches at half the capacity; the unconverted model's graph is timed or its failure
    said; the ceiling probe measured every point (compute, comm, both, split, ceiling),
    and the gate decided on that ceiling.
    (At these tiny random bfloat16 shapes the logits of our expert kernels and
    transformers' grouped_mm differ by up to ~15% of the largest logit, so the sweep's
    difference to the unconverted model is only bounded loosely here; at real shapes it
    is 1-3%, BENCHMARKS.md section 13.)"""
    from tests.dist_utils import run_distributed

    out = run_distributed(2, _graphed_hf_sweep, str(tmp_path), backend="nccl")[0]
    final, table = out["final"], out["table"]
    assert final["files"]["json"].endswith("_nvlink_graphs.json"), final["files"]
    for point in final["points"]:
        assert point["cuda_graph"] and point["dbo_split"], point
        assert point["max_tokens_per_ubatch"] == point["tokens_per_rank"] // 2, point
        assert point["logits_diff_nodbo"] < 0.3 and point["logits_diff_dbo"] < 0.3, point
        assert point["t_hf_eager_ms"] > 0 and point["t_nodbo_ms"] > 0 and point["t_dbo_ms"] > 0
        assert (point["t_hf_graph_ms"] is None) == bool(point["hf_graph_note"]), point
        # The ceiling probe, graphed as the steps are: a2a_ll is made of collectives.
        for key in ("t_compute_ms", "t_comm_ms", "t_both_ms", "t_split_ms", "ceiling"):
            assert point[key] is not None and point[key] > 0, (key, point)
        assert point["probe_note"] == "", point
        # SBO through its own GraphedRunner: timed, and its logits as close as DBO off's.
        assert point["t_sbo_ms"] > 0 and point["sbo_note"] == "", point
        assert point["logits_diff_sbo"] < 0.3, point
        # The gate's DBO rules on this point's measured ceiling and its (graphed) trials:
        # the sweep hands the probe's ceiling to the gate.
        # Joined experts through their own GraphedRunner: split, timed, a trial.
        assert point["t_joined_ms"] > 0 and point["joined_split"], point
        assert point["logits_diff_joined"] < 0.3, point
        dbo, joined = point["gate_reason"].split("; DBO: ")[1].split("; joined: ")
        gate = GatePolicy(min_tokens_per_rank=0, min_gain=0.03)
        rules = dict(tokens_per_rank=point["tokens_per_rank"], ceiling=point["ceiling"])
        assert dbo == gate.decide(trial_speedups=point["trial_speedups"], **rules).reason, (
            dbo, point)
        assert joined == gate.decide(trial_speedups=point["joined_trial_speedups"],
                                     name="joined", **rules).reason, (joined, point)
        assert point["t_gated_ms"] == {"off": point["t_nodbo_ms"], "sbo": point["t_sbo_ms"],
                                       "dbo": point["t_dbo_ms"],
                                       "joined": point["t_joined_ms"]}[point["gate"]], point
        assert point["gated_speedup"] > 0 and len(point["trial_speedups"]) == 1, point
    assert "  ceiling probe: measured: compute alone" in table
    assert "CUDA graphs: the converted model's steps are replayed" in table
    assert "attention without a mask (hf_graphs.use_mask_free_sdpa)" in table
    assert out["replays"] == {"off": True, "on": True, "split": True}, out["replays"]
