"""Failure context: what a failed step left behind, and where in it the error came from.

    note_collective("all_to_all_single", ep_group)   # backends, right before each collective

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

A failed step that had issued collectives also marks the process groups it issued them on
(the groups the callers of `note_collective` name) unusable, as does an `MoELayer` call
that raised after issuing some (a layer called without a runner): which rank issued what
is unknown, and a collective of the next step could meet one of the failed step on a
peer (gloo then aborts the process on mismatched sizes, or waits until the timeout).
Every later collective noted on such a group (the next step's vote, a layer's dispatch,
a new layer's construction) raises `GroupUnusableError` instead, in one line, before it
is issued; a new group (`dbo.new_group`, `dist.new_group`) starts usable. A step that
every rank stopped together (`mark_stopped_together`: at the vote, before any collective
of the model) marks nothing: its group stays usable.

The collective count is per thread (a step's greenlets share their thread) and is reset
by the runner at the start of each step. Tests can also record the names in order
(`record_collectives`) to check that every rank issues the same sequence.
"""
from __future__ import annotations

import contextlib
import re
import threading
import weakref
from typing import Any, Iterator, Optional, Sequence

import torch.distributed as dist

from dbo.groups import describe_group
from dbo.yield_points import dbo_current_ubatch_id

_local = threading.local()
# Process groups a failure left unusable (process-wide, as groups are), with what failed.
# Keyed by id(group), each entry checked against its weak reference (an id can be reused
# once its group is gone): a plain dict costs a collective nothing while it is empty.
_UNUSABLE: dict[int, tuple["weakref.ref[dist.ProcessGroup]", str]] = {}
# How much of a failure's first line a GroupUnusableError quotes.
_QUOTED_CHARS = 160


class GroupUnusableError(RuntimeError):
    """A collective on a process group that an earlier failed step left unusable (the
    module doc): raised before the collective is issued; re-create the group."""


def _state() -> Any:
    if not hasattr(_local, "count"):
        _local.count = 0
        _local.log = None
        _local.groups = []  # weak references to the groups noted since the last reset
    return _local


def note_collective(name: str, group: Optional[dist.ProcessGroup] = None) -> None:
    """Called by backends (and the vote) right before issuing a collective on `group`:
    the EP group the caller was given, also for traffic on its side group (None: the
    default group). Raises `GroupUnusableError` where a failure left `group` unusable."""
    state = _state()
    if group is None:
        group = _resolve(None)
    if group is not None:
        if _UNUSABLE:
            check_group_usable(group)
        groups = state.groups
        if not groups or groups[-1]() is not group:  # (not the same group as last time)
            _note_group(groups, group)
    state.count += 1
    if state.log is not None:
        state.log.append((name, dbo_current_ubatch_id()))


def check_group_usable(group: Optional[dist.ProcessGroup]) -> None:
    """Raise `GroupUnusableError` (one line: the group, what failed, the fix) where a failed
    step left `group` unusable (None: the default group); else nothing. Issues nothing."""
    resolved = _resolve(group) if _UNUSABLE else None
    failure = _unusable(resolved) if resolved is not None else None
    if failure is None:
        return
    raise GroupUnusableError(
        f"process group {describe_group(resolved)} is unusable: {failure}, after collectives "
        f"on it had started, so which rank issued what is unknown and the ranks' next "
        f"collectives could meet the failed step's; nothing was issued on it. Re-create it "
        f"on every rank (dbo.destroy_group(group), then dbo.new_group(timeout_s=...) or "
        f"dist.new_group(...)) and build the MoE layers and the runner on the new group")


def mark_group_unusable(group: Optional[dist.ProcessGroup], exc: BaseException) -> None:
    """Record that `exc` ended a step (or layer call) on `group` after collectives had
    started on it (None: the default group): later collectives on it raise."""
    resolved = _resolve(group)
    if resolved is None or _unusable(resolved) is not None:
        return
    for key in [k for k, (ref, _) in _UNUSABLE.items() if ref() is None]:
        del _UNUSABLE[key]  # groups gone since they were marked
    _UNUSABLE[id(resolved)] = (weakref.ref(resolved), _failure_words(exc))


