"""Draw a trace as a timeline PNG: one row per (device, stream), coloured by ubatch.

Per device, top to bottom: one phase band per ubatch (the phase labels; CPU-side labels
are drawn on their own CPU clock and say so), a red band where comm is exposed (no compute
running beside it), then one row per stream. Kernels are coloured by the ubatch whose
label encloses them (grey when unknown); comm kernels are hatched and outlined; copies are
pale. Spans narrower than about a pixel are widened to one pixel so they stay visible.

Needs matplotlib (``pip install dbo-runtime[plot]``). Uses the Agg canvas directly, so it
never changes pyplot's backend.

Usage::

    from traces.readers import read_trace
    from traces.timeline import draw_timeline
    draw_timeline(read_trace("trace.json"), "timeline.png", title="DBO on, 2 GPUs")
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from traces.analyze import Report, analyze, label_spans
from traces.classify import Classifier, Kind, kernel_ubatches
from traces.intervals import Span
from traces.model import Label, Trace, parse_label_name

UBATCH_COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd")
UNKNOWN_COLOR = "#9e9e9e"
EXPOSED_COLOR = "#d62728"
MAX_PHASE_TEXTS = 300
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
    """The phase labels drawn for ``device`` and whether they are CPU-side."""
    own = [lb for lb in trace.labels if lb.phase is not None and lb.device == device]
    if own:
        return own, False
    return [lb for lb in trace.labels if lb.phase is not None and lb.device is None], True


def draw_timeline(
    trace: Trace,
    path: str | Path,
    *,
    report: Report | None = None,
    title: str | None = None,
    view: Span | None = None,
) -> Path:
    """Write a timeline PNG of ``trace`` to ``path`` and return the path.

    ``report`` (from ``analyze``) supplies the comm patterns, each device's window and its
    exposed-comm spans; it is computed with defaults when None. ``view`` is the x range
    in trace microseconds (default: from the earliest device window start to the latest
    end); narrow it to zoom into one layer of a long trace.
    """
    Figure, FigureCanvasAgg, Patch = _import_matplotlib()
    report = report or analyze(trace)
    classifier = Classifier(report.config.classify)
    path = Path(path)
    ubatches = kernel_ubatches(trace)

    devices = sorted(report.devices)
    if view is not None:
        view_start, view_end = view.start, view.end
    elif devices:
        view_start = min(report.devices[d].window.start for d in devices)
        view_end = max(report.devices[d].window.end for d in devices)
    else:
        view_start, view_end = 0.0, 1.0
    if view_end <= view_start:
        view_end = view_start + 1.0
    scale, unit = (1e-3, "ms") if view_end - view_start > 2000.0 else (1.0, "us")
    min_width = (view_end - view_start) * scale / 2000.0

    def x(t: float) -> float:
        return (t - view_start) * scale

    rows: list[_Row] = []
    row_of_stream: dict[tuple[int, int], int] = {}
    phase_rows: dict[tuple[int, int | None], int] = {}
    exposed_row: dict[int, int] = {}
    phase_labels: dict[int, list[Label]] = {}
    for d in devices:
        labels, on_cpu = _device_phase_labels(trace, d)
        phase_labels[d] = labels
        clock = " (CPU clock)" if on_cpu else ""
        for ub in sorted({lb.ubatch for lb in labels}, key=lambda u: (u is None, u or 0)):
            phase_rows[(d, ub)] = len(rows)
            name = "?" if ub is None else str(ub)
            rows.append(_Row(label=f"dev {d} ub{name} phases{clock}", kind="phase"))
        exposed_row[d] = len(rows)
        rows.append(_Row(label=f"dev {d} exposed comm", kind="exposed"))
        for s in sorted({k.stream for k in trace.kernels if k.device == d}):
            row_of_stream[(d, s)] = len(rows)
            rows.append(_Row(label=f"dev {d} stream {s}", kind="stream"))

    height = min(40.0, 1.6 + 0.42 * max(len(rows), 1))
    fig = Figure(figsize=(FIG_WIDTH_IN, height), dpi=DPI)
    # Width of one 7-pt character in x units (the axes take ~80% of the figure width).
    char_width = 4.6 / (0.8 * FIG_WIDTH_IN * DPI) * (view_end - view_start) * scale
    FigureCanvasAgg(fig)
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

    # Phase bands (one range's per-stream pieces merged), named where wide enough.
    bands: dict[tuple[int, str], list[tuple[float, float]]] = defaultdict(list)
    num_texts = 0
    for d in devices:
        for name, merged in label_spans(phase_labels[d]).items():
            parts = parse_label_name(name)
            row = phase_rows[(d, parts.ubatch)]
            text = parts.phase if parts.layer is None else f"L{parts.layer} {parts.phase}"
            for span in merged:
                width = max(span.length * scale, min_width)
                bands[(row, _ubatch_color(parts.ubatch))].append((x(span.start), width))
                if width > (len(text) + 2) * char_width and num_texts < MAX_PHASE_TEXTS:
                    ax.text(x(span.start) + width / 2, row, text, ha="center", va="center",
                            fontsize=7, clip_on=True)
                    num_texts += 1
        spans = _coalesce([(x(s.start), max(s.length * scale, min_width))
                           for s in report.devices[d].exposed_comm], min_width)
        if spans:
            ax.broken_barh(spans, (exposed_row[d] - 0.3, 0.6), facecolors=EXPOSED_COLOR, linewidth=0)
        dev = report.devices[d]
        ax.text(1.0, exposed_row[d], f"  exposed {dev.comm_exposed_us:.0f} us / comm {dev.comm_us:.0f} us",
                transform=ax.get_yaxis_transform(), va="center", fontsize=8, color=EXPOSED_COLOR)

    for (row, color), spans in bands.items():
        ax.broken_barh(spans, (row - 0.35, 0.7), facecolors=color, alpha=0.35, edgecolors=color,
                       linewidth=0.8)
    for i, row in enumerate(rows):
        if row.kind == "stream" and i + 1 < len(rows) and rows[i + 1].kind != "stream":
            ax.axhline(i + 0.5, color="black", linewidth=0.8)
    ax.set_yticks(range(len(rows)), [r.label for r in rows], fontsize=8)
    ax.set_ylim(max(len(rows), 1) - 0.5, -0.5)
    ax.set_xlim(-0.01 * (view_end - view_start) * scale, 1.01 * (view_end - view_start) * scale)
    ax.set_xlabel(f"time ({unit}) from {view_start:.1f} us")
    ax.grid(axis="x", alpha=0.3)
    legend = [Patch(facecolor=UBATCH_COLORS[0], label="ubatch 0"),
              Patch(facecolor=UBATCH_COLORS[1], label="ubatch 1"),
              Patch(facecolor=UNKNOWN_COLOR, label="ubatch unknown"),
              Patch(facecolor="white", edgecolor="black", hatch="////", label="comm kernel"),
              Patch(facecolor=EXPOSED_COLOR, label="exposed comm")]
    ax.legend(handles=legend, loc="upper left", bbox_to_anchor=(0.0, 1.0 + 0.9 / height),
              ncol=len(legend), fontsize=8, frameon=False)
    heading = title or Path(trace.source).name
    if not devices:
        heading += " (no devices with kernels)"
    fig.suptitle(heading, fontsize=10, x=0.01, ha="left")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return path
