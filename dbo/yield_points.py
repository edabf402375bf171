"""The yield-point API: what model and MoE code calls inside a DBO step.

The names are the ones the ecosystem already uses, so a prepare/finalize written for
the peer runtime ports by changing its import. Outside a DBO step every call is a no-op:
`dbo_enabled()` is False, `dbo_current_ubatch_id()` is 0, `dbo_get_previous_event()`
returns None.

| call | meaning |
|---|---|
| dbo_yield() | hand off; resume on the stream this ubatch was on |
| dbo_yield_and_switch_from_compute_to_comm() | record compute-done, hand off; on resume: comm stream, wait compute-done |
| dbo_yield_and_switch_from_comm_to_compute() | record comm-done, hand off; on resume: compute stream, wait comm-done |
| dbo_switch_to_comm() / dbo_switch_to_compute() | change stream, no dependency |
| dbo_switch_to_comm_sync() / dbo_switch_to_compute_sync() | record done on the old stream, change stream, wait on it |
| dbo_register_recv_hook(fn) | hand a receive-half to the other ubatch, run after it queued its compute |
| dbo_maybe_run_recv_hook() | run the hooks the other ubatch handed to this one, if any |
| dbo_get_previous_event(fn, *a) | run fn on the compute stream, return its result (an event) |
| dbo_is_last_ubatch() | whether the running ubatch is the step's last |
| dbo_single_batch_overlap() | inside a step of one ubatch (single-batch overlap) |
| dbo_joined_experts() | inside a step whose MoE layers run their experts once for both ubatches |
| dbo_meet(key, value, work) | the ubatch arriving second runs work([v0, v1]) for both; each gets its result |
| dbo_switch_to_compute_async() | record comm-done, switch to compute, return a `ComputeWait` whose wait() adds the dependency later |

The last five are ours (the peer runtime has no such calls). `dbo_is_last_ubatch` tells a
layer that its combine is the step's last (the split combine, `moe.modular_kernel`). With
`dbo_switch_to_compute_async`, a backend that issues a collective on the comm stream
records comm-done at once, returns to the compute stream without waiting, lets the caller
queue independent work (shared experts) and yield, and waits only in its receiver.

Events are recorded *before* the hand-off: an event recorded on the shared compute
stream after a yield would also cover the other ubatch's queued work.

Under `torch.compile` every call here is a graph break (`dbo.compiling`): each function
first tests whether dynamo traces it (`compiling()`) or runs it with its frame hook on
(`frame_hook()`), and if so calls its own `torch.compiler.disable`d twin, which runs it
eagerly, with the hook off, between two compiled graphs. Eager callers pay the two tests.
"""
from __future__ import annotations

from typing import Any, Callable

from dbo.compiling import compiling, eager_twin, frame_hook
from dbo.scheduler import active_scheduler, running_step


def dbo_enabled() -> bool:
    """True inside a DBO step."""
    if compiling() or frame_hook() is not None:
        return _EAGER["dbo_enabled"]()
    return active_scheduler() is not None


def dbo_current_ubatch_id() -> int:
    """The running ubatch (0 or 1); 0 outside a DBO step."""
    if compiling() or frame_hook() is not None:
        return _EAGER["dbo_current_ubatch_id"]()
    s = active_scheduler()
    return 0 if s is None else s.running.ubatch_id


def dbo_other_ubatch_started() -> bool:
    """Whether the other ubatch of the running step has begun (run up to a yield, or
    finished). False outside a step and in a step of one ubatch.

    Lets a backend that must block the host (a2a reads its counts) do so before its first
    yield of the step: the other ubatch has queued nothing the GPU could run meanwhile.
    """
    if compiling() or frame_hook() is not None:
        return _EAGER["dbo_other_ubatch_started"]()
    s = active_scheduler()
    if s is None:
        return False
    other = s.other(s.running)
    return other is not None and (other.done or bool(other.glet))


def dbo_is_last_ubatch() -> bool:
    """Whether the running ubatch is the step's last (the highest id): the one whose final
    combine has no other ubatch's compute left to overlap. False outside a step."""
    if compiling() or frame_hook() is not None:
        return _EAGER["dbo_is_last_ubatch"]()
    s = active_scheduler()
    return s is not None and s.running.ubatch_id == s.num_ubatches - 1


def dbo_single_batch_overlap() -> bool:
    """Whether the running step has one ubatch: single-batch overlap (SBO). Its yields
    are no-ops but its stream switches are real, so a layer may queue work that does
    not need the dispatched tokens (shared experts) on the compute stream while its
    dispatch is in flight on the comm stream. False outside a step and in a DBO step."""
    if compiling() or frame_hook() is not None:
        return _EAGER["dbo_single_batch_overlap"]()
    s = active_scheduler()
    return s is not None and s.num_ubatches == 1


