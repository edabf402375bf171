"""Rewrite a torch.profiler Chrome trace so that the phase ranges nest on every track.

Both ubatches' ranges are opened on one OS thread, and a range stays open while its
ubatch is paused: on the thread's track ``ub0/L1/dispatch_send`` starts, then
``ub0/run`` ends and ``ub1/run`` starts inside it, and Perfetto (which requires the
complete events of one track to nest) misdraws or drops them. The rewrite, for every
thread that has the scheduler's ``ub<n>/run`` ranges:

- on the thread's track, each phase range of ubatch ``n`` is replaced by its active
  segments (its intersection with ``ub<n>/run``, ``traces.active``), which nest inside
  the ``run`` ranges, around the ops the ubatch ran; each segment's args carry
  ``dbo_active_segment`` (``"2/3"``: the second of three);
- the whole range moves to a track of its own per ubatch, named
  ``ub<n> phase ranges (thread <tid>), paused time included``; one ubatch's ranges come
  from context managers in one greenlet, so they nest there. Its args carry
  ``dbo_thread``, the thread it was opened on.

``traces.readers`` skips the segments and reads the whole ranges back onto their thread,
so the analyzer sees the same labels before and after the rewrite.

Times are handled in integer nanoseconds (Kineto writes microseconds with three
decimals), so a segment ends exactly where its ``run`` range ends.

Usage::

    from traces.perfetto import rewrite_chrome_trace
    rewrite_chrome_trace("trace.json")     # in place; returns the number of ranges split
"""
from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

from traces.active import RUN_PHASE
from traces.intervals import Span, intersect, merge
from traces.model import parse_label_name

ACTIVE_SEGMENT_ARG = "dbo_active_segment"
THREAD_ARG = "dbo_thread"

Event = dict[str, Any]


def _ns(event: Event) -> tuple[int, int]:
    start = round(float(event["ts"]) * 1000.0)
    return start, start + round(float(event.get("dur", 0.0)) * 1000.0)


def _is_range(event: Any) -> bool:
    return (isinstance(event, dict) and event.get("ph") == "X" and "ts" in event
            and str(event.get("cat", "")).lower() == "user_annotation")


def nest_phase_ranges(events: list[Event]) -> tuple[list[Event], int]:
    """``events`` rewritten as the module docstring says, and the number of ranges moved.

    Events of threads without ``run`` ranges, and every other event, are kept as they are.
    """
    runs: dict[tuple[Any, Any, int], list[Span]] = defaultdict(list)
    for ev in events:
        if _is_range(ev):
            parts = parse_label_name(str(ev.get("name", "")))
            if parts.phase == RUN_PHASE and parts.ubatch is not None:
                start, end = _ns(ev)
                runs[(ev.get("pid"), ev.get("tid"), parts.ubatch)].append(Span(start, end))
    threads = {(pid, tid) for pid, tid, _ in runs}
    merged = {key: merge(spans) for key, spans in runs.items()}
    int_tids = [ev["tid"] for ev in events if isinstance(ev, dict) and isinstance(ev.get("tid"), int)]
    next_tid = max(int_tids, default=0) + 1
    tracks: dict[tuple[Any, Any, int], int] = {}

    out: list[Event] = []
    moved = 0
    for ev in events:
        if not _is_range(ev) or (ev.get("pid"), ev.get("tid")) not in threads:
            out.append(ev)
            continue
        parts = parse_label_name(str(ev.get("name", "")))
        done = ACTIVE_SEGMENT_ARG in (ev.get("args") or {})  # a trace rewritten before
        if parts.ubatch is None or parts.phase is None or parts.phase == RUN_PHASE or done:
            out.append(ev)
            continue
        pid, tid = ev.get("pid"), ev.get("tid")
        start, end = _ns(ev)
        segments = intersect([Span(start, end)], merged.get((pid, tid, parts.ubatch), []))
        for i, seg in enumerate(segments):
            args = dict(ev.get("args") or {}, **{ACTIVE_SEGMENT_ARG: f"{i + 1}/{len(segments)}"})
            out.append(dict(ev, ts=seg.start / 1000.0, dur=(seg.end - seg.start) / 1000.0, args=args))
        key = (pid, tid, parts.ubatch)
        if key not in tracks:
            tracks[key] = next_tid
            next_tid += 1
            out.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tracks[key],
                        "args": {"name": f"ub{parts.ubatch} phase ranges (thread {tid}), "
                                         "paused time included"}})
        out.append(dict(ev, tid=tracks[key], args=dict(ev.get("args") or {}, **{THREAD_ARG: tid})))
        moved += 1
    return out, moved


def nesting_violations(events: list[Event]) -> list[tuple[str, str]]:
    """(outer, inner) names of complete events that overlap without nesting on one
    (pid, tid) track: what Perfetto cannot draw as a stack. Empty when all nest."""
    by_track: dict[tuple[Any, Any], list[tuple[int, int, str]]] = defaultdict(list)
    for ev in events:
        if isinstance(ev, dict) and ev.get("ph") == "X" and "ts" in ev:
            start, end = _ns(ev)
            by_track[(ev.get("pid"), ev.get("tid"))].append((start, end, str(ev.get("name", ""))))
    bad: list[tuple[str, str]] = []
    for spans in by_track.values():
        stack: list[tuple[int, int, str]] = []
        for start, end, name in sorted(spans, key=lambda s: (s[0], -s[1])):
            while stack and stack[-1][1] <= start:
                stack.pop()
            if stack and end > stack[-1][1]:
                bad.append((stack[-1][2], name))
                continue
            stack.append((start, end, name))
    return bad


def rewrite_chrome_trace(path: str | Path) -> int:
    """Rewrite the Chrome trace at ``path`` in place (``nest_phase_ranges``); returns the
    number of ranges moved to per-ubatch tracks (0: the file is left untouched)."""
    path = Path(path)
    data = json.loads(path.read_text(encoding="utf-8"))
    events = data.get("traceEvents") if isinstance(data, dict) else data
    if not isinstance(events, list):
        raise ValueError(f"{path}: no 'traceEvents' list; is this a torch.profiler Chrome trace?")
    rewritten, moved = nest_phase_ranges(events)
    if moved:
        if isinstance(data, dict):
            data["traceEvents"] = rewritten
        else:
            data = rewritten
        path.write_text(json.dumps(data), encoding="utf-8")
    return moved
