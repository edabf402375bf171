"""Layer 4 (CPU, one rank): `python -m dbo.cli.bench.compiled`, one step eagerly,
compiled and replayed from CUDA graphs, DBO off and on. On CPU it times the eager and
compiled modes (dynamo alone here: `--compiler eager`, no code to generate), says the
graphed ones need GPUs, and ends with its JSON line; bad settings stop it before any
rank starts.
"""
from __future__ import annotations

import json

import pytest

from dbo.cli.bench import compiled


def test_one_rank_times_eager_and_compiled_and_skips_graphs(capsys, tmp_path):
    assert compiled.main(["--world-size", "1", "--compiler", "eager", "--layers", "1",
                          "--tokens", "16", "--requests", "2", "--warmup", "1",
                          "--iters", "2", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out.strip().splitlines()
    result = json.loads(printed[-1])
    assert json.loads((tmp_path / "compiled.json").read_text()) == result
    assert result["backend"] == "local" and result["dtype"] == "float32"
    rows = {(row["mode"], row["dbo"]): row for row in result["rows"]}
    assert set(rows) == {(mode, on) for mode in compiled.MODES for on in (False, True)}
    for on in (False, True):
        for mode in ("graph", "compile+graph"):
            assert rows[(mode, on)]["skipped"] == "CUDA graphs need GPUs"
        eager, comp = rows[("eager", on)], rows[("compile", on)]
        assert eager["split"] is on and comp["split"] is on
        assert eager["graphs"] == 0 and comp["graphs"] > 0 and comp["graph_breaks"] > 0
        # Dynamo alone runs the traced torch calls as they are: the eager step's bits.
        assert comp["max_rel_diff"] == 0.0 and eager["max_rel_diff"] == 0.0
        assert eager["ms"] > 0 and comp["ms"] > 0 and eager["speedup"] == 1.0
    assert "(CUDA graphs need GPUs)" in "\n".join(printed[:-1])


@pytest.mark.parametrize("argv, message", [
    (["--requests", "3", "--tokens", "12"], "give an even number of requests"),
    (["--requests", "4", "--tokens", "10"], "that divides the tokens"),
    (["--preset", "gpt"], "--preset='gpt': choose one of"),
    (["--iters", "0"], "--iters=0: must be an int >= 1"),
])
def test_bad_settings_stop_before_any_rank_starts(argv, message, capsys):
    with pytest.raises(SystemExit) as stop:
        compiled.main(argv)
    assert stop.value.code == 2
    assert message in capsys.readouterr().err
