"""Where the two ubatches of a step meet: one piece of work done once for both.

    out = scheduler.meet(key, value, work)      # through `dbo.yield_points.dbo_meet`

The ubatch that reaches `key` first leaves its `value` and yields until the other one
arrives; the one that arrives second calls `work([value_of_ub0, value_of_ub1])` (values
in ubatch order, whoever came first), which returns one result per ubatch, and both go on
with their own result. While it waits, the first ubatch runs the receive hooks the other
hands it (as `dbo_maybe_run_recv_hook`), so a receive the other one needs before it can
arrive is never held back.

This is how a step runs its MoE layers' experts once over both ubatches' rows
(`DBOConfig.joined_experts`): each expert's weights are read once per step, not once per
ubatch, while the attention, dispatch and combine still overlap across the ubatches.

In a step of one ubatch (or outside a step, through the yield point) `work([value])` runs
at once. The two ubatches must meet at the same keys in the same order: a ubatch that
waits at a key the other finished without reaching raises, and so does one whose other
ubatch waits at another key (else both would wait for ever).
"""
from __future__ import annotations

from typing import Any, Callable, Hashable, Optional, Sequence

__all__ = ["Meeting", "meet"]

Work = Callable[[list[Any]], Sequence[Any]]


class Meeting:
    """One key's meeting: the first ubatch's value, and the results once the work ran."""

    __slots__ = ("ubatch_id", "value", "results")

    def __init__(self, ubatch_id: int, value: Any) -> None:
        self.ubatch_id = ubatch_id
        self.value = value
        self.results: Optional[Sequence[Any]] = None


def meet(scheduler: Any, meetings: dict[Hashable, Meeting], key: Hashable, value: Any,
         work: Work) -> Any:
    """The running ubatch's result of `work` at `key` (module doc). `meetings`: the
    step's open meetings (the scheduler's; empty at each step's start)."""
    ub = scheduler.running
    other = scheduler.other(ub)
    if other is None:
        return _results(work([value]), 1, key)[0]
    waiting = meetings.pop(key, None)
    if waiting is not None:
        if waiting.ubatch_id == ub.ubatch_id:
            raise RuntimeError(f"ubatch {ub.ubatch_id} met at {key!r} twice before ubatch "
                               f"{other.ubatch_id} arrived: a meeting's key is reached once "
                               f"per ubatch")
        values = [waiting.value, value] if waiting.ubatch_id == 0 else [value, waiting.value]
        waiting.results = results = _results(work(values), 2, key)
        return results[ub.ubatch_id]
    mine = meetings[key] = Meeting(ub.ubatch_id, value)
    while mine.results is None:
        if other.done:
            meetings.pop(key, None)
            raise RuntimeError(
                f"ubatch {ub.ubatch_id} waits at {key!r} for ubatch {other.ubatch_id}, "
                f"which finished without reaching it: both ubatches of a step with "
                f"joined experts must run the same MoE layers in the same order")
        elsewhere = [k for k, m in meetings.items() if m.ubatch_id == other.ubatch_id]
        if elsewhere:
            meetings.pop(key, None)
            raise RuntimeError(
                f"ubatch {ub.ubatch_id} waits at {key!r} while ubatch {other.ubatch_id} "
                f"waits at {elsewhere[0]!r}: both ubatches of a step with joined experts "
                f"must run the same MoE layers in the same order")
        while ub.recv_hooks:  # a receive the other ubatch needs before it can arrive
            ub.recv_hooks.pop(0)()
        scheduler.yield_()
    return mine.results[ub.ubatch_id]


def _results(results: Sequence[Any], count: int, key: Hashable) -> Sequence[Any]:
    if not isinstance(results, Sequence) or len(results) != count:
        raise TypeError(f"the work at meeting {key!r} must return one result per ubatch "
                        f"({count}), got {type(results).__name__}"
                        f"{'' if not isinstance(results, Sequence) else f' of {len(results)}'}")
    return results
