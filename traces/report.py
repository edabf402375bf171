"""What `traces.analyze` reports: its config (`AnalyzeConfig`) and results (`Report`, one
`DeviceReport` per device, one `StreamReport` per stream), with their JSON and table forms.

Apart from the analysis so that readers of a report (the timeline) need not import it.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from traces.alignment import CaptureWindows
from traces.classify import ClassifyConfig
from traces.idle import IdleReport
from traces.intervals import Span

DEFAULT_STEP_PATTERN = r"^(ProfilerStep#\d+|step/\d+)$"


@dataclass(frozen=True, kw_only=True)
class AnalyzeConfig:
    """How ``analyze`` classifies kernels and picks each device's window."""

    classify: ClassifyConfig = field(default_factory=ClassifyConfig)
    """Comm name patterns."""
    step_pattern: str | None = DEFAULT_STEP_PATTERN
    """Regex (full label name) of step labels that bound the window; None: whole trace."""

    def __post_init__(self) -> None:
        if self.step_pattern is not None:
            try:
                re.compile(self.step_pattern)
            except re.error as exc:
                raise ValueError(f"step_pattern {self.step_pattern!r} is not a valid regex: {exc}") from exc


@dataclass(frozen=True, kw_only=True)
class StreamReport:
    """One stream of one device."""

    busy_us: float
    compute_us: float
    comm_us: float
    num_kernels: int


@dataclass(frozen=True, kw_only=True)
class DeviceReport:
    """The overlap numbers of one device (microseconds)."""

    device: int
    window: Span
    window_source: str
    """``gpu step labels``, ``cpu step labels`` (kernels launched inside them) or ``kernels``."""
    wall_us: float
    compute_busy_us: float
    comm_us: float
    comm_overlapped_us: float
    comm_exposed_us: float
    overlap_fraction: float
    copy_us: float
    num_kernels: int
    streams: dict[int, StreamReport]
    phases: dict[str, dict[str, float]]
    phase_source: str
    """``device`` (device-side labels), ``cpu`` (CPU-side labels) or ``none``."""
    exposed_comm: list[Span]
    """Where comm ran with no compute beside it (for the timeline)."""
    peer_waits: list[Span]
    """Where the step's thread was blocked on a collective until it completed, idle or
    inside the collective's op: waiting for a peer (CPU traces; `traces.waits`)."""
    idle: IdleReport | None
    """The compute stream's idle time by cause (`traces.idle`); None without compute."""

    def to_json(self) -> dict[str, Any]:
        """JSON-ready numbers (rounded to 1 ns)."""
        r = lambda x: round(x, 3)  # noqa: E731
        return {
            "wall_us": r(self.wall_us),
            "compute_busy_us": r(self.compute_busy_us),
            "comm_us": r(self.comm_us),
            "comm_overlapped_us": r(self.comm_overlapped_us),
            "comm_exposed_us": r(self.comm_exposed_us),
            "overlap_fraction": round(self.overlap_fraction, 4),
            "copy_us": r(self.copy_us),
            "peer_wait_us": r(sum(s.length for s in self.peer_waits)),
            "num_kernels": self.num_kernels,
            "window_source": self.window_source,
            "window_us": [r(self.window.start), r(self.window.end)],
            "streams": {
                str(s): {"busy_us": r(v.busy_us), "compute_us": r(v.compute_us),
                         "comm_us": r(v.comm_us), "num_kernels": v.num_kernels}
                for s, v in sorted(self.streams.items())
            },
            "phases": {ub: {p: r(t) for p, t in sorted(ph.items())}
                       for ub, ph in sorted(self.phases.items())},
            "phase_source": self.phase_source,
            "compute_idle": None if self.idle is None else self.idle.to_json(),
        }


@dataclass(frozen=True, kw_only=True)
class Report:
    """What ``analyze`` found: one ``DeviceReport`` per device with kernels."""

    source: str
    devices: dict[int, DeviceReport]
    notes: list[str]
    config: AnalyzeConfig
    windows: CaptureWindows | None = None
    """The devices' windows and whether they agree (`traces.alignment`); None for one device."""

    @property
    def misaligned(self) -> bool:
        """The devices' windows disagree: the overlap figures count a wait for a late rank."""
        return self.windows is not None and not self.windows.aligned

    def to_json(self) -> dict[str, Any]:
        """The machine-readable report (the CLI's final JSON line)."""
        return {
            "source": self.source,
            "num_devices": len(self.devices),
            "devices": {str(d): rep.to_json() for d, rep in sorted(self.devices.items())},
            "capture_windows": None if self.windows is None else self.windows.to_json(),
            "notes": list(self.notes),
        }

    def format_table(self) -> str:
        """A table for people."""
        lines = [f"trace: {self.source}"]
        lines += [f"note: {n}" for n in self.notes]
        if not self.devices:
            lines.append("no devices with kernels")
            return "\n".join(lines)
        head = (f"{'device':>6} {'wall_us':>12} {'compute_us':>12} {'comm_us':>12} "
                f"{'overlap_us':>12} {'exposed_us':>12} {'overlap':>8} {'kernels':>8}")
        lines += [head, "-" * len(head)]
        for d, rep in sorted(self.devices.items()):
            lines.append(
                f"{d:>6} {rep.wall_us:>12.1f} {rep.compute_busy_us:>12.1f} {rep.comm_us:>12.1f} "
                f"{rep.comm_overlapped_us:>12.1f} {rep.comm_exposed_us:>12.1f} "
                f"{rep.overlap_fraction:>8.1%} {rep.num_kernels:>8}"
            )
        if self.windows is not None:
            lines += ["", "capture windows (from the earliest start):", *self.windows.format_lines()]
        for d, rep in sorted(self.devices.items()):
            lines.append(f"\ndevice {d}  (window from {rep.window_source})")
            for s, st in sorted(rep.streams.items()):
                lines.append(f"  stream {s:>6}: busy {st.busy_us:>11.1f} us  compute {st.compute_us:>11.1f}"
                             f"  comm {st.comm_us:>11.1f}  kernels {st.num_kernels}")
            if rep.phases:
                how = ("active time in us, paused time left out" if rep.phase_source == "cpu"
                       else "summed durations in us")
                lines.append(f"  phases ({rep.phase_source} labels, {how}):")
                for ub, ph in sorted(rep.phases.items()):
                    cells = "  ".join(f"{p}={t:.1f}" for p, t in sorted(ph.items()))
                    lines.append(f"    {ub}: {cells}")
            if rep.peer_waits:
                lines.append(f"  waited for a peer {sum(s.length for s in rep.peer_waits):.1f} us "
                             f"({len(rep.peer_waits)} waits: blocked on a collective until it "
                             f"completed, idle or inside its op)")
            if rep.idle is not None:
                lines += rep.idle.format_lines()
        return "\n".join(lines)
