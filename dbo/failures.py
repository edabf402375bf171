"""Failure context: what a failed step left behind, and where in it the error came from.

    note_collective("all_to_all_single")       # backends, right before each collective

An exception that leaves a `dbo.phases.phase_scope` gets a note `[dbo] rank R, ubatch U, layer L,
phase P` (the innermost scope wins) and the attributes `dbo_rank`, `dbo_layer`,
`dbo_phase`; the scheduler adds the ubatch (`dbo_ubatch_id`), the runner the rows of the
step that ubatch ran (`dbo_ubatch_rows`: the shapes in the message are the ubatch's,
not the ones the caller passed). The DBORunner then says
whether this rank had issued any collective of the step: if not, the process group is
intact and the next step can run; if it had, the ranks' collective sequences may now
differ (a peer may be blocked in a collective this rank will never join), and the error
says to re-create the process group. Without a process group (torch.distributed not
initialized: one process) there is no group to speak of, and none of these is said.

The collective count is per thread (a step's greenlets share their thread) and is reset
by the runner at the start of each step. Tests can also record the names in order
(`record_collectives`) to check that every rank issues the same sequence.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator, Optional, Sequence

import torch.distributed as dist

from dbo.yield_points import dbo_current_ubatch_id

_local = threading.local()


def _state() -> Any:
    if not hasattr(_local, "count"):
        _local.count = 0
        _local.log = None
    return _local


def note_collective(name: str) -> None:
    """Called by backends (and the vote) right before issuing a collective."""
    state = _state()
    state.count += 1
    if state.log is not None:
        state.log.append((name, dbo_current_ubatch_id()))


def collectives_issued() -> int:
    """Collectives this thread issued since the last `reset_collectives()`."""
    return _state().count


def reset_collectives() -> None:
    _state().count = 0


@contextlib.contextmanager
def record_collectives() -> Iterator[list[tuple[str, int]]]:
    """Inside the block, `(name, ubatch)` of every noted collective, in issue order."""
    state = _state()
    previous, state.log = state.log, []
    try:
        yield state.log
    finally:
        state.log = previous


def this_rank() -> Optional[int]:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else None


def mark_stopped_together(exc: BaseException) -> None:
    """`exc` is raised on every rank of the group alike, after the step's vote and before
    any collective of the model: the process group is intact."""
    try:
        exc.dbo_stopped_together = True  # type: ignore[attr-defined]
    except (AttributeError, TypeError):
        pass


def annotate_step_failure(exc: BaseException) -> None:
    """Say whether this rank's failure left the process group usable (see module doc)."""
    issued = collectives_issued()
    if getattr(exc, "dbo_collectives_issued", None) is not None:
        return
    try:
        exc.dbo_collectives_issued = issued  # type: ignore[attr-defined]
    except (AttributeError, TypeError):
        return
    if this_rank() is None:  # no process group: one process, no group to keep or re-create
        return
    if getattr(exc, "dbo_stopped_together", False):
        add_note(exc, "[dbo] every rank of the group stopped this step at its vote, before "
                       "any collective of the model: the process group is intact and the "
                       "next step can run")
    elif issued == 0:
        add_note(exc, "[dbo] no collective of this step had been issued on this rank: the "
                       "process group is intact, and the next step can run once every "
                       "rank skips this one alike")
    else:
        add_note(exc, f"[dbo] this rank had issued {issued} collective(s) of this step when "
                       f"it failed: the ranks' collective sequences may now differ, so "
                       f"re-create the process group (destroy_process_group, then "
                       f"init_process_group / new_group) before the next step")


def annotate_ubatch_rows(exc: BaseException, rows: Sequence[int], *,
                         contiguous: bool = True) -> None:
    """Say which rows of a split step the failed ubatch ran (`exc.dbo_ubatch_id`, set by
    the scheduler): the shapes in its message are the ubatch's, not the caller's.

    `rows`: rows (dim 0 of the split inputs) per ubatch, in order; `contiguous`: ubatch
    u ran the rows after those of ubatches < u (the named split modes)."""
    ubatch_id = getattr(exc, "dbo_ubatch_id", None)
    if ubatch_id is None or getattr(exc, "dbo_ubatch_rows", None) is not None \
            or not 0 <= ubatch_id < len(rows):
        return
    start, total = sum(rows[:ubatch_id]), sum(rows)
    end = start + rows[ubatch_id]
    try:
        exc.dbo_ubatch_rows = (start, end)  # type: ignore[attr-defined]
    except (AttributeError, TypeError):
        return
    ran = f"rows [{start}, {end})" if contiguous else f"{end - start} rows"
    add_note(exc, f"[dbo] ubatch {ubatch_id} ran {ran} of the step's {total} rows: shapes "
                   f"in this error are the ubatch's, not the step's")


def add_note(exc: BaseException, note: str) -> None:
    """`exc.add_note(note)` where the exception type allows it."""
    if hasattr(exc, "add_note"):
        exc.add_note(note)
