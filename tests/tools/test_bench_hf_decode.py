"""Layers 1-2: `dbo bench --hf ARCH --mode decode` on CPU. The decode step over a KV
cache that is put back after every step, and its DBO split into one cache per ubatch,
against transformers (layer 1, one process, float32); what graphing the step relies on:
the graph key of its caches, attention that builds no mask in a capture (layer 1);
argument errors before any rank starts (layer 1); the command line end to end on two
gloo ranks at tiny shapes, with a2a and a2a_ll (converted per point with the point's
requests as capacity): table, CSV/JSON files and the final JSON line (host issue times
included), decode logits equal to the unconverted model's (layer 2). Two GPUs (gpu,
multigpu): the graphed decode sweep, its replays bit for bit the eager steps.
"""
from __future__ import annotations

import csv
import json
from pathlib import Path

from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

import dbo  # noqa: E402
import moe.hf  # noqa: E402
from dbo.cli.bench.config import CPU_REGIME, NVLINK_REGIME  # noqa: E402
from dbo.cli.bench.hf_config import HFBenchConfig, HFDecodeOptions  # noqa: E402
from dbo.cli.bench.hf_decode import DecodeStep, PrefixCache, SplitCaches, prefill_cache  # noqa: E402
from dbo.cli.bench import main  # noqa: E402
from tests.tools.test_bench_hf import refused_before_any_rank  # noqa: E402
from moe.hf.tiny import tiny_config, tiny_model  # noqa: E402

