"""Draw a trace as a timeline PNG: one row per (device, stream), coloured by ubatch.

Time runs from the start of the step (the analyzer's window: the step labels, else the
first kernel), in ms or us. The picture shows the step's active part of that window
(``active_view``): idle time before the first kernel and after the last one is cropped,
and so is a wait for a peer before the ubatches' first phase (a rank that entered the
step early waits in its first collective, the vote) or after their last one; the title
says what was cropped. Per device (``GPU 0``, or ``CPU pid N`` for a trace of CPU
ops), top to bottom: one phase row per ubatch, a red row where comm is exposed (no
compute running beside it), then one row per stream (a thread, for CPU ops) named by its
role: what it mostly ran (compute, comm) and for which ubatches. CPU-side labels on a GPU
trace are drawn on their own CPU clock and say so.

A phase bar is solid where its ubatch ran and hatched where it was paused (the other
ubatch held the thread; ``traces.active``), so a ``dispatch_send`` that stayed open
across the other ubatch's attention does not read as long work. The scheduler's ``run``
ranges are not drawn as phases. A phase's name is written near the middle of its widest
solid part when it fits inside the phase's extent without overlapping a name already
written on the row.

Kernels are coloured by the ubatch whose label encloses them (grey when unknown); comm
kernels are hatched and outlined; copies are pale. On a CPU trace, where the step's
thread sat blocked on a collective until it completed (`traces.waits`), its row shows a
grey cross-hatched "waiting for a peer" bar: neither compute nor comm. Spans narrower than about a pixel are
widened to one pixel so they stay visible.

Needs matplotlib (``pip install dbo-runtime[plot]``). Uses the Agg canvas directly, so it
never changes pyplot's backend.

Usage::

    from traces.readers import read_trace
    from traces.timeline import draw_timeline
    trace = read_trace("trace.json")
    draw_timeline(trace, "timeline.png", report=analyze(trace), title="DBO on, 2 GPUs")
    fig = build_timeline(trace, report=analyze(trace))   # the matplotlib Figure, not saved
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from traces.active import RUN_PHASE, phase_pieces
from traces.alignment import format_us
from traces.classify import Classifier, Kind, kernel_ubatches
from traces.intervals import Span, clip, merge, subtract, total
from traces.model import Label, Trace
from traces.report import Report

UBATCH_COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd")
UNKNOWN_COLOR = "#9e9e9e"
EXPOSED_COLOR = "#d62728"
PEER_WAIT_COLOR = "#bdbdbd"
CROP_NOTE_SHARE = 0.01
"""The title names a crop that removes at least this share of the windows."""
MAX_PHASE_TEXTS = 300
ROLE_MIN_SHARE = 0.05
"""A stream is named for a kind of work (compute, comm) that fills this share of its busy time."""
FIG_WIDTH_IN = 16.0
DPI = 110


@dataclass(frozen=True, kw_only=True)
class _Row:
    """One horizontal row of the picture."""

    label: str
    kind: str
    """``phase``, ``exposed`` or ``stream``."""


def _import_matplotlib() -> tuple[Any, Any, Any]:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: PLC0415
        from matplotlib.figure import Figure  # noqa: PLC0415
        from matplotlib.patches import Patch  # noqa: PLC0415
    except ImportError as exc:
        raise ImportError(
            "draw_timeline needs matplotlib: pip install dbo-runtime[plot] (or pip install matplotlib)"
        ) from exc
    return Figure, FigureCanvasAgg, Patch


def _ubatch_color(ubatch: int | None) -> str:
    return UNKNOWN_COLOR if ubatch is None else UBATCH_COLORS[ubatch % len(UBATCH_COLORS)]


def _coalesce(spans: list[tuple[float, float]], gap: float) -> list[tuple[float, float]]:
    """(x, width) bars joined where they overlap or lie less than ``gap`` apart: the
    picture is the same at this resolution, with far fewer rectangles to draw."""
    out: list[tuple[float, float]] = []
    for start, width in sorted(spans):
        if out and start <= out[-1][0] + out[-1][1] + gap:
            last_start, last_width = out[-1]
            out[-1] = (last_start, max(last_width, start + width - last_start))
        else:
            out.append((start, width))
    return out


def _device_phase_labels(trace: Trace, device: int) -> tuple[list[Label], bool]:
    """The phase labels drawn for ``device`` (``run`` ranges included, for the active
    time) and whether they are CPU-side."""
    own = [lb for lb in trace.labels if lb.phase is not None and lb.device == device]
    if own:
        return own, False
    return [lb for lb in trace.labels if lb.phase is not None and lb.device is None], True


@dataclass(frozen=True, kw_only=True)
class PhaseBar:
    """What the timeline draws for one phase label name."""

    name: str
    ubatch: int | None
    text: str
    """``L3 experts`` (``experts`` without a layer)."""
    active: list[Span]
    """Where its ubatch ran it (solid)."""
    paused: list[Span]
    """Where it was open but its ubatch was paused (hatched)."""


def phase_bars(labels: list[Label]) -> list[PhaseBar]:
    """One bar per phase label name of ``labels`` (not the ``run`` ranges): the pieces
    of one range that Kineto split over streams, or repeated names, are merged."""
    active: dict[str, list[Span]] = defaultdict(list)
    paused: dict[str, list[Span]] = defaultdict(list)
    first: dict[str, Label] = {}
    for piece in phase_pieces(labels):
        name = piece.label.name
        first.setdefault(name, piece.label)
        active[name] += piece.active
        paused[name] += piece.paused
    bars = []
    for name, lb in first.items():
        solid = merge(active[name])
        text = lb.phase if lb.layer is None else f"L{lb.layer} {lb.phase}"
        bars.append(PhaseBar(name=name, ubatch=lb.ubatch, text=text or name, active=solid,
                             paused=subtract(merge(paused[name]), solid)))
    return bars


@dataclass(frozen=True, kw_only=True)
class ActiveView:
    """The part of the devices' windows a timeline shows, and what it left out (us)."""

    view: Span
    windows: Span
    """From the earliest window start to the latest window end."""
    peer_wait_us: float
    """Of the cropped time, the waits for a peer (before the first phase, after the last)."""

    @property
    def cropped_before_us(self) -> float:
        return self.view.start - self.windows.start

    @property
    def cropped_after_us(self) -> float:
        return self.windows.end - self.view.end

    def note(self) -> str | None:
        """``idle cropped: 119.2 ms before the view, 0 us after it, 115.0 ms of it waiting
        for a peer; ...``, or None when the crop is under ``CROP_NOTE_SHARE`` of the
        windows."""
        cropped = self.cropped_before_us + self.cropped_after_us
        if cropped < CROP_NOTE_SHARE * self.windows.length:
            return None
        waited = (f", {format_us(self.peer_wait_us)} of it waiting for a peer"
                  if self.peer_wait_us > 0 else "")
        return (f"idle cropped: {format_us(self.cropped_before_us)} before the view, "
                f"{format_us(self.cropped_after_us)} after it{waited}; the step's window is "
                f"{format_us(self.windows.length)}")


