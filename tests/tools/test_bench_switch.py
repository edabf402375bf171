"""Layer 1 (CPU): `dbo bench-switch` runs and reports its fields (no timing asserted:
speed targets live in BENCHMARKS.md, not in tests)."""
from __future__ import annotations

import json

from dbo.cli.bench_switch import main, time_greenlet, time_greenlet_floor


def test_bench_switch_prints_table_and_json_line(capsys):
    assert main(["--yields", "200", "--thread-yields", "50", "--repeats", "2"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[0].startswith("method")
    line = json.loads(out[-1])
    for key in ("greenlet_us_per_yield", "greenlet_us_per_yield_min",
                "greenlet_floor_us_per_yield", "thread_us_per_yield", "ratio"):
        assert line[key] > 0


def test_greenlet_timing_runs_both_variants():
    assert time_greenlet(10) > 0 and time_greenlet(10, with_streams=False) > 0
    assert time_greenlet_floor(10) >= 0


def test_bad_arguments_exit_with_usage_error(capsys):
    import pytest
    with pytest.raises(SystemExit) as info:
        main(["--yields", "1"])
    assert info.value.code == 2
