"""Active time of CPU-side phase ranges: the part of a range during which its ubatch ran.

Both ubatches run on one OS thread. A ubatch's range stays open across its switches to
the other ubatch, so the range's extent includes the time it was paused: in a DBO step a
``dispatch_send`` range spans the other ubatch's attention, and its extent says nothing
about what the dispatch cost. The scheduler opens a ``ub<n>/run`` range each time ubatch
``n`` is switched in (``dbo.scheduler``); a range's active parts are its extent
intersected with its own ubatch's ``run`` ranges on the same thread, and the rest of the
extent is paused time.

Device-side labels (Kineto's GPU projections, NVTX ranges read from nsys) and CPU ranges
of threads without ``run`` ranges are taken whole: every part counts as active.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from traces.intervals import Span, intersect, merge, subtract
from traces.model import Label

RUN_PHASE = "run"
"""The phase name of the scheduler's per-switch-in range (``ub<n>/run``)."""


@dataclass(frozen=True, kw_only=True)
class PhasePiece:
    """One phase range split into the parts its ubatch ran and the parts it was paused."""

    label: Label
    active: list[Span]
    """Canonical spans (``traces.intervals.merge``) inside the label's extent."""
    paused: list[Span]
    """The rest of the extent: the other ubatch (or the scheduler) held the thread."""


RunKey = tuple[int | None, int]
"""(CPU thread id, ubatch) of a set of ``run`` ranges."""


def run_spans(labels: list[Label]) -> dict[RunKey, list[Span]]:
    """The merged CPU-side ``ub<n>/run`` spans of each (thread, ubatch)."""
    runs: dict[RunKey, list[Span]] = defaultdict(list)
    for lb in labels:
        if lb.device is None and lb.phase == RUN_PHASE and lb.ubatch is not None:
            runs[(lb.tid, lb.ubatch)].append(Span(lb.start_us, lb.end_us))
    return {key: merge(spans) for key, spans in runs.items()}


def split_active(label: Label, runs: dict[RunKey, list[Span]]) -> PhasePiece:
    """``label``'s active and paused parts under ``runs`` (from ``run_spans``).

    Whole extent active when the label is device-side, has no ubatch, or its thread has
    no ``run`` ranges at all (nothing says when it was paused).
    """
    extent = [Span(label.start_us, label.end_us)] if label.end_us > label.start_us else []
    thread_has_runs = any(tid == label.tid for tid, _ in runs)
    if label.device is not None or label.ubatch is None or not thread_has_runs:
        return PhasePiece(label=label, active=extent, paused=[])
    active = intersect(extent, runs.get((label.tid, label.ubatch), []))
    return PhasePiece(label=label, active=active, paused=subtract(extent, active))


def phase_pieces(labels: list[Label]) -> list[PhasePiece]:
    """Every phase label of ``labels`` except the ``run`` ranges, split by ``split_active``."""
    runs = run_spans(labels)
    return [split_active(lb, runs) for lb in labels
            if lb.phase is not None and lb.phase != RUN_PHASE]