def _extent(spans: list[Span]) -> Span:
    """From the first of canonical ``spans`` to the end of the last."""
    return Span(spans[0].start, spans[-1].end)


def _device_view(trace: Trace, report: Report, device: int) -> tuple[Span, list[Span]]:
    """(the active part of ``device``'s window, the peer waits before and after it)."""
    dev = report.devices[device]
    window = dev.window
    spans = merge(Span(max(k.start_us, window.start), min(k.end_us, window.end))
                  for k in trace.kernels if k.device == device
                  and k.end_us > window.start and k.start_us < window.end)
    if not spans:
        return window, []
    labels, _ = _device_phase_labels(trace, device)
    phases = [lb for lb in labels if lb.end_us > window.start and lb.start_us < window.end]
    if not phases:  # nothing says where the ubatches' work begins: crop the edges only
        return _extent(spans), []
    first = min(lb.start_us for lb in phases)
    last = max(lb.end_us for lb in phases)
    lead = [w for w in dev.peer_waits if w.end <= first]
    trail = [w for w in dev.peer_waits if w.start >= last]
    after = max((w.end for w in lead), default=window.start)
    before = min((w.start for w in trail), default=window.end)
    # The work between the leading and the trailing waits, from its first kernel to its last.
    inside = [s for s in spans if s.end > after and s.start < before]
    if not inside:
        return window, []
    view = _extent(inside)
    return Span(max(view.start, after), min(view.end, before)), lead + trail


