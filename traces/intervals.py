"""Interval arithmetic on the time axis: union, measure, intersection, difference.

All functions take and return ``Span`` lists. ``merge`` turns any list (unsorted,
overlapping, nested, empty spans) into the canonical form: sorted, disjoint, non-empty,
with touching spans joined. The other functions expect canonical inputs (they say so) and
return canonical outputs, so their results can be fed into each other directly.
Units are whatever the caller uses; the trace code uses microseconds.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Span:
    """A half-open time interval ``[start, end)``."""

    start: float
    end: float

    @property
    def length(self) -> float:
        """``end - start`` (may be <= 0 for a degenerate span)."""
        return self.end - self.start


def merge(spans: Iterable[Span]) -> list[Span]:
    """Union of ``spans`` as a sorted list of disjoint spans.

    Overlapping, nested and touching spans are joined; spans with ``end <= start`` are
    dropped. The input may be in any order.
    """
    ordered = sorted((s for s in spans if s.end > s.start), key=lambda s: s.start)
    out: list[Span] = []
    for span in ordered:
        if out and span.start <= out[-1].end:
            if span.end > out[-1].end:
                out[-1] = Span(out[-1].start, span.end)
        else:
            out.append(span)
    return out


def measure(spans: Iterable[Span]) -> float:
    """Total length of the union of ``spans`` (each point counted once)."""
    return sum((s.length for s in merge(spans)), 0.0)


def intersect(a: list[Span], b: list[Span]) -> list[Span]:
    """Intersection of two canonical span lists (outputs of ``merge``)."""
    out: list[Span] = []
    i = j = 0
    while i < len(a) and j < len(b):
        start = max(a[i].start, b[j].start)
        end = min(a[i].end, b[j].end)
        if end > start:
            out.append(Span(start, end))
        # Advance whichever span ends first; the other may still meet the next one.
        if a[i].end <= b[j].end:
            i += 1
        else:
            j += 1
    return out


def subtract(a: list[Span], b: list[Span]) -> list[Span]:
    """The parts of canonical ``a`` not covered by canonical ``b``."""
    out: list[Span] = []
    j = 0
    for span in a:
        start = span.start
        while j < len(b) and b[j].end <= start:
            j += 1
        k = j
        while k < len(b) and b[k].start < span.end:
            if b[k].start > start:
                out.append(Span(start, b[k].start))
            start = max(start, b[k].end)
            k += 1
        if start < span.end:
            out.append(Span(start, span.end))
    return out


def total(spans: list[Span]) -> float:
    """Total length of canonical ``spans`` (no re-merge; use ``measure`` for any list)."""
    return sum((s.length for s in spans), 0.0)


def clip(spans: list[Span], window: Span) -> list[Span]:
    """Canonical ``spans`` cut to ``window``."""
    out: list[Span] = []
    for s in spans:
        if s.end <= window.start:
            continue
        if s.start >= window.end:
            break
        if s.start >= window.start and s.end <= window.end:
            out.append(s)
        else:
            out.append(Span(max(s.start, window.start), min(s.end, window.end)))
    return out