def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def _prompt(config: object, requests: int, context: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    vocab = config.vocab_size  # type: ignore[attr-defined]
    return (torch.randint(0, vocab, (requests, context), generator=gen),
            torch.randint(0, vocab, (requests, 1), generator=gen))


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_decode_step_keeps_the_cache_and_is_transformers_next_token(arch: str) -> None:
    """Repeated steps decode over the same prefix (the cache does not grow), and a step's
    logits are those of the whole sequence's last position without a cache; the
    prefill in chunks of whole requests gives that cache."""
    config = tiny_config(arch)
    model = tiny_model(config, seed=0)
    prompt, next_ids = _prompt(config, requests=5, context=6)
    base = prefill_cache(model, prompt, chunk_tokens=12)  # 2 requests per call
    cache = PrefixCache.rows_of(base, slice(0, 5))
    step = DecodeStep(model)
    with torch.no_grad():
        logits = [step(next_ids, cache=cache) for _ in range(3)]
        full = model(input_ids=torch.cat([prompt, next_ids], dim=1), use_cache=False).logits
    assert cache.cache.get_seq_length() == 6
    assert torch.equal(logits[0], logits[1]) and torch.equal(logits[0], logits[2])
    assert _rel(logits[0], full[:, -1]) < 1e-5


def test_converted_decode_split_in_two_caches_equals_unconverted() -> None:
    """DBO on (ubatch u: its requests and a cache of their rows) and off, on the converted
    model, give the unconverted model's decode logits over the same cached prefix."""
    config = tiny_config("qwen3_moe")
    model = tiny_model(config, seed=1)
    prompt, next_ids = _prompt(config, requests=5, context=4)
    base = prefill_cache(model, prompt)
    cache = PrefixCache.rows_of(base, slice(0, 5))
    parts = (PrefixCache.rows_of(base, slice(0, 3)), PrefixCache.rows_of(base, slice(3, 5)))
    with torch.no_grad():
        expected = DecodeStep(model)(next_ids, cache=cache)
        decoder = DecodeStep(moe.hf.convert(model))
        runner = dbo.DBORunner(decoder, dbo.DBOConfig(split=SplitCaches()))
        on = runner(next_ids, cache=cache, parts=parts)
        off = decoder(next_ids, cache=cache)
    assert runner.last_decision is not None and runner.last_decision.split
    assert [p.cache.get_seq_length() for p in parts] == [4, 4]
    assert _rel(off, expected) < 1e-5 and _rel(on, expected) < 1e-5


def test_graph_key_of_a_decode_step_is_its_caches_by_identity() -> None:
    """`GraphedRunner` keys a graph on the step's non-tensor arguments: the `PrefixCache`
    (and the `parts` pair) hash by identity, so the same caches find their graph and
    other caches of the same rows, whose tensors the graph does not read, do not."""
    from dbo.graphs import _signature
    config = tiny_config("qwen3_moe")
    prompt, next_ids = _prompt(config, requests=4, context=3)
    base = prefill_cache(tiny_model(config, seed=0), prompt)

    def kwargs() -> dict[str, Any]:
        return {"cache": PrefixCache.rows_of(base, slice(0, 4)),
                "parts": (PrefixCache.rows_of(base, slice(0, 2)),
                          PrefixCache.rows_of(base, slice(2, 4)))}

    mine, other = kwargs(), kwargs()
    key = _signature((next_ids,), mine)
    assert hash(key) == hash(_signature((next_ids,), dict(mine)))
    assert key == _signature((next_ids,), dict(mine))
    assert key != _signature((next_ids,), other)
    assert key != _signature((next_ids,), {**mine, "parts": other["parts"]})


def test_mask_free_sdpa_decodes_as_sdpa_and_builds_no_mask_in_a_capture(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`use_mask_free_sdpa`: prefill and decode give sdpa's own results bit for bit, and
    a decode step calls sdpa without a mask also while a CUDA stream captures (faked
    here), where transformers 5.17's sdpa path builds one."""
    from dbo.cli.bench.hf_graphs import MASK_FREE_SDPA, use_mask_free_sdpa
    for arch in ("qwen3_moe", "deepseek_v3"):
        config = tiny_config(arch)
        model = tiny_model(config, seed=0)
        prompt, next_ids = _prompt(config, requests=3, context=5)
        base = prefill_cache(model, prompt)
        with torch.no_grad():
            expected = DecodeStep(model)(next_ids, cache=PrefixCache.rows_of(base, slice(0, 3)))
        use_mask_free_sdpa(model)
        assert model.config._attn_implementation == MASK_FREE_SDPA
        again = prefill_cache(model, prompt)
        assert all(torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
                   for a, b in zip(base.layers, again.layers, strict=True))
        masks = []
        sdpa = torch.nn.functional.scaled_dot_product_attention

        def spy(*args: Any, **kwargs: Any) -> torch.Tensor:
            masks.append(kwargs.get("attn_mask"))
            return sdpa(*args, **kwargs)

        with monkeypatch.context() as patch:
            patch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
            patch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
            with torch.no_grad():
                logits = DecodeStep(model)(next_ids,
                                           cache=PrefixCache.rows_of(base, slice(0, 3)))
        assert torch.equal(logits, expected), arch
        assert len(masks) == config.num_hidden_layers and all(m is None for m in masks), masks


def test_graphed_decode_report_says_so_and_shows_the_unconverted_graph(
        tmp_path: Path) -> None:
    """The table of a `--cuda-graph` decode run (a made-up point) has the CUDA graphs line,
    the unconverted model's eager/graph column, and why it did not capture; its files
    end in _graphs and carry the fields."""
    from dbo.cli.bench.hf_decode import HFDecodePoint, HFDecodeResult
    from dbo.cli.bench.hf_decode_report import final_line, format_table, write_outputs
    cfg = HFBenchConfig(arch="qwen3_moe", backends=("a2a_ll",), device="cuda",
                        regime=NVLINK_REGIME, cuda_graph=True, out_dir=str(tmp_path),
                        decode=HFDecodeOptions(requests=(4, 6), context=8))
    times = dict(t_hf_ms=1.0, t_hf_ms_rank0=1.0, t_nodbo_ms=2.0, t_nodbo_ms_rank0=2.0,
                 t_dbo_ms=1.5, t_dbo_ms_rank0=1.5, host_hf_ms=0.1, host_nodbo_ms=0.1,
                 host_dbo_ms=0.1, dbo_host_bound=False, tokens_per_s_hf=8000.0,
                 tokens_per_s_nodbo=4000.0, tokens_per_s_dbo=5000.0, speedup=2.0 / 1.5,
                 dbo_vs_hf=1.0 / 1.5, nodbo_vs_hf=0.5)
    points = [HFDecodePoint(
        regime=cfg.regime, arch=cfg.arch, backend="a2a_ll", requests_per_rank=r, context=8,
        world_size=2, max_tokens_per_rank=r, max_tokens_per_ubatch=r // 2, gate="dbo",
        gate_reason="trial", t_gated_ms=1.5, gated_speedup=2.0 / 1.5, dbo_split=True,
        dbo_split_reason="", logits_diff_nodbo=0.01, logits_diff_dbo=0.01, cuda_graph=True,
        t_hf_eager_ms=1.25, t_hf_graph_ms=graph, hf_graph_note=note, **times)
        for r, graph, note in ((4, 1.0, ""), (6, None, "did not capture: sync"))]
    shapes = dict(model_type="qwen3_moe", hidden_size=64, num_experts=8, experts_per_rank=4,
                  top_k=2, intermediate_size=32, layers=2, dtype="bfloat16",
                  hf_experts_implementation="grouped_mm", kv_cache_layer="DynamicLayer",
                  kv_cache_bytes_per_rank=1000, max_requests=6)
    result = HFDecodeResult(cfg, 2, shapes, points)
    table = format_table(result)
    assert "CUDA graphs: the converted model's steps are replayed" in table
    header = next(line for line in table.splitlines() if "R/rank" in line)
    assert "unconv eager/graph" in header
    assert "1.250/1.000" in table and "1.250/-" in table
    assert "  unconverted R=6: no graph: did not capture: sync" in table
    final = json.loads(final_line(result, write_outputs(result)))
    assert final["files"]["csv"].endswith("_nvlink_graphs.csv")
    assert [(p["t_hf_eager_ms"], p["t_hf_graph_ms"]) for p in final["points"]] == [
        (1.25, 1.0), (1.25, None)]


@pytest.mark.parametrize("argv, message", [
    (["--mode", "decode", "--requests", "1,4"],
     "--requests 1: DBO splits each decode step's requests into two groups"),
    (["--mode", "decode", "--context", "0"],
     "--context 0: the tokens already cached per request must be an int >= 1"),
    (["--requests", "2,4"], "--requests 2,4: --hf without --mode decode takes one count"),
    (["--mode", "decode", "--tokens", "8"], "sweeps --requests (one new token per request "
                                            "per step): drop --tokens"),
    (["--context", "8"], "--context 8 applies to decode steps: add --mode decode"),
    (["--mode", "model"], "--mode model does not apply to --hf"),
    (["--mode", "decode", "--cuda-graph"], "--cuda-graph needs CUDA GPUs: drop it on CPU"),
])
def test_bad_decode_arguments_exit_with_the_fix_before_any_rank(
        argv: list[str], message: str, capsys: pytest.CaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert message in refused_before_any_rank(["--hf", "qwen3_moe", *argv], capsys,
                                              monkeypatch)


@pytest.mark.distributed
def test_cli_hf_decode_end_to_end_on_two_gloo_ranks(
        tmp_path: Path, capfd: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    # main() in this process (the ranks it spawns import torch, this process has):
    # capfd also sees the ranks' stderr. Not under torchrun: it spawns its ranks.
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "NCCL_P2P_DISABLE"):
        monkeypatch.delenv(name, raising=False)
    code = main(["--device", "cpu", "--hf", "deepseek_v3", "--mode", "decode", "--requests",
                 "2,3", "--context", "5", "--backends", "a2a,a2a_ll", "--iters", "1", "--warmup",
                 "0", "--rounds", "2", "--gate-min-tokens", "3", "--gate-trial-iters", "1",
                 "--out", str(tmp_path), "--no-progress"])
    stdout, stderr = capfd.readouterr()
    assert code == 0, stderr[-3000:]
    lines = stdout.strip().splitlines()
    final = json.loads(lines[-1])
    assert final["mode"] == "hf_decode" and final["arch"] == "deepseek_v3"
    assert final["regime"] == CPU_REGIME and final["world_size"] == 2
    assert final["timings"] == "functional"
    assert (final["shapes"]["context"], final["shapes"]["max_requests"]) == (5, 3)
    assert final["summary"]["gated_never_slower_than_1pct"] is None  # functional: no ratios
    points = final["points"]
    assert [(p["backend"], p["requests_per_rank"], p["max_tokens_per_rank"])
            for p in points] == [("a2a", 2, None), ("a2a", 3, None), ("a2a_ll", 2, 2),
                                 ("a2a_ll", 3, 3)]
    assert "max_tokens_per_ubatch = its largest DBO ubatch" in final["capacity_note"]
    assert [p["max_tokens_per_ubatch"] for p in points] == [None, None, 1, 2]
    for p in points:
        assert p["t_hf_ms"] > 0 and p["t_nodbo_ms"] > 0 and p["t_dbo_ms"] > 0
        assert p["host_hf_ms"] > 0 and p["host_nodbo_ms"] > 0 and p["host_dbo_ms"] > 0
        assert p["dbo_host_bound"] is None  # functional: host time = step time on CPU
        assert p["dbo_split"] is True and p["rounds"] == 2 and len(p["trial_speedups"]) == 2
        assert p["speedup"] is None and p["gated_speedup"] is None
        assert p["logits_diff_nodbo"] < 1e-5 and p["logits_diff_dbo"] < 1e-5
        # SBO: the DBO-off step (one cache) through DBOConfig(overlap="sbo"), timed each
        # round; its logits within the same float32 bound as DBO off's.
        assert p["t_sbo_ms"] > 0 and p["sbo_note"] == "" and p["speedup_sbo"] is None, p
        assert p["logits_diff_sbo"] < 1e-5
        # Joined experts: the DBO-on step (two caches) with joined_experts=True, timed each
        # round, not gated; its logits within the same bound.
        assert p["t_joined_ms"] > 0 and p["joined_split"] and p["speedup_joined"] is None, p
        assert p["logits_diff_joined"] < 1e-5 and "joined" not in p["gate_reason"], p
    assert final["summary"]["points_sbo"] == 4 and final["summary"]["points_joined"] == 4
    for p in points[0], points[2]:
        assert p["gate"] == "off" and p["gate_reason"].startswith("threshold: 2")
    for p in points[1], points[3]:
        assert p["gate_reason"].startswith("trial: DBO") or "trial DBO" in p["gate_reason"]
    table = "\n".join(lines[:-1])
    assert "dbo bench --hf deepseek_v3 --mode decode: world=2 regime=CPU gloo" in table
    assert "one token per request over 5 cached tokens" in table and "gate decisions:" in table
    assert "  capacity: a2a_ll: max_tokens_per_rank" in table
    assert "host unconv  host noDBO  host DBO" in table and "host-bound" not in table
    assert ("  SBO: the DBO-off model through DBOConfig(overlap=\"sbo\"), one ubatch: shared "
            "experts under the dispatch, own rows under the combine") in table
    header = next(line for line in lines if "R/rank" in line)
    assert "DBO ms           SBO ms        joined ms  host unconv" in header
    assert "SBO speedup" not in header and "joined speedup" not in header  # functional
    assert "  joined: DBO with joined experts" in table
    files = final["files"]
    with open(files["csv"]) as f:
        rows = list(csv.DictReader(f))
    assert [r["requests_per_rank"] for r in rows] == ["2", "3", "2", "3"]
    assert all(float(r["t_sbo_ms"]) > 0 for r in rows)
    assert all(float(r["host_dbo_ms"]) > 0 for r in rows)
    doc = json.loads(Path(files["json"]).read_text())
    assert doc["config"]["decode"]["context"] == 5 and "gated_speedup" in doc["definitions"]
    assert all(len(p["rounds_ms"]["t_dbo"]) == 2 for p in doc["points"])
    assert all(len(p["rounds_ms"]["t_sbo"]) == 2 for p in doc["points"])
    assert all(len(p["rounds_ms"]["t_joined"]) == 2 for p in doc["points"])
    assert "t_sbo" in doc["definitions"] and "t_joined" in doc["definitions"]
    assert all(float(r["t_joined_ms"]) > 0 for r in rows)


def _graphed_hf_decode(rank: int, world_size: int, out_dir: str) -> dict:
    import torch.distributed as dist

    from dbo.cli.bench.hf_decode import run_hf_decode
    from dbo.cli.bench.hf_decode_report import final_line, format_table, write_outputs
    cfg = HFBenchConfig(arch="qwen3_moe", backends=("a2a_ll",), iters=2, warmup=1,
                        rounds=1, device="cuda", regime=NVLINK_REGIME, cuda_graph=True,
                        out_dir=out_dir, progress=False,
                        decode=HFDecodeOptions(requests=(4, 5), context=8,
                                               gate_trial_iters=1))
    device = torch.device("cuda", rank)
    result = run_hf_decode(cfg, group=dist.group.WORLD, device=device)
    replays = _decode_replays_equal_eager(cfg, device)
    if rank:
        return {}
    return {"final": json.loads(final_line(result, write_outputs(result))),
            "table": format_table(result), "replays": replays}


def _decode_replays_equal_eager(cfg: HFBenchConfig, device: torch.device) -> dict[str, Any]:
    """The converted model's decode steps as the sweep replays them (a captured step; a
    GraphedRunner over the split caches), twice each, against the same steps run
    eagerly: bit for bit, the caches still at `context` positions."""
    import torch.distributed as dist

    from dbo.cli.bench.hf_decode import SplitCaches, _step
    from dbo.cli.bench.hf_sweep import build_model
    from dbo.cli.bench.hf_graphs import replayed
    from dbo.graphs import GraphedRunner, capture_graph
    assert cfg.decode is not None
    requests, context = cfg.decode.requests[-1], cfg.decode.context
    half = (requests + 1) // 2
    model = build_model(cfg, cfg.model_config(2), device=device, dtype=torch.bfloat16)
    torch.manual_seed(dist.get_rank())
    vocab = model.config.vocab_size
    prompt = torch.randint(0, vocab, (requests, context), device=device)
    ids = torch.randint(0, vocab, (requests, 1), device=device)
    base = prefill_cache(model, prompt)
    cache = PrefixCache.rows_of(base, slice(0, requests))
    parts = (PrefixCache.rows_of(base, slice(0, half)),
             PrefixCache.rows_of(base, slice(half, requests)))
    model = moe.hf.convert(model, group=dist.group.WORLD, backend="a2a_ll",
                           max_tokens_per_rank=requests, max_tokens_per_ubatch=half)
    decoder = DecodeStep(model)
    runner = dbo.DBORunner(decoder, dbo.DBOConfig(split=SplitCaches()), group=dist.group.WORLD)
    off = _step(decoder, ids, cache=cache)
    on = _step(runner, ids, cache=cache, parts=parts)
    eager_off, eager_on = off(), on()
    split = bool(runner.last_decision is not None and runner.last_decision.split)
    replay_off = replayed(capture_graph(off, device=device, warmup=2))
    graphed = GraphedRunner(runner)
    replay_on = _step(graphed, ids, cache=cache, parts=parts)
    graph_off = [replay_off() for _ in range(2)]
    graph_on = [replay_on() for _ in range(2)]
    return {"off": all(torch.equal(g, eager_off) for g in graph_off),
            "on": all(torch.equal(g, eager_on) for g in graph_on), "split": split,
            "captures": graphed.num_captures,
            "context": [c.cache.get_seq_length() for c in (cache, *parts)]}


@pytest.mark.gpu
@pytest.mark.multigpu
def test_graphed_hf_decode_replays_the_eager_steps_on_two_gpus(tmp_path: Path) -> None:
    """`--mode decode --cuda-graph`: DBO off and on replayed from graphs give exactly what
    the same converted steps give eagerly, replay after replay (the cache does not grow);
    the sweep's points carry the graph fields, the unconverted model's graph timed or
    its failure said. (Tiny random bfloat16 shapes: the difference to the unconverted
    model is bounded loosely, as in the prefill GPU test.)"""
    from tests.dist_utils import run_distributed

    out = run_distributed(2, _graphed_hf_decode, str(tmp_path), backend="nccl")[0]
    final, table = out["final"], out["table"]
    assert out["replays"] == {"off": True, "on": True, "split": True, "captures": 1,
                              "context": [8, 8, 8]}, out["replays"]
    assert final["mode"] == "hf_decode"
    assert final["files"]["json"].endswith("_nvlink_graphs.json"), final["files"]
    doc = json.loads(Path(final["files"]["json"]).read_text())
    assert doc["config"]["cuda_graph"] is True and "t_hf_eager / t_hf_graph" in doc["definitions"]
    points = final["points"]
    assert [(p["requests_per_rank"], p["max_tokens_per_ubatch"]) for p in points] == [
        (4, 2), (5, 3)]
    for point in points:
        assert point["cuda_graph"] and point["dbo_split"], point
        assert point["logits_diff_nodbo"] < 0.3 and point["logits_diff_dbo"] < 0.3, point
        assert point["t_hf_eager_ms"] > 0 and point["t_nodbo_ms"] > 0 and point["t_dbo_ms"] > 0
        assert (point["t_hf_graph_ms"] is None) == bool(point["hf_graph_note"]), point
        assert point["t_hf_ms"] <= point["t_hf_eager_ms"], point
        assert len(point["trial_speedups"]) == 1 and point["trial_speedups"][0] > 0, point
        assert point["speedup"] > 0 and point["gated_speedup"] > 0, point
        # SBO through its own GraphedRunner over the one cache.
        assert point["t_sbo_ms"] > 0 and point["speedup_sbo"] > 0, point
        assert point["sbo_note"] == "" and point["logits_diff_sbo"] < 0.3, point
        # Joined experts through their own GraphedRunner over the two caches.
        assert point["t_joined_ms"] > 0 and point["speedup_joined"] > 0, point
        assert point["joined_split"] and point["logits_diff_joined"] < 0.3, point
    assert "CUDA graphs: the converted model's steps are replayed" in table
    assert "unconv eager/graph" in table