def active_view(trace: Trace, report: Report) -> ActiveView | None:
    """The span the timeline shows by default: over the devices, from the earliest start of
    their active parts to the latest end (see the module doc); None without devices."""
    if not report.devices:
        return None
    parts = {d: _device_view(trace, report, d) for d in report.devices}
    windows = Span(min(r.window.start for r in report.devices.values()),
                   max(r.window.end for r in report.devices.values()))
    view = Span(min(v.start for v, _ in parts.values()), max(v.end for v, _ in parts.values()))
    waits = merge(w for _, ws in parts.values() for w in ws)
    return ActiveView(view=view, windows=windows, peer_wait_us=total(subtract(waits, [view])))


def _is_cpu_device(trace: Trace, device: int) -> bool:
    return all(k.category == "cpu_op" for k in trace.kernels if k.device == device)


def _stream_role(report: Report, device: int, stream: int, ubatches: set[int | None]) -> str:
    """``compute, ub0+ub1``: the kinds of work filling the stream, and its ubatches."""
    st = report.devices[device].streams.get(stream)
    kinds = []
    if st is not None and st.busy_us > 0:
        shares = sorted(((st.compute_us, "compute"), (st.comm_us, "comm")), reverse=True)
        kinds = [kind for us, kind in shares if us >= ROLE_MIN_SHARE * st.busy_us]
    known = sorted(u for u in ubatches if u is not None)
    parts = ["+".join(kinds) or "copies"]
    if known:
        parts.append("+".join(f"ub{u}" for u in known))
    return ", ".join(parts)


def draw_timeline(
    trace: Trace,
    path: str | Path,
    *,
    report: Report,
    title: str | None = None,
    view: Span | None = None,
) -> Path:
    """Write a timeline PNG of ``trace`` to ``path`` and return the path (``build_timeline``)."""
    fig = build_timeline(trace, report=report, title=title, view=view)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return path


