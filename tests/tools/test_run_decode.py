"""Layers 1-2: `dbo run --decode-steps N` on CPU. Its argument errors before any rank
starts (layer 1); the run end to end on two gloo ranks it spawns itself, the decode
steps compared DBO off and on and reported in the table, summary and JSON line (layer 2,
marked distributed).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from dbo import cli


@pytest.mark.parametrize("args, message", [
    (("--decode-steps", "-1"), "--decode-steps=-1: must be >= 0"),
    (("--decode-steps", "2", "--cuda-graph"), "--decode-steps with --cuda-graph: decode "
                                              "steps read their KV caches' lengths"),
    (("--decode-steps", "2", "--hf-config", "mixtral"), "--decode-steps runs the preset "
                                                        "model's KV caches"),
])
def test_bad_decode_arguments_fail_fast(args: tuple[str, ...], message: str,
                                        capsys: pytest.CaptureFixture,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    import dbo.cli.run_job

    def refuse(*_: object, **__: object) -> None:
        raise AssertionError("ranks were started")

    monkeypatch.setattr(dbo.cli.run_job, "launch", refuse)
    with pytest.raises(SystemExit) as exc:
        cli.main(["run", *args])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


@pytest.mark.distributed
def test_run_with_decode_steps_end_to_end(tmp_path: Path,
                                          capsys: pytest.CaptureFixture) -> None:
    code = cli.main(["run", "--decode-steps", "2", "--tokens", "64", "--requests", "4",
                     "--steps", "1", "--warmup", "0", "--no-trace", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0, out
    final = json.loads(out.strip().splitlines()[-1])
    decode = final["decode"]
    assert decode["steps"] == 2 and decode["requests_per_rank"] == [4, 4]
    assert decode["split"] is True and "SplitWithCache" in decode["reason"]
    assert decode["outputs_match"] is True
    assert all(d < 1e-4 for d in decode["max_abs_diff"]), decode
    assert decode["step_ms"]["dbo_off"] > 0 and decode["step_ms"]["dbo_on"] > 0
    assert "decode: 2 steps of one token per request over KV caches" in out
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["decode"]["outputs_match"] is True
    assert final["outputs_match"] is True  # the prefill's line is as before
