"""Layer 1: `dbo run --decode-steps N` on CPU, its argument errors before any rank
starts. The run end to end on two gloo ranks, the decode steps compared DBO off and on
and reported in the table, summary and JSON line, shares tests/tools/test_cli.py's dbo run
(test_dbo_run_decode_steps_end_to_end).
"""
from __future__ import annotations

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