def dbo_joined_experts() -> bool:
    """Whether the running step joins its ubatches' experts (`DBOConfig.joined_experts`):
    each MoE layer runs its experts once over both ubatches' dispatched rows
    (`dbo_meet`), so each expert's weights are read once per step. False outside a step
    and in a step of one ubatch."""
    if compiling() or frame_hook() is not None:
        return _EAGER["dbo_joined_experts"]()
    s = active_scheduler()
    return s is not None and s.joined_experts


def dbo_meet(key: Any, value: Any, work: Callable[[list], Any]) -> Any:
    """This ubatch's result of `work`, run once for both ubatches of the step
    (`dbo.meet`): the ubatch reaching `key` first yields until the other arrives, which
    calls `work([value of ubatch 0, value of ubatch 1])` (one result per ubatch). Outside
    a step, or in a step of one ubatch: `work([value])[0]`."""
    if compiling() or frame_hook() is not None:
        return _EAGER["dbo_meet"](key, value, work)
    s = active_scheduler()
    if s is None:
        return work([value])[0]
    return s.meet(key, value, work)


def dbo_yield() -> None:
    """Hand control to the other ubatch; resume on this ubatch's stream."""
    if compiling() or frame_hook() is not None:
        return _EAGER["dbo_yield"]()
    s = running_step.scheduler
    if s is not None:
        s.yield_()


# The two switching yields below are the per-hand-off hot path of every MoE layer: each
# reads the scheduler, ubatch and streams once, and sets the ubatch's next stream
# *before* the hand-off, so that the scheduler makes it current on resume (one stream
# change, not two). The wait still comes after the resume: queued before the hand-off,
# it would also hold back the other ubatch's work on that stream. Events that do
# nothing (stand-ins without a log) are not called at all.


def dbo_yield_and_switch_from_compute_to_comm() -> None:
    """Record compute-done, hand off; on resume: comm stream, waiting on compute-done."""
    if compiling() or frame_hook() is not None:
        return _EAGER["dbo_yield_and_switch_from_compute_to_comm"]()
    s = running_step.scheduler
    if s is None:
        return
    ub = s.running
    streams = ub.streams
    if ub.stream is not streams.compute:
        _wrong_stream(ub.stream, "dbo_yield_and_switch_from_compute_to_comm", "compute")
    live = streams.live_events
    if live:
        event = streams.compute_done[ub.ubatch_id]
        event.record(streams.compute)
    ub.stream = streams.comm
    s.yield_()
    if live:
        streams.comm.wait_event(event)


def dbo_yield_and_switch_from_comm_to_compute() -> None:
    """Record comm-done, hand off; on resume: compute stream, waiting on comm-done."""
    if compiling() or frame_hook() is not None:
        return _EAGER["dbo_yield_and_switch_from_comm_to_compute"]()
    s = running_step.scheduler
    if s is None:
        return
    ub = s.running
    streams = ub.streams
    if ub.stream is not streams.comm:
        _wrong_stream(ub.stream, "dbo_yield_and_switch_from_comm_to_compute", "comm")
    live = streams.live_events
    if live:
        event = streams.comm_done[ub.ubatch_id]
        event.record(streams.comm)
    ub.stream = streams.compute
    s.yield_()
    if live:
        streams.compute.wait_event(event)


def dbo_switch_to_comm() -> None:
    """Make the comm stream current for this ubatch (no dependency added)."""
    if compiling() or frame_hook() is not None:
        return _EAGER["dbo_switch_to_comm"]()
    s = active_scheduler()
    if s is not None:
        s.set_stream(s.running, s.streams.comm)


def dbo_switch_to_compute() -> None:
    """Make the compute stream current for this ubatch (no dependency added)."""
    if compiling() or frame_hook() is not None:
        return _EAGER["dbo_switch_to_compute"]()
    s = active_scheduler()
    if s is not None:
        s.set_stream(s.running, s.streams.compute)


def dbo_switch_to_comm_sync() -> None:
    """Record compute-done, switch to comm, make comm wait on it."""
    if compiling() or frame_hook() is not None:
        return _EAGER["dbo_switch_to_comm_sync"]()
    s = active_scheduler()
    if s is None:
        return
    ub, streams = s.running, s.streams
    _expect_stream(ub.stream, streams.compute, "dbo_switch_to_comm_sync", "compute")
    event = streams.compute_done[ub.ubatch_id]
    event.record(streams.compute)
    s.set_stream(ub, streams.comm)
    streams.comm.wait_event(event)


def dbo_switch_to_compute_sync() -> None:
    """Record comm-done, switch to compute, make compute wait on it."""
    if compiling() or frame_hook() is not None:
        return _EAGER["dbo_switch_to_compute_sync"]()
    s = active_scheduler()
    if s is None:
        return
    ub, streams = s.running, s.streams
    _expect_stream(ub.stream, streams.comm, "dbo_switch_to_compute_sync", "comm")
    event = streams.comm_done[ub.ubatch_id]
    event.record(streams.comm)
    s.set_stream(ub, streams.compute)
    streams.compute.wait_event(event)


