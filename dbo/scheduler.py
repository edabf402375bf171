"""The ubatch scheduler: each ubatch's forward runs in a greenlet on the calling thread.

    UBatchScheduler(device).run([fn0, fn1]) -> [fn0(), fn1()]

Contract (DESIGN.md, "Scheduler contract"):
- Exactly one ubatch runs at a time; ubatch 0 starts. A yield (`dbo.yield_points`)
  hands control to the other ubatch; once one ubatch has finished, the other runs to its
  end. The order is deterministic: it depends only on where the code yields.
- The current CUDA stream, grad and inference mode, autocast, the torch-function and
  torch-dispatch mode stacks (`with torch.device(...)`) and the current CUDA device are
  per OS thread, shared by the greenlets. The scheduler owns them during a step: on every
  switch it re-applies the resumed ubatch's own values, and `run` restores the caller's
  values when it returns or raises (`dbo.thread_state` lists what is and is not switched).
- Each ubatch runs in a copy of the caller's `contextvars` context (a greenlet would
  start in an empty one): context variables the caller set are seen in both ubatches,
  and one a ubatch sets is seen by neither the other ubatch nor the caller.
- An exception in one ubatch unwinds the other (GreenletExit at its suspension point,
  yields there are no-ops) and `run` re-raises the original exception, with the ubatch id
  in its notes and as `exc.dbo_ubatch_id`. The scheduler is reusable afterwards.

A yield switches straight into the other ubatch's greenlet; only a ubatch that finishes
or raises returns to the caller's greenlet (the hub), which then resumes the other one
or unwinds it.
"""
from __future__ import annotations

import contextvars
import threading
from typing import Any, Callable, Hashable, Optional, Sequence, TypeVar

import greenlet
import torch

import dbo.ranges as trace_ranges
import dbo.thread_state as tls
from dbo.meet import Meeting, Work, meet
from dbo.thread_state import ThreadState, ThreadStateSwitch
from streams.standins import OpLog
from streams.stream_set import StreamSet, resolve_device

T = TypeVar("T")

# The reads of ThreadStateSwitch.capture, bound once at module level: `yield_` inlines them.
_is_grad_enabled = tls.is_grad_enabled
_is_inference_mode_enabled = tls.is_inference_mode_enabled
_is_any_autocast_enabled = tls.is_any_autocast_enabled
_len_function_modes = tls.len_function_modes
_len_dispatch_modes = tls.len_dispatch_modes
_cuda_current_device = tls.cuda_current_device

MAX_UBATCHES = 2


class _RunningStep(threading.local):
    """`running_step.scheduler`: the scheduler of the DBO step running on this thread, or
    None outside a step. A step's greenlets all live on the thread that called run(), so
    a thread-local is exactly the scope of a step. The yield points read the attribute
    directly (the class default makes it None on every thread without a `getattr`)."""

    scheduler: Optional["UBatchScheduler"] = None


running_step = _RunningStep()


def active_scheduler() -> Optional["UBatchScheduler"]:
    """The scheduler of the DBO step running on this thread, or None outside a step."""
    return running_step.scheduler


class UBatch:
    """One ubatch's bookkeeping: its greenlet, stream, thread state and pending hooks."""

    __slots__ = ("ubatch_id", "glet", "streams", "stream", "thread_state", "yield_to",
                 "recv_hooks", "done", "result", "run_range")

    def __init__(self, ubatch_id: int, glet: greenlet.greenlet, streams: StreamSet,
                 thread_state: ThreadState) -> None:
        self.ubatch_id = ubatch_id
        self.glet = glet
        # The step's stream set (on the ubatch so that a yield point reaches it in one load).
        self.streams = streams
        # The stream this ubatch works on: made current whenever it is resumed.
        self.stream = streams.compute
        self.thread_state = thread_state
        # Whom a yield hands control to: the other ubatch while it has not finished and
        # the step is not unwinding, else None (the yield is a no-op).
        self.yield_to: Optional[UBatch] = None
        # Receive halves registered *for* this ubatch by the other one, run by this
        # ubatch once it has queued its own compute (see dbo_maybe_run_recv_hook).
        self.recv_hooks: list[Callable[[], Any]] = []
        self.done = False
        self.result: Any = None
        # While tracing is on: the open `ub<n>/run` range (this ubatch holds the thread).
        self.run_range: Any = None