def fail_call_after_collectives(exc: BaseException, group: Optional[dist.ProcessGroup], *,
                                issued_before: int) -> None:
    """A call on `group` (an `MoELayer`'s forward) raised `exc`: where this thread issued
    collectives since `issued_before` (`collectives_issued()` when the call began) and the
    ranks did not stop together, mark `group` unusable. `group` None: no EP group, nothing
    to mark."""
    if group is None or getattr(exc, "dbo_stopped_together", False) \
            or collectives_issued() == issued_before or isinstance(exc, GroupUnusableError):
        return
    mark_group_unusable(group, exc)


@contextlib.contextmanager
def vote_failure(group: Optional[dist.ProcessGroup]) -> Iterator[None]:
    """Around the vote's collective: a RuntimeError from it (gloo's recv timeout, a closed
    connection, an NCCL error) is raised again as one line naming the vote, `group`, its
    timeout and the likely cause, the original as `__cause__`."""
    try:
        yield
    except RuntimeError as exc:
        text = str(exc)
        what = ("timed out" if "timed out" in text.lower() or "timeout" in text.lower()
                else f"failed ({type(exc).__name__}: {_first_line(text)})")
        raise RuntimeError(
            f"the DBO vote, the step's first collective (an all_reduce over process group "
            f"{describe_group(group)}), {what}: a rank of the group likely never called the "
            f"runner for this step, or is stuck elsewhere (its own code, or another "
            f"collective); every rank of the group must call the runner on every step, with "
            f"0 tokens too") from exc


def collectives_issued() -> int:
    """Collectives this thread issued since the last `reset_collectives()`."""
    return _state().count


def reset_collectives() -> None:
    """Start a step: no collective issued, no group noted."""
    state = _state()
    state.count = 0
    state.groups.clear()


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
    if isinstance(exc, GroupUnusableError) and issued == 0:
        return  # refused before anything was issued: its one line says it all
    if getattr(exc, "dbo_stopped_together", False):
        add_note(exc, "[dbo] every rank of the group stopped this step at its vote, before "
                       "any collective of the model: the process group is intact and the "
                       "next step can run")
    elif issued == 0:
        add_note(exc, "[dbo] no collective of this step had been issued on this rank: the "
                       "process group is intact, and the next step can run once every "
                       "rank skips this one alike")
    else:
        for noted in _state().groups:
            group = noted()
            if group is not None:  # None: gone since (mark_group_unusable(None): the default)
                mark_group_unusable(group, exc)
        add_note(exc, f"[dbo] this rank had issued {issued} collective(s) of this step when "
                       f"it failed: the ranks' collective sequences may now differ, so "
                       f"re-create the process group (dbo.destroy_group, then dbo.new_group "
                       f"/ dist.new_group) before the next step; a step on this one raises "
                       f"GroupUnusableError")


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


def _note_group(groups: list, group: dist.ProcessGroup) -> None:
    """Add a weak reference to `group` to `groups` (a step's noted groups), once."""
    if isinstance(group, dist.ProcessGroup) and all(ref() is not group for ref in groups):
        groups.append(weakref.ref(group))


def _unusable(group: dist.ProcessGroup) -> Optional[str]:
    """What failed on `group`, where a failure left it unusable; else None."""
    entry = _UNUSABLE.get(id(group))
    return entry[1] if entry is not None and entry[0]() is group else None


def _resolve(group: Optional[dist.ProcessGroup]) -> Optional[dist.ProcessGroup]:
    """`group`, the default group for None; None where there is no process group (or
    `group` is not one: a test's stand-in)."""
    if group is None:
        if not (dist.is_available() and dist.is_initialized()):
            return None
        group = dist.group.WORLD
    return group if isinstance(group, dist.ProcessGroup) else None


def _failure_words(exc: BaseException) -> str:
    """"a step failed on rank R (Type: its first line)", for `GroupUnusableError`."""
    rank = this_rank()
    where = "on this rank" if rank is None else f"on rank {rank}"
    return f"a step failed {where} ({type(exc).__name__}: {_first_line(str(exc))})"


def _first_line(text: str) -> str:
    """`text`'s first line, less a leading "[source file:line] " (gloo's), shortened."""
    line = text.strip().splitlines()[0] if text.strip() else "no message"
    line = re.sub(r"^\[[^\]]*\]\s*", "", line) or line
    return line if len(line) <= _QUOTED_CHARS else line[:_QUOTED_CHARS - 3] + "..."
