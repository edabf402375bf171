"""Whether the ranks of one capture recorded the same steps: each device's (or rank's)
window, and a flag when the windows disagree.

    windows = capture_windows({"device 0": Span(0, 52e3), "device 1": Span(-3.2e6, 52e3)})
    windows.aligned          # False: device 1 entered the capture 3.2 s early
    windows.format_lines()   # one line per window, then the verdict and the fix

Every rank of a DBO step takes part in the same collectives (the vote's all-reduce first,
then each MoE layer's dispatch and combine), so the ranks' windows of one step cover
the same stretch of time: they differ by the local work before the first collective and
after the last one, and by how long a rank's first collective waited for a later one. A
rank that entered the capture long before the others (it finished its warm-up first:
less to compile or tune, a profiler that started sooner) spends the start of its window
waiting in that first collective; its overlap and exposed comm then count the wait, and
its wall time is the wait, not the step.

The check compares the spread of the windows' starts, and of their ends, with the
shortest window (``ALIGN_TOLERANCE``). Times are microseconds on one clock: the devices
of one trace (an Nsight Systems report holds every rank of a launch), or the ranks of one
host (torch.profiler's clock is the host's monotonic clock).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from traces.intervals import Span

ALIGN_TOLERANCE = 0.25
"""The largest spread of the windows' starts (or ends), as a share of the shortest
window, that still counts as one aligned capture. Ranks that start a step together
differ at its start by a collective's latency and at its end by the local work after the
last combine: the committed 2-GPU Nsight report (traces/data), captured with no barrier
before its step, differs by 7.7% of its shorter window at the start and 1.6% at the end.
A quarter of a step is over three times that, and far below a capture that a rank entered
before the other finished its warm-up (3.2 s early on a 52-ms step: 6000%)."""

FIX = ("warm every rank up (compilation and autotuning) and align the ranks (synchronize "
       "the device, then a barrier over the group) before the capture starts and before it "
       "stops, as `dbo trace` does (raise --warmup if compilation or tuning still runs)")
"""What to do about a misaligned capture."""


def format_us(us: float) -> str:
    """``3.2 s``, ``52.0 ms`` or ``640 us``."""
    if abs(us) >= 1e6:
        return f"{us / 1e6:.1f} s"
    if abs(us) >= 1e3:
        return f"{us / 1e3:.1f} ms"
    return f"{us:.0f} us"


@dataclass(frozen=True, kw_only=True)
class CaptureWindows:
    """The windows of the devices (or ranks) of one capture and how far they disagree."""

    windows: dict[str, Span]
    """Each device's or rank's window (``device 0``, ``rank 1``), microseconds."""
    start_spread_us: float
    """Latest start minus earliest start."""
    end_spread_us: float
    """Latest end minus earliest end."""
    shortest_us: float
    """The shortest window's length."""
    tolerance: float
    """The largest spread, as a share of ``shortest_us``, that counts as aligned."""

    @property
    def aligned(self) -> bool:
        """Both spreads within ``tolerance`` of the shortest window."""
        limit = self.tolerance * self.shortest_us
        return self.start_spread_us <= limit and self.end_spread_us <= limit

    def verdict(self) -> str:
        """One line: aligned, or a misaligned capture with who started early and the fix."""
        share = max(self.start_spread_us, self.end_spread_us) / self.shortest_us \
            if self.shortest_us > 0 else float("inf")
        spreads = (f"starts {format_us(self.start_spread_us)} apart, ends "
                   f"{format_us(self.end_spread_us)} apart")
        if self.aligned:
            return (f"capture windows agree: {spreads} (within {self.tolerance:.0%} of the "
                    f"shortest window, {format_us(self.shortest_us)})")
        first = min(self.windows, key=lambda n: self.windows[n].start)
        last = max(self.windows, key=lambda n: self.windows[n].start)
        lengths = ", ".join(f"{n} {format_us(w.length)}" for n, w in self.windows.items())
        return (f"misaligned capture: {spreads}, more than {self.tolerance:.0%} of the shortest "
                f"window ({lengths}); {first} started {format_us(self.start_spread_us)} "
                f"before {last}, and a rank that enters early waits for the others inside its "
                f"window, so its overlap and exposed comm count that wait: {FIX}")

    def format_lines(self) -> list[str]:
        """One line per window (from the earliest start), then ``verdict()``."""
        origin = min(w.start for w in self.windows.values())
        lines = [f"  {name}: +{format_us(w.start - origin)} .. +{format_us(w.end - origin)} "
                 f"({format_us(w.length)})" for name, w in self.windows.items()]
        return lines + [("" if self.aligned else "WARNING: ") + self.verdict()]

    def to_json(self) -> dict[str, Any]:
        r = lambda x: round(x, 3)  # noqa: E731
        return {"windows_us": {n: [r(w.start), r(w.end)] for n, w in self.windows.items()},
                "start_spread_us": r(self.start_spread_us), "end_spread_us": r(self.end_spread_us),
                "shortest_us": r(self.shortest_us), "tolerance": self.tolerance,
                "aligned": self.aligned}


def capture_windows(windows: Mapping[str, Span], *,
                    tolerance: float = ALIGN_TOLERANCE) -> CaptureWindows | None:
    """How far ``windows`` (name -> window, one clock) disagree; None for fewer than two.

    ValueError for a negative ``tolerance``.
    """
    if tolerance < 0:
        raise ValueError(f"tolerance={tolerance}: must be >= 0 (a share of the shortest window)")
    if len(windows) < 2:
        return None
    spans = list(windows.values())
    starts = [w.start for w in spans]
    ends = [w.end for w in spans]
    return CaptureWindows(windows=dict(windows), start_spread_us=max(starts) - min(starts),
                          end_spread_us=max(ends) - min(ends),
                          shortest_us=min(w.length for w in spans), tolerance=tolerance)