class UBatchScheduler:
    """Runs up to two ubatch callables interleaved at their yield points.

    Args:
        device: the device whose streams the step uses (None: the current CUDA device
            when CUDA is available, else CPU with stand-in streams).
        log: with stand-in streams, a list that receives every event record/wait (tests).
    """

    def __init__(self, device: torch.device | str | None = None, *,
                 log: Optional[OpLog] = None) -> None:
        self.device = resolve_device(device)
        self._log = log
        self._streams: Optional[StreamSet] = None
        self._ubatches: list[UBatch] = []
        # The ubatch holding the thread (None outside a step): read by `dbo.yield_points`.
        self.running: Optional[UBatch] = None
        self._device_type = self.device.type
        self._autocast_types = tls.autocast_device_types(self._device_type)
        self._is_cuda = self.device.type == "cuda"
        self._thread_state: Optional[ThreadStateSwitch] = None
        # Whether the two ubatches of the last run() interleaved (see the property).
        self._interleaved: Optional[bool] = None
        # The running step's open meetings (`dbo.meet`) and whether its MoE layers join
        # the ubatches' experts (`run`'s `joined_experts`).
        self._meetings: dict[Hashable, Meeting] = {}
        self.joined_experts = False

    # ----------------------------------------------------------------- public API
    @property
    def streams(self) -> StreamSet:
        """The stream set of the running (or last) step."""
        if self._streams is None:
            raise RuntimeError("no DBO step has run on this scheduler yet")
        return self._streams

    @property
    def last_run_interleaved(self) -> Optional[bool]:
        """Whether the ubatches of the last `run` that returned interleaved: one yielded
        to the other before it finished. False: the first to finish never yielded, so
        they ran one after the other (the model has no yield point that hands off, or
        none on this path: nothing overlapped). None: no run of two ubatches yet, or the
        last run had one. Found once per run, when the first ubatch finishes (no cost
        per yield)."""
        return self._interleaved

    @property
    def num_ubatches(self) -> int:
        """Ubatches of the running (or last) step; 0 between steps."""
        return len(self._ubatches)

    def run(self, fns: Sequence[Callable[[], T]], *, joined_experts: bool = False) -> list[T]:
        """Run each callable as one ubatch; return their results in order.
        `joined_experts`: the step's MoE layers run their experts once over both
        ubatches' rows (`DBOConfig.joined_experts`, `dbo_joined_experts`)."""
        _check_fns(fns)
        if active_scheduler() is not None:
            raise RuntimeError(
                "UBatchScheduler.run() was called inside a running DBO step (nested "
                "DBO is not supported): call the model directly inside a ubatch")
        streams = self._prepare_streams()
        switch = self._thread_state = ThreadStateSwitch(self._device_type,
                                                        is_cuda=self._is_cuda)
        hub = greenlet.getcurrent()
        self._ubatches = ubatches = [UBatch(i, _ubatch_greenlet(fn, hub), streams,
                                            switch.caller) for i, fn in enumerate(fns)]
        if len(ubatches) == 2:
            ubatches[0].yield_to, ubatches[1].yield_to = ubatches[1], ubatches[0]
        running_step.scheduler = self
        self._interleaved = None
        self.joined_experts = joined_experts and len(ubatches) == 2
        try:
            self._loop()
            return [ub.result for ub in self._ubatches]
        finally:
            running_step.scheduler = None
            self.running = None
            # Unconditionally: a ubatch may have set the stream behind the tracker's back.
            streams.current.force(streams.compute)
            switch.restore_caller()
            self._thread_state = None
            self._ubatches = []
            self._meetings = {}
            self.joined_experts = False

    # ------------------------------------------- used by dbo.yield_points (in a step)
    def yield_(self) -> None:
        """Hand control to the other ubatch; return when this one is resumed.

        A no-op when the other ubatch has finished, or while unwinding after a failure
        (so cleanup code runs straight through). Either way this ubatch's stream
        (`ub.stream`, which a yield point may have changed just before) is current on
        return. This is the hot path of every hand-off: it is written flat on purpose
        (no helper calls in the common case), `ThreadStateSwitch.capture` inlined.
        """
        ub = self.running
        target = ub.yield_to
        tracker = self._streams.current
        if target is None:
            if ub.stream is not tracker._current:
                tracker.set(ub.stream)
            return
        # ThreadStateSwitch.capture, inlined: in the common case (nothing differs between
        # the ubatches) these reads are all the thread-state work of a hand-off.
        now = (_is_grad_enabled(), _is_inference_mode_enabled(),
               _is_any_autocast_enabled() and tls.read_autocast(self._autocast_types),
               _len_function_modes() and tls.read_function_modes(),
               _len_dispatch_modes() and tls.read_dispatch_modes(),
               _cuda_current_device() if self._is_cuda else 0)
        ub.thread_state = now
        if trace_ranges._ENABLED:
            self._mark_running(ub, target)
        if target.thread_state != now:
            self._thread_state.apply(target.thread_state, now)
        self.running = target
        if target.stream is not tracker._current:
            tracker.set(target.stream)
        target.glet.switch()
        # Resumed (by the other ubatch's yield, or by the hub once it finished), with this
        # ubatch's stream and thread state applied by whoever switched back.

    def meet(self, key: Hashable, value: Any, work: Work) -> Any:
        """The running ubatch's share of `work`, run once for both ubatches by the one
        that reaches `key` second (`dbo.meet`)."""
        return meet(self, self._meetings, key, value, work)

    def set_stream(self, ub: UBatch, stream: Any) -> None:
        ub.stream = stream
        self._streams.current.set(stream)

    def other(self, ub: UBatch) -> Optional[UBatch]:
        """The other ubatch of the step, or None when the step has only one."""
        ubatches = self._ubatches
        if len(ubatches) < 2:
            return None
        return ubatches[1 - ub.ubatch_id]

    # ------------------------------------------------------------------ internals
    def _prepare_streams(self) -> StreamSet:
        """Reuse the cached stream set unless the caller's current stream changed."""
        cached = self._streams
        if cached is not None and cached.is_cuda:
            with torch.cuda.device(self.device):
                now = torch.cuda.current_stream()
            if now == cached.compute:
                cached.current.resync()
                return cached
        elif cached is not None:
            return cached
        self._streams = StreamSet.create(self.device, num_ubatches=MAX_UBATCHES,
                                         log=self._log)
        return self._streams

    def _enter(self, target: UBatch) -> Any:
        """Enter `target` from the hub with its stream and state; return what the hub
        receives back (a result) once a ubatch finishes. Ubatches switch to each other
        directly (`yield_`); only a finished or failed ubatch returns to the hub."""
        if trace_ranges._ENABLED:
            self._mark_running(None, target)
        self._enter_state(target)
        self.running = target
        self._streams.current.set(target.stream)
        return target.glet.switch()

    def _loop(self) -> None:
        """Start ubatch 0; each time a ubatch finishes, resume the one still running."""
        target = self._ubatches[0]
        while True:
            try:
                value = self._enter(target)
            except BaseException as exc:  # noqa: BLE001 - re-raised below, annotated
                failed = self.running
                self._mark_running(failed, None)
                self._abort(failed)
                _annotate(exc, failed.ubatch_id)
                raise
            finished = self.running  # whichever ubatch was running returned to us
            self._mark_running(finished, None)
            finished.done = True
            finished.result = value
            remaining = self.other(finished)
            if remaining is None or remaining.done:
                return
            # The first to finish: the other has run only if this one yielded to it.
            self._interleaved = bool(remaining.glet)
            remaining.yield_to = None  # its yields are no-ops from now on
            self._drain_orphaned_hooks(remaining, finished)
            target = remaining

    @staticmethod
    def _mark_running(current: Optional[UBatch], target: Optional[UBatch]) -> None:
        """Close `current`'s `ub<n>/run` trace range, open `target`'s: in a trace they
        show which ubatch held the thread, so kernels are attributed exactly."""
        if current is not None and current.run_range is not None:
            trace_ranges.end_phase(current.run_range)
            current.run_range = None
        if target is not None and trace_ranges._ENABLED:
            target.run_range = trace_ranges.start_phase("run", ubatch_id=target.ubatch_id)

    def _drain_orphaned_hooks(self, ub: UBatch, finished: UBatch) -> None:
        """Run hooks that `ub` registered for `finished`, which will never run them.

        Without this `ub`'s receive would wait forever.
        """
        if not finished.recv_hooks:
            return
        self.running = ub
        self.streams.current.set(ub.stream)
        self._enter_state(ub)
        hooks, finished.recv_hooks = finished.recv_hooks, []
        for hook in hooks:
            hook()

    def _enter_state(self, ub: UBatch) -> None:
        """Apply `ub`'s thread state from the hub (where no ubatch's state is kept)."""
        switch = self._thread_state
        now = switch.capture()
        if ub.thread_state != now:
            switch.apply(ub.thread_state, now)

    def _abort(self, failed: UBatch) -> None:
        """Unwind every other live ubatch after `failed` raised."""
        for ub in self._ubatches:
            ub.yield_to = None  # yields while unwinding are no-ops
        try:
            for ub in self._ubatches:
                if ub is failed or ub.glet.dead:
                    continue
                self.running = ub
                # Its cleanup (context managers' exits) must run in its own state.
                self._enter_state(ub)
                try:
                    ub.glet.throw()
                except BaseException:  # noqa: BLE001 - its cleanup failed too; the first error wins
                    pass
        finally:
            self.running = None