class ComputeWait:
    """A comm-done event recorded by one ubatch, to be waited on by the compute stream.

    `wait(*tensors)` makes the current (compute) stream wait on the event and marks the
    given CUDA tensors as used by it, so the caching allocator does not hand their memory
    (allocated on the comm stream) to the comm stream again while compute still reads it.
    """

    __slots__ = ("_event", "_stream")

    def __init__(self, event: Any = None, stream: Any = None) -> None:
        self._event = event
        self._stream = stream

    def wait(self, *tensors: Any) -> None:
        if compiling() or frame_hook() is not None:
            return _EAGER["ComputeWait.wait"](self, *tensors)
        if self._event is None:
            return
        self._stream.wait_event(self._event)
        for t in tensors:
            if t is not None and t.is_cuda:
                t.record_stream(self._stream)


_NO_WAIT = ComputeWait()


def dbo_switch_to_compute_async() -> ComputeWait:
    """Record comm-done on the comm stream, switch to compute without waiting; the
    returned `ComputeWait` adds the wait when its `wait()` is called. Outside a step:
    a no-op whose `wait()` does nothing."""
    if compiling() or frame_hook() is not None:
        return _EAGER["dbo_switch_to_compute_async"]()
    s = active_scheduler()
    if s is None:
        return _NO_WAIT
    ub, streams = s.running, s.streams
    _expect_stream(ub.stream, streams.comm, "dbo_switch_to_compute_async", "comm")
    event = streams.comm_done[ub.ubatch_id]
    event.record(streams.comm)
    s.set_stream(ub, streams.compute)
    return ComputeWait(event, streams.compute)


def dbo_register_recv_hook(hook: Callable[[], Any]) -> None:
    """Hand `hook` (a receive half) to the other ubatch, which runs it at its next
    `dbo_maybe_run_recv_hook()`, i.e. after it has queued its own compute. If the other
    ubatch has finished, the hook runs at once; if it finishes without running the
    hook, the scheduler runs it before resuming this ubatch. Outside a step (or with a
    single ubatch) the hook runs at once."""
    if compiling() or frame_hook() is not None:
        return _EAGER["dbo_register_recv_hook"](hook)
    if not callable(hook):
        raise TypeError(f"dbo_register_recv_hook takes a callable, got {type(hook).__name__}")
    s = active_scheduler()
    other = None if s is None else s.other(s.running)
    if other is None or other.done:
        hook()  # nobody else will queue compute before it: receive now
        return
    other.recv_hooks.append(hook)


def dbo_maybe_run_recv_hook() -> None:
    """Run the hooks the other ubatch handed to this one, oldest first."""
    if compiling() or frame_hook() is not None:
        return _EAGER["dbo_maybe_run_recv_hook"]()
    s = active_scheduler()
    if s is None:
        return
    ub = s.running
    while ub.recv_hooks:
        ub.recv_hooks.pop(0)()


def dbo_get_previous_event(fn: Callable[..., Any], *args: Any) -> Any:
    """Run `fn(*args)` with the compute stream current and return its result (e.g. an
    event captured there, as DeepEP's `Buffer.capture`). None outside a DBO step."""
    if compiling() or frame_hook() is not None:
        return _EAGER["dbo_get_previous_event"](fn, *args)
    s = active_scheduler()
    if s is None:
        return None
    streams = s.streams
    before = streams.current.get()
    streams.current.set(streams.compute)
    try:
        return fn(*args)
    finally:
        streams.current.set(before)


def _expect_stream(actual: Any, expected: Any, call: str, name: str) -> None:
    if actual is not expected:  # a caller's bug: fail loudly rather than mis-order
        _wrong_stream(actual, call, name)


def _wrong_stream(actual: Any, call: str, name: str) -> None:
    raise RuntimeError(f"{call}() must be called on the {name} stream, but this ubatch "
                       f"is on {actual!r}: check the order of the switch calls")


# The graph-break twins of the calls above (see the module doc).
_EAGER: dict[str, Callable[..., Any]] = {
    fn.__name__: eager_twin(fn) for fn in (
        dbo_enabled, dbo_current_ubatch_id, dbo_other_ubatch_started, dbo_is_last_ubatch,
        dbo_single_batch_overlap, dbo_joined_experts, dbo_meet, dbo_yield,
        dbo_yield_and_switch_from_compute_to_comm, dbo_yield_and_switch_from_comm_to_compute, dbo_switch_to_comm, dbo_switch_to_compute,
        dbo_switch_to_comm_sync, dbo_switch_to_compute_sync, dbo_switch_to_compute_async,
        dbo_register_recv_hook, dbo_maybe_run_recv_hook, dbo_get_previous_event)}
_EAGER["ComputeWait.wait"] = eager_twin(ComputeWait.wait)
