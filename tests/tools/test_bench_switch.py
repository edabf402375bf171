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


def test_counts_are_bounded_with_how_long_they_would_take(capsys, monkeypatch):
    # Refused before any measurement: one that ran would fail the test.
    import pytest

    import dbo.cli.bench_switch as bench_switch
    from dbo.cli.bench_switch import MAX_REPEATS, MAX_THREAD_YIELDS, MAX_YIELDS, check_bounds

    monkeypatch.setattr(bench_switch, "time_greenlet", lambda *a, **k: pytest.fail("ran"))
    for argv, message in (
            (["--yields", "1e11"], "--yields=100000000000: at most 10000000: three greenlet "
                                   "measurements per repeat of 2 x N hand-offs at ~1 us each "
                                   "(this run would take about 35 days)"),
            (["--thread-yields", str(MAX_THREAD_YIELDS + 1)], "--thread-yields=1000001: at "
                                                              "most 1000000"),
            (["--repeats", "1000"], "--repeats=1000: at most 100: the medians settle"),
            (["--yields", "1.5"], "argument --yields: '1.5': give a whole number")):
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 2
        err = capsys.readouterr().err
        assert err.startswith(f"dbo bench-switch: {message}") and err.count("\n") == 1, err
    check_bounds(MAX_YIELDS, MAX_THREAD_YIELDS, MAX_REPEATS)  # the bounds themselves pass