def _check_fns(fns: Sequence[Callable[[], Any]]) -> None:
    if isinstance(fns, (str, bytes)) or not isinstance(fns, Sequence):
        raise TypeError(f"run() takes a list of callables, one per ubatch; got {type(fns).__name__}")
    if len(fns) == 0:
        raise ValueError("run([]) got no ubatches: pass one or two callables")
    if len(fns) > MAX_UBATCHES:
        raise ValueError(f"run() got {len(fns)} ubatches; at most {MAX_UBATCHES} are "
                         f"supported: split the batch into two")
    for i, fn in enumerate(fns):
        if not callable(fn):
            raise TypeError(f"ubatch {i} is a {type(fn).__name__}, not a callable: pass "
                            f"a function taking no arguments, e.g. lambda: model(x)")


def _annotate(exc: BaseException, ubatch_id: int) -> None:
    note = f"[dbo] raised in ubatch {ubatch_id} of a DBO step"
    try:
        exc.dbo_ubatch_id = ubatch_id  # type: ignore[attr-defined]
    except (AttributeError, TypeError):
        pass
    if hasattr(exc, "add_note"):
        exc.add_note(note)


def _ubatch_greenlet(fn: Callable[[], Any], hub: greenlet.greenlet) -> greenlet.greenlet:
    """A greenlet for `fn` returning to `hub`, in a copy of the caller's context."""
    glet = greenlet.greenlet(fn, parent=hub)
    glet.gr_context = contextvars.copy_context()
    return glet
