"""Layers 1-2: `dbo bench --hf ARCH --mode decode` on CPU. The decode step over a KV
cache that is put back after every step, and its DBO split into one cache per ubatch,
against transformers (layer 1, one process, float32); argument errors before any rank
starts (layer 1); the command line end to end on two gloo ranks at tiny shapes, with
a2a and a2a_ll (converted per point with the point's requests as capacity): table,
CSV/JSON files and the final JSON line (host issue times included), decode logits equal
to the unconverted model's (layer 2).
"""
from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

import dbo  # noqa: E402
import moe.hf  # noqa: E402
from dbo.cli.bench.config import CPU_REGIME  # noqa: E402
from dbo.cli.bench.hf_decode import DecodeStep, PrefixCache, SplitCaches, prefill_cache  # noqa: E402
from tests.tools.test_bench_hf import refused_before_any_rank  # noqa: E402
from moe.hf.tiny import tiny_config, tiny_model  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


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
])
def test_bad_decode_arguments_exit_with_the_fix_before_any_rank(
        argv: list[str], message: str, capsys: pytest.CaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert message in refused_before_any_rank(["--hf", "qwen3_moe", *argv], capsys,
                                              monkeypatch)


@pytest.mark.distributed
def test_cli_hf_decode_end_to_end_on_two_gloo_ranks(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "NCCL_P2P_DISABLE")}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, "-m", "dbo.cli.bench", "--device", "cpu", "--hf", "deepseek_v3",
           "--mode", "decode", "--requests", "2,3", "--context", "5", "--backends", "a2a,a2a_ll",
           "--iters", "1", "--warmup", "0", "--rounds", "2", "--gate-min-tokens", "3",
           "--gate-trial-iters", "1", "--out", str(tmp_path), "--no-progress"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
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
    for p in points[0], points[2]:
        assert p["gate"] == "off" and p["gate_reason"].startswith("threshold: 2")
    for p in points[1], points[3]:
        assert p["gate_reason"].startswith("trial: DBO") or "trial DBO" in p["gate_reason"]
    table = "\n".join(lines[:-1])
    assert "dbo bench --hf deepseek_v3 --mode decode: world=2 regime=CPU gloo" in table
    assert "one token per request over 5 cached tokens" in table and "gate decisions:" in table
    assert "  capacity: a2a_ll: max_tokens_per_rank" in table
    assert "host unconv  host noDBO  host DBO" in table and "host-bound" not in table
    files = final["files"]
    with open(files["csv"]) as f:
        rows = list(csv.DictReader(f))
    assert [r["requests_per_rank"] for r in rows] == ["2", "3", "2", "3"]
    assert all(float(r["host_dbo_ms"]) > 0 for r in rows)
    doc = json.loads(Path(files["json"]).read_text())
    assert doc["config"]["decode"]["context"] == 5 and "gated_speedup" in doc["definitions"]
    assert all(len(p["rounds_ms"]["t_dbo"]) == 2 for p in doc["points"])
