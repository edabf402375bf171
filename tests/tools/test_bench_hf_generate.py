"""Layer 2 (two gloo processes): `python -m dbo.cli.bench.hf_generate`, the time per
new token of `moe.hf.generate` (eager, static cache, CUDA graphs) DBO off and on. On CPU
it runs the eager and static modes, says the graphed ones need GPUs, gives the eager
DBO-off run's tokens in every mode (float32), and ends with its JSON line; bad settings
stop it before any rank starts.
"""
from __future__ import annotations

import json
import math

import pytest

pytest.importorskip("transformers")

from dbo.cli.bench import hf_generate  # noqa: E402


@pytest.mark.distributed
def test_cpu_run_times_the_eager_and_static_modes_and_skips_graphs(capsys, tmp_path):
    assert hf_generate.main(["--hf", "qwen3_moe", "--layers", "1", "--new-tokens", "2,4",
                             "--rounds", "1", "--world-size", "2",
                             "--out", str(tmp_path / "new" / "folder")]) == 0
    printed = capsys.readouterr().out.strip().splitlines()
    result = json.loads(printed[-1])
    assert json.loads((tmp_path / "new" / "folder" / "hf_generate.json").read_text()) == result
    assert result["world_size"] == 2 and result["dtype"] == "float32"
    rows = {(row["mode"], row["dbo"]): row for row in result["rows"]}
    assert set(rows) == {(mode, on) for mode in hf_generate.MODES for on in (False, True)}
    for on in (False, True):
        assert rows[("graph", on)]["skipped"] == "CUDA graphs need GPUs"
        for mode in ("eager", "static"):
            row = rows[(mode, on)]
            assert row["rows_equal_eager"] == 4 and row["split"] is on, row
            # A timing, not an outcome: the steady time is a difference of two timed
            # calls, which a loaded CPU can make negative; only its presence is checked.
            assert math.isfinite(row["ms_per_token"]) and row["ms_whole"] > 0
    table = "\n".join(printed[:-1])
    assert "ms/token: steady, (4 - 2 new tokens)" in table
    assert "(CUDA graphs need GPUs)" in table


@pytest.mark.parametrize("argv, message", [
    (["--new-tokens", "5,3"], "--new-tokens=5,3: give N1,N2 with 1 <= N1 < N2"),
    (["--new-tokens", "5"], "--new-tokens=5: give N1,N2"),
    (["--requests", "0"], "--requests=0: must be an int >= 1"),
    (["--seed", "-1"], "--seed=-1: must be an int >= 0"),
])
def test_bad_settings_stop_before_any_rank_starts(argv, message, capsys):
    with pytest.raises(SystemExit) as stop:
        hf_generate.main(["--hf", "qwen3_moe", *argv])
    assert stop.value.code == 2
    assert message in capsys.readouterr().err


def test_a_steady_time_that_is_not_positive_is_labelled_noise():
    """Layer 1 (CPU): the table says a non-positive steady time is noise, not a speed."""
    row = {"mode": "eager", "dbo": False, "ms_per_token": -5.7, "ms_whole": 90.0,
           "split": False, "rows_equal_eager": 4}
    result = {"config": {"new_tokens": [2, 4], "arch": "qwen3_moe", "layers": 1,
                         "requests": 4, "prompt": 8, "rounds": 1},
              "world_size": 2, "regime": "cpu", "dtype": "float32", "device": "cpu",
              "rows": [row, {**row, "ms_per_token": 3.2}]}
    lines = hf_generate.format_table(result).splitlines()
    assert "(noise: raise N2 - N1 or --rounds)" in lines[-2]
    assert "noise" not in lines[-1]