def build_timeline(
    trace: Trace,
    *,
    report: Report,
    title: str | None = None,
    view: Span | None = None,
) -> Any:
    """The timeline of ``trace`` as a matplotlib ``Figure`` (Agg canvas attached).

    ``report`` (``traces.analyze.analyze(trace)``) supplies the comm patterns, each
    device's window, its exposed-comm spans and its waits for a peer. Time 0 is the
    earliest device window's start. ``view`` is the x range in trace microseconds
    (default: ``active_view``, the windows' active part); narrow it to zoom into one
    layer of a long trace.
    """
    Figure, FigureCanvasAgg, Patch = _import_matplotlib()
    classifier = Classifier(report.config.classify)
    ubatches = kernel_ubatches(trace)

    devices = sorted(report.devices)
    if devices:
        origin = min(report.devices[d].window.start for d in devices)
        window_end = max(report.devices[d].window.end for d in devices)
        sources = {report.devices[d].window_source for d in devices}
        from_what = "the step's start" if any("step" in s for s in sources) else "the first kernel"
    else:
        origin, window_end, from_what = 0.0, 1.0, "0"
    active = active_view(trace, report) if view is None else None
    if view is None:
        view = active.view if active is not None else Span(origin, window_end)
    view_start, view_end = view.start, view.end
    if view_end <= view_start:
        view_end = view_start + 1.0
    scale, unit = (1e-3, "ms") if view_end - view_start > 2000.0 else (1.0, "us")
    min_width = (view_end - view_start) * scale / 2000.0

    def x(t: float) -> float:
        return (t - origin) * scale

    stream_ubatches: dict[tuple[int, int], set[int | None]] = defaultdict(set)
    for k, ub in zip(trace.kernels, ubatches, strict=True):
        stream_ubatches[(k.device, k.stream)].add(ub)
    rows: list[_Row] = []
    row_of_stream: dict[tuple[int, int], int] = {}
    phase_rows: dict[tuple[int, int | None], int] = {}
    exposed_row: dict[int, int] = {}
    bars_of: dict[int, list[PhaseBar]] = {}
    for d in devices:
        on_cpu_device = _is_cpu_device(trace, d)
        dev_name = f"CPU pid {d}" if on_cpu_device else f"GPU {d}"
        labels, cpu_labels = _device_phase_labels(trace, d)
        bars_of[d] = phase_bars(labels)
        clock = " (CPU clock)" if cpu_labels and not on_cpu_device else ""
        for ub in sorted({b.ubatch for b in bars_of[d]}, key=lambda u: (u is None, u or 0)):
            phase_rows[(d, ub)] = len(rows)
            name = "?" if ub is None else str(ub)
            rows.append(_Row(label=f"{dev_name} ub{name} phases{clock}", kind="phase"))
        exposed_row[d] = len(rows)
        rows.append(_Row(label=f"{dev_name} exposed comm", kind="exposed"))
        for s in sorted({k.stream for k in trace.kernels if k.device == d}):
            row_of_stream[(d, s)] = len(rows)
            what = "thread" if on_cpu_device else "stream"
            role = _stream_role(report, d, s, stream_ubatches[(d, s)])
            rows.append(_Row(label=f"{dev_name} {what} {s}: {role}", kind="stream"))

    height = min(40.0, 1.6 + 0.42 * max(len(rows), 1))
    fig = Figure(figsize=(FIG_WIDTH_IN, height), dpi=DPI)
    canvas = FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)

    # Kernels, grouped so each (row, colour, kind) is one broken_barh call.
    groups: dict[tuple[int, str, Kind], list[tuple[float, float]]] = defaultdict(list)
    for k, ub in zip(trace.kernels, ubatches, strict=True):
        row = row_of_stream.get((k.device, k.stream))
        if row is None or k.end_us < view_start or k.start_us > view_end:
            continue
        width = max((k.end_us - k.start_us) * scale, min_width)
        groups[(row, _ubatch_color(ub), classifier.kind(k))].append((x(k.start_us), width))
    for (row, color, kind), raw in groups.items():
        spans = _coalesce(raw, min_width)
        if kind is Kind.COMM:
            ax.broken_barh(spans, (row - 0.38, 0.76), facecolors=color, edgecolors="black",
                           linewidth=0.6, hatch="////")
        elif kind is Kind.COPY:
            ax.broken_barh(spans, (row - 0.3, 0.6), facecolors=color, alpha=0.45, linewidth=0)
        else:
            ax.broken_barh(spans, (row - 0.38, 0.76), facecolors=color, linewidth=0)

    # Phase bars: solid where active, hatched where paused.
    solid: dict[tuple[int, str], list[tuple[float, float]]] = defaultdict(list)
    hatched: dict[tuple[int, str], list[tuple[float, float]]] = defaultdict(list)
    texts: dict[int, list[tuple[float, float, float, str]]] = defaultdict(list)
    for d in devices:
        for bar in bars_of[d]:
            row, color = phase_rows[(d, bar.ubatch)], _ubatch_color(bar.ubatch)
            for span in bar.active:
                solid[(row, color)].append((x(span.start), max(span.length * scale, min_width)))
            for span in bar.paused:
                hatched[(row, color)].append((x(span.start), span.length * scale))
            if bar.active:
                widest = max(bar.active, key=lambda s: s.length)
                extent = merge(bar.active + bar.paused)
                texts[row].append((x((widest.start + widest.end) / 2), x(extent[0].start),
                                   x(extent[-1].end), bar.text))
        dev = report.devices[d]
        # A comm op blocked on its peer is drawn as the wait, not as exposed comm.
        exposed = subtract(dev.exposed_comm, dev.peer_waits)
        spans = _coalesce([(x(s.start), max(s.length * scale, min_width)) for s in exposed],
                          min_width)
        if spans:
            ax.broken_barh(spans, (exposed_row[d] - 0.3, 0.6), facecolors=EXPOSED_COLOR,
                           linewidth=0, gid=f"exposed-{exposed_row[d]}")
        wait_row = None if dev.idle is None else row_of_stream.get((d, dev.idle.stream))
        if dev.peer_waits and wait_row is not None:
            ax.broken_barh([(x(s.start), s.length * scale) for s in dev.peer_waits],
                           (wait_row - 0.38, 0.76), facecolors=PEER_WAIT_COLOR, edgecolors="grey",
                           hatch="xxx", linewidth=0.4, zorder=3, gid=f"peer-wait-{wait_row}")
            shown = total(clip(dev.peer_waits, Span(view_start, view_end)))
            ax.text(1.0, wait_row, f"  waited for a peer {shown:.0f} us",
                    transform=ax.get_yaxis_transform(), va="center", fontsize=8, color="dimgrey")
        waited = dev.comm_exposed_us - total(exposed)
        ax.text(1.0, exposed_row[d], f"  exposed {dev.comm_exposed_us:.0f} us / comm {dev.comm_us:.0f} us"
                + (f"\n  ({waited:.0f} us of it waiting for a peer)" if waited > 0 else ""),
                transform=ax.get_yaxis_transform(), va="center", fontsize=8, color=EXPOSED_COLOR)
    for (row, color), spans in hatched.items():
        ax.broken_barh(spans, (row - 0.2, 0.4), facecolors="none", edgecolors=color, hatch="....",
                       linewidth=0.4, alpha=0.6, gid=f"phase-paused-{row}")
    for (row, color), spans in solid.items():
        ax.broken_barh(spans, (row - 0.35, 0.7), facecolors=color, alpha=0.55, edgecolors=color,
                       linewidth=0.8, gid=f"phase-active-{row}")

    for i, row in enumerate(rows):
        if row.kind == "stream" and i + 1 < len(rows) and rows[i + 1].kind != "stream":
            ax.axhline(i + 0.5, color="black", linewidth=0.8)
    ax.set_yticks(range(len(rows)), [r.label for r in rows], fontsize=8)
    ax.set_ylim(max(len(rows), 1) - 0.5, -0.5)
    pad = 0.01 * (view_end - view_start) * scale
    ax.set_xlim(x(view_start) - pad, x(view_end) + pad)
    ax.set_xlabel(f"time ({unit}) from {from_what}")
    ax.grid(axis="x", alpha=0.3)
    legend = [Patch(facecolor=UBATCH_COLORS[0], label="ubatch 0"),
              Patch(facecolor=UBATCH_COLORS[1], label="ubatch 1"),
              Patch(facecolor=UNKNOWN_COLOR, label="ubatch unknown"),
              Patch(facecolor="white", edgecolor="black", hatch="////", label="comm kernel"),
              Patch(facecolor="white", edgecolor="grey", hatch="....", label="phase open, ubatch paused"),
              Patch(facecolor=EXPOSED_COLOR, label="exposed comm")]
    if any(report.devices[d].peer_waits for d in devices):
        legend.append(Patch(facecolor=PEER_WAIT_COLOR, edgecolor="grey", hatch="xxx",
                            label="waiting for a peer (blocked on a collective)"))
    ax.legend(handles=legend, loc="upper left", bbox_to_anchor=(0.0, 1.0 + 0.9 / height),
              ncol=len(legend), fontsize=8, frameon=False)
    heading = title or Path(trace.source).name
    if not devices:
        heading += " (no devices with kernels)"
    note = active.note() if active is not None else None
    if note:
        heading += f"\n{note}"
    fig.suptitle(heading, fontsize=10, x=0.01, ha="left")
    fig.tight_layout()
    _write_phase_names(ax, canvas.get_renderer(), texts)
    return fig


def _write_phase_names(ax: Any, renderer: Any,
                       texts: dict[int, list[tuple[float, float, float, str]]]) -> None:
    """Write each (centre, lo, hi, name) near its centre, left to right per row: moved as
    little as needed to lie inside [lo, hi] (the phase's extent) and clear of the name
    before it, as the renderer measures it once the layout is final; a name that cannot
    stays unwritten."""
    written = 0
    for row, candidates in texts.items():
        right_px = float("-inf")
        for centre, lo, hi, name in sorted(candidates):
            if written >= MAX_PHASE_TEXTS:
                return
            text = ax.text(centre, row, name, ha="center", va="center", fontsize=7, clip_on=True)
            half = text.get_window_extent(renderer).width / 2
            centre_px, y_px = ax.transData.transform((centre, row))
            lo_px = max(ax.transData.transform((lo, row))[0], right_px + 2)
            hi_px = ax.transData.transform((hi, row))[0]
            centre_px = min(max(centre_px, lo_px + half), hi_px - half)
            if centre_px - half < lo_px:
                text.remove()
                continue
            text.set_x(ax.transData.inverted().transform((centre_px, y_px))[0])
            right_px = centre_px + half
            written += 1
