"""Layer 1 (CPU): real torch.profiler traces from a 2-GPU run, committed under
traces/data/, re-analyzed: the analyzer must reproduce the recorded metrics, and the
main ones are re-derived here from the raw Chrome JSON with a separate, plain method
(kernel events inside the GPU step label, unions by sort-and-sweep)."""
from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from traces.analyze import analyze
from traces.readers import read_trace

DATA = Path(__file__).resolve().parents[2] / "traces" / "data"
EXPECTED = json.loads((DATA / "expected_metrics.json").read_text())["traces"]


def union_us(spans: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for s, e in sorted(spans):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def raw_metrics(path: Path) -> dict[str, float]:
    events = json.loads(gzip.open(path).read())["traceEvents"]
    step = next(e for e in events
                if e.get("cat") == "gpu_user_annotation" and e["name"].startswith("step/"))
    lo, hi = step["ts"], step["ts"] + step["dur"]
    comm, compute = [], []
    for e in events:
        if e.get("cat") != "kernel" or e.get("ph") != "X":
            continue
        s, t = max(e["ts"], lo), min(e["ts"] + e["dur"], hi)
        if t <= s:
            continue
        (comm if "nccl" in e["name"].lower() else compute).append((s, t))
    both = union_us(comm) + union_us(compute) - union_us(comm + compute)
    return {"comm_us": union_us(comm), "compute_busy_us": union_us(compute),
            "comm_overlapped_us": both}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_committed_trace_reproduces_recorded_metrics(name):
    report = analyze(read_trace(DATA / name)).to_json()
    assert list(report["devices"]) == ["0"]
    dev, want = report["devices"]["0"], EXPECTED[name]
    for key in ("wall_us", "compute_busy_us", "comm_us", "comm_overlapped_us",
                "comm_exposed_us", "overlap_fraction", "num_kernels"):
        assert dev[key] == pytest.approx(want[key], abs=0.01), key
    assert sorted(dev["phases"]) == want["ubatches"]
    assert dev["comm_exposed_us"] == pytest.approx(dev["comm_us"] - dev["comm_overlapped_us"],
                                                   abs=0.01)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_committed_trace_metrics_rederived_from_raw_json(name):
    raw, want = raw_metrics(DATA / name), EXPECTED[name]
    for key, value in raw.items():
        assert value == pytest.approx(want[key], abs=1.0), key


def test_dbo_on_trace_overlaps_comm_and_off_does_not():
    on = EXPECTED["h200x2_a2a_T4096_dbo-on.json.gz"]
    off = EXPECTED["h200x2_a2a_T4096_dbo-off.json.gz"]
    assert off["comm_overlapped_us"] == 0.0 and on["overlap_fraction"] > 0.5


@pytest.mark.parametrize("expected", sorted(DATA.glob("*.json")), ids=lambda p: p.name)
def test_committed_expectations_name_the_test_that_reads_them(expected: Path) -> None:
    """Each expectation file's "about" names, by its path in the repository, a test file
    that exists and reads that expectation file."""
    import re

    about = json.loads(expected.read_text())["about"]
    named = re.findall(r"tests/[\w/]+\.py", about)
    assert named, about
    root = DATA.parents[1]
    for path in named:
        assert (root / path).is_file(), path
        assert expected.name in (root / path).read_text(), (path, expected.name)
