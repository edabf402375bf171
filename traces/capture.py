"""Capture steps under torch.profiler with the phase labels on; analyze and draw them.

    result = capture(step_fn, out_dir, steps=2, name="trace")

writes `<name>.json` (a Chrome trace: open it in Perfetto), `<name>_analysis.json` and
`<name>_timeline.png`, and returns a `Capture` with the parsed trace and the report.
The trace is rewritten so that the ubatches' phase ranges nest (`traces.perfetto`).
Phase labels (`ub0/L3/dispatch_send`, ...) are `record_function` ranges opened through
`dbo.ranges`; each step is labelled `step/N` so the analyzer can bound its window.

Ranks that capture together pass `align` (e.g. a device sync and a barrier over the
group): it runs once the profiler has started, before the first step, and again after
the last one, outside the step labels. Without it, a rank whose profiler started sooner
enters the first step early and waits for the others inside its window
(`traces.alignment`).
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch.profiler import ProfilerActivity, profile

from dbo import TraceConfig, configure, current_config, label_range, step_name
from traces.analyze import Report, analyze
from traces.model import Label, Trace
from traces.perfetto import rewrite_chrome_trace
from traces.readers import read_chrome_trace
from traces.timeline import draw_timeline

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Capture:
    trace: Trace
    report: Report
    trace_path: Path
    analysis_path: Path
    timeline_path: Optional[Path]


def capture(step_fn: Callable[[], Any], out_dir: str | Path, *, steps: int = 1,
            name: str = "trace", title: Optional[str] = None,
            keep: bool = True, align: Optional[Callable[[], None]] = None) -> Optional[Capture]:
    """Run `step_fn` `steps` times under the profiler; write trace, analysis, timeline.

    `keep=False` runs the same steps without profiling and writes nothing (returns None):
    for ranks whose trace is not wanted but whose collectives must still match. `align`
    (every rank calls it, so it may be a collective) runs before the first step and after
    the last, inside the profiler.
    """
    if steps < 1:
        raise ValueError(f"steps={steps}: capture at least one step")
    if not keep:
        if align is not None:
            align()
        for _ in range(steps):
            step_fn()
        if align is not None:
            align()
        return None
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    previous = current_config()
    configure(TraceConfig(nvtx=previous.nvtx, record_function=True, domain=previous.domain))
    try:
        with profile(activities=activities) as prof:
            if align is not None:
                align()
            for i in range(steps):
                with label_range(step_name(i)):
                    step_fn()
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
            if align is not None:
                align()
    finally:
        configure(previous)
    trace_path = out / f"{name}.json"
    prof.export_chrome_trace(str(trace_path))
    # The two ubatches' ranges interleave on one thread; Perfetto needs them nested.
    rewrite_chrome_trace(trace_path)
    # On CPU there are no GPU kernels: the reader analyzes the host ops (one row per thread).
    trace = read_chrome_trace(trace_path)
    report = analyze(trace)
    analysis_path = out / f"{name}_analysis.json"
    analysis_path.write_text(json.dumps(report.to_json(), indent=1))
    timeline_path: Optional[Path] = out / f"{name}_timeline.png"
    try:
        draw_timeline(trace, timeline_path, report=report, title=title)
    except ImportError as exc:  # matplotlib missing: the trace and analysis still stand
        logger.warning("no timeline picture: %s", exc)
        timeline_path = None
    return Capture(trace, report, trace_path, analysis_path, timeline_path)


def phase_order(labels: list[Label], *, layer: int) -> list[tuple[int, str]]:
    """(ubatch, phase) of every CPU-side label of `layer`, in the order they started.

    CPU-side labels record when the host issued each phase, which is the schedule the
    greenlets followed (GPU-side spans would show when the work ran instead).
    """
    own = [lb for lb in labels
           if lb.layer == layer and lb.device is None and lb.ubatch is not None and lb.phase]
    own.sort(key=lambda lb: lb.start_us)
    return [(lb.ubatch, lb.phase) for lb in own]
