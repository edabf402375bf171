"""Layers 1-2 (CPU): ranks that capture together start and stop together. In-process
(layer 1): `traces.capture.capture`'s `align` hook runs inside the profiler, around the
steps and outside their window; `dbo trace --profiler nsys` warms up, aligns the ranks,
starts the profiler range, aligns again, runs the steps, aligns, stops (CUDA calls
recorded, not run); `dbo trace --help` gives the nsys command that works. Spawning two
gloo ranks (layer 2, marked distributed): `dbo trace` end to end, both ranks' capture
windows agreeing."""
from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

from dbo.cli import trace_job
from dbo.cli.launch import RankContext
from dbo.cli.run_config import RunConfig
from traces.capture import capture


def test_capture_aligns_inside_the_profiler_and_outside_the_step_window(tmp_path: Path) -> None:
    calls: list[tuple[str, bool]] = []

    def align() -> None:
        calls.append(("align", torch.autograd._profiler_enabled()))
        torch.ones(64).cumsum(0)  # ops of its own, to be left out of the window

    def step() -> None:
        calls.append(("step", torch.autograd._profiler_enabled()))
        torch.ones(64).sum()

    captured = capture(step, tmp_path, steps=2, align=align)
    assert calls == [("align", True), ("step", True), ("step", True), ("align", True)]
    names = {k.name for k in captured.trace.kernels}
    assert "aten::cumsum" in names  # recorded, but outside the steps' window:
    window = next(iter(captured.report.devices.values())).window
    steps = [lb for lb in captured.trace.labels if lb.name.startswith("step/")]
    assert window.start >= min(lb.start_us for lb in steps)
    assert window.end <= max(lb.end_us for lb in steps)
    assert not any(k.name == "aten::cumsum" and window.start <= k.start_us < window.end
                   for k in captured.trace.kernels)
    # A rank that keeps no trace still takes part in the alignment (a collective).
    calls.clear()
    assert capture(step, tmp_path, steps=1, align=align, keep=False) is None
    assert [c for c, _ in calls] == ["align", "step", "align"]


def test_nsys_steps_align_the_ranks_around_the_profiler_range(
        monkeypatch: pytest.MonkeyPatch) -> None:
    events: list[str] = []

    @contextlib.contextmanager
    def label(name: str, **_: Any) -> Iterator[None]:
        events.append(name)
        yield

    monkeypatch.setattr(trace_job, "align_ranks", lambda ctx: events.append("align"))
    monkeypatch.setattr(trace_job, "label_range", label)
    monkeypatch.setattr(torch.cuda.profiler, "start", lambda: events.append("start"))
    monkeypatch.setattr(torch.cuda.profiler, "stop", lambda: events.append("stop"))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    ctx = RankContext(rank=0, world_size=2, device=torch.device("cpu"), backend="gloo")
    job = RunConfig(steps=2, warmup=trace_job.DEFAULTS.warmup, profiler="nsys")
    text = trace_job.nsys_steps(ctx, job, lambda: events.append("run"))
    warm = ["run"] * trace_job.DEFAULTS.warmup
    assert events == [*warm, "align", "start", "align", "step/0", "run", "step/1", "run",
                      "align", "stop"]
    assert "--capture-range-end=stop" in text


def test_trace_warms_up_enough_and_its_help_gives_the_nsys_command(
        capsys: pytest.CaptureFixture[str]) -> None:
    from dbo import cli

    # One warm-up step left a rank of a 2x H200 capture entering it 3.2 s before the
    # other (still compiling and tuning); three did not.
    assert trace_job.DEFAULTS.warmup >= 3
    with pytest.raises(SystemExit):
        cli.main(["trace", "--help"])
    out = capsys.readouterr().out
    entry = " ".join(out.split("\n  --warmup ", 1)[1].split("\n  -", 1)[0].split())
    assert entry.endswith(f"(default: {trace_job.DEFAULTS.warmup})")
    command = " ".join(out.replace("\\\n", " ").split())
    assert ("nsys profile -t cuda,nvtx --capture-range=cudaProfilerApi --capture-range-end=stop "
            "-o dbo_trace torchrun --nproc_per_node=2 -m dbo.cli trace --profiler nsys") in command


@pytest.mark.distributed
def test_dbo_trace_ranks_capture_windows_agree(tmp_path: Path, capfd: pytest.CaptureFixture[str],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Two gloo ranks, two steps: before the capture each rank warms up, then they meet
    at a barrier, so their windows agree (within traces.alignment.ALIGN_TOLERANCE of the
    shorter one). Unaligned, the rank whose profiler started first waited ~100 ms for
    the other in its first step, on a ~130-ms window. `dbo trace` through cli.main in this
    process (the ranks it spawns import torch, this process has): capfd also reads the
    ranks' output."""
    from dbo import cli

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)  # not under torchrun: it spawns its ranks
    monkeypatch.delenv("KINETO_LOG_LEVEL", raising=False)  # as a fresh shell's
    code = cli.main(["trace", "--tokens", "64", "--out", str(tmp_path)])
    stdout, stderr = capfd.readouterr()
    assert code == 0, stderr[-3000:]
    assert "USDT" not in stderr  # Kineto's profiler_start/stop lines are quieted
    lines = stdout.splitlines()
    at = lines.index("ranks' capture windows (from the earliest start):")
    assert lines[at + 1].startswith("  rank 0: +") and lines[at + 2].startswith("  rank 1: +")
    assert lines[at + 3].startswith("capture windows agree"), lines[at + 3]
    for out in (tmp_path, tmp_path / "rank1"):
        analysis = json.loads((out / "trace_analysis.json").read_text())
        (device,) = analysis["devices"].values()
        assert device["peer_wait_us"] >= 0 and device["compute_idle"]["peer_us"] >= 0
        assert (out / "trace_timeline.png").stat().st_size > 0
