"""Phase scopes: the named phases of one ubatch and layer (router, dispatch_send, experts,
combine_recv, attention, ...) that every MoE phase and the reference model open.

    with phase_scope("experts", layer=3):      # a trace range, and a note on failure
        ...

A scope is a trace range when tracing is on (`dbo.ranges`, named `ub<U>/L<L>/<phase>`),
and an exception that leaves it gets a note `[dbo] rank R, ubatch U, layer L, phase P`
(the innermost scope wins) and the attributes `dbo_rank`, `dbo_layer`, `dbo_phase`
(`dbo.failures` says what the runner adds).

Inside a graph that `torch.compile` traced, a scope is nothing: the graph's kernels are
fused across the phases, so there is no boundary to mark, and a range opened while
tracing would not run with the graph. The phases that run eagerly between graphs (the
MoE layer's dispatch and combine, `dbo.compiling`) keep theirs, and the scheduler's
`ub<n>/run` ranges still say which ubatch every kernel belongs to.
"""
from __future__ import annotations

from typing import Any, Optional

import greenlet

from dbo.compiling import compiling
from dbo.failures import add_note, this_rank
from dbo.yield_points import dbo_current_ubatch_id
from dbo.ranges import end_phase, start_phase


class phase_scope:  # noqa: N801 - used like a function: `with phase_scope(...)`
    """A named phase of one ubatch and layer: a trace range (when tracing is on) and the
    place named in the notes of an exception that leaves it."""

    __slots__ = ("name", "layer", "_handle")

    def __init__(self, name: str, *, layer: Optional[int] = None) -> None:
        self.name = name
        self.layer = layer
        self._handle: Any = None

    def __enter__(self) -> "phase_scope":
        if compiling():  # inside a compiled graph: no range (module doc)
            return self
        self._handle = start_phase(self.name, ubatch_id=dbo_current_ubatch_id(),
                                   layer=self.layer)
        return self

    def __exit__(self, exc_type: Any, exc: Optional[BaseException], tb: Any) -> None:
        if self._handle is not None:
            end_phase(self._handle)
        if exc is not None and not isinstance(exc, greenlet.GreenletExit):
            annotate_phase(exc, self.name, self.layer)


def annotate_phase(exc: BaseException, phase: str, layer: Optional[int]) -> None:
    """Name the innermost phase an exception left (outer scopes leave it as is)."""
    if getattr(exc, "dbo_phase", None) is not None:
        return
    rank = this_rank()
    try:
        exc.dbo_phase = phase  # type: ignore[attr-defined]
        exc.dbo_layer = layer  # type: ignore[attr-defined]
        exc.dbo_rank = rank  # type: ignore[attr-defined]
    except (AttributeError, TypeError):
        return
    where = [f"rank {rank}" if rank is not None else "single process",
             f"ubatch {dbo_current_ubatch_id()}"]
    if layer is not None:
        where.append(f"layer {layer}")
    where.append(f"phase {phase}")
    add_note(exc, "[dbo] " + ", ".join(where))
