"""Layer 1 (CPU, one process): the ceiling probe's replayed results tolerate a row or two
of routing drift and nothing else. GEMMs run with fewer SMs (the probe's `both` step)
can round differently, move a token's top-k choice and so one rank's send rows; the
replay then feeds the recorded rows that fit (zeros after them) and counts the call,
while a drift beyond `ROW_DRIFT_SHARE`, another width or another collective still
raises. No communication happens: the replay never calls the real collective.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dbo.cli.bench.ceiling import (ROW_DRIFT_MIN, CommRecording, RecordedCollective,
                                   replayed_results)


def _recording(rows: int) -> CommRecording:
    result = torch.arange(rows * 4, dtype=torch.float32).view(rows, 4)
    op = RecordedCollective("all_to_all_single", dist.all_to_all_single, {}, {}, result)
    return CommRecording(segments=[[op]])


def _replay(recording: CommRecording, out: torch.Tensor):
    with replayed_results(recording) as drift:
        dist.all_to_all_single(out, torch.empty(1))
    return drift


def test_same_shape_copies_the_recorded_result() -> None:
    out = torch.full((100, 4), -1.0)
    drift = _replay(_recording(100), out)
    assert torch.equal(out, _recording(100).segments[0][0].result)
    assert drift.calls == 0 and drift.note() == ""


@pytest.mark.parametrize("rows", [99, 101, 100 + ROW_DRIFT_MIN])
def test_a_few_rows_of_drift_get_the_recorded_rows_that_fit(rows: int) -> None:
    recorded = _recording(100).segments[0][0].result
    out = torch.full((rows, 4), -1.0)
    drift = _replay(_recording(100), out)
    n = min(rows, 100)
    assert torch.equal(out[:n], recorded[:n]) and not out[n:].any()
    assert drift.calls == 1 and drift.max_rows == abs(rows - 100)
    assert "differed from the recording by up to" in drift.note()


@pytest.mark.parametrize("shape", [(100 + ROW_DRIFT_MIN + 1, 4), (60, 4), (100, 5)])
def test_other_differences_still_raise(shape: tuple[int, int]) -> None:
    with pytest.raises(RuntimeError, match="diverged from the recording"):
        _replay(_recording(100), torch.zeros(shape))


def test_another_collective_still_raises() -> None:
    with pytest.raises(RuntimeError, match="diverged from the recording"):
        with replayed_results(_recording(100)):
            dist.all_reduce(torch.zeros(100, 4))
