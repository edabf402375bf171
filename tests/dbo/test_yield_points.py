"""Layer 1 (CPU): the yield-point API's stream bookkeeping, with stand-in streams."""
from __future__ import annotations

import pytest

import dbo
from dbo import (
    UBatchScheduler,
    dbo_current_ubatch_id,
    dbo_get_previous_event,
    dbo_maybe_run_recv_hook,
    dbo_register_recv_hook,
    dbo_switch_to_comm,
    dbo_switch_to_comm_sync,
    dbo_switch_to_compute,
    dbo_switch_to_compute_sync,
    dbo_yield,
    dbo_yield_and_switch_from_comm_to_compute,
    dbo_yield_and_switch_from_compute_to_comm,
)


def current_stream_name(sched: UBatchScheduler) -> str:
    return sched.streams.current.get().name


def test_noops_outside_a_step():
    assert not dbo.dbo_enabled()
    assert dbo_current_ubatch_id() == 0
    for fn in (dbo_yield, dbo_yield_and_switch_from_compute_to_comm,
               dbo_yield_and_switch_from_comm_to_compute, dbo_switch_to_comm,
               dbo_switch_to_compute, dbo_switch_to_comm_sync, dbo_switch_to_compute_sync,
               dbo_maybe_run_recv_hook):
        assert fn() is None
    assert dbo_get_previous_event(lambda: "event") is None
    ran = []
    dbo_register_recv_hook(lambda: ran.append(1))  # no partner: runs at once
    assert ran == [1]


def test_enabled_and_ids_inside_a_step():
    seen = []

    def fn():
        seen.append((dbo.dbo_enabled(), dbo_current_ubatch_id()))
        dbo_yield()
        seen.append((dbo.dbo_enabled(), dbo_current_ubatch_id()))

    UBatchScheduler("cpu").run([fn, fn])
    assert seen == [(True, 0), (True, 1), (True, 0), (True, 1)]
    assert not dbo.dbo_enabled()


def test_each_ubatch_resumes_on_its_own_stream():
    sched = UBatchScheduler("cpu", log=[])
    seen = []

    def comm_ub():
        dbo_switch_to_comm()
        dbo_yield()
        seen.append(("ub0", current_stream_name(sched)))
        dbo_yield()
        seen.append(("ub0", current_stream_name(sched)))

    def compute_ub():
        seen.append(("ub1", current_stream_name(sched)))
        dbo_yield()
        seen.append(("ub1", current_stream_name(sched)))
        dbo_switch_to_comm()
        dbo_switch_to_compute()

    sched.run([comm_ub, compute_ub])
    assert seen == [("ub1", "compute"), ("ub0", "comm"), ("ub1", "compute"), ("ub0", "comm")]
    assert current_stream_name(sched) == "compute"  # restored when run() returns


def test_compute_to_comm_records_before_yield_then_waits_on_resume():
    log: list = []
    sched = UBatchScheduler("cpu", log=log)
    order = []

    def ub0():
        dbo_yield_and_switch_from_compute_to_comm()
        order.append(("ub0 resumed on", current_stream_name(sched), len(log)))

    def ub1():
        # Ubatch 0's event is already recorded when this ubatch first runs.
        order.append(("ub1 sees log", list(log)))

    sched.run([ub0, ub1])
    assert order[0] == ("ub1 sees log", [("record", "compute_done[0]", "compute")])
    assert log == [("record", "compute_done[0]", "compute"),
                   ("wait", "comm", "compute_done[0]")]
    assert order[1] == ("ub0 resumed on", "comm", 2)


def test_comm_to_compute_records_on_comm_then_waits_on_compute():
    log: list = []
    sched = UBatchScheduler("cpu", log=log)

    def ub():
        u = dbo_current_ubatch_id()
        dbo_switch_to_comm()
        dbo_yield_and_switch_from_comm_to_compute()
        assert current_stream_name(sched) == "compute"
        return u

    sched.run([ub, ub])
    assert log == [("record", "comm_done[0]", "comm"), ("record", "comm_done[1]", "comm"),
                   ("wait", "compute", "comm_done[0]"), ("wait", "compute", "comm_done[1]")]


def test_sync_switches_record_then_wait_without_yielding():
    log: list = []
    sched = UBatchScheduler("cpu", log=log)
    trace = []

    def ub():
        u = dbo_current_ubatch_id()
        dbo_switch_to_comm_sync()
        trace.append((u, current_stream_name(sched)))
        dbo_switch_to_compute_sync()
        trace.append((u, current_stream_name(sched)))

    sched.run([ub, ub])
    assert trace == [(0, "comm"), (0, "compute"), (1, "comm"), (1, "compute")]
    assert log == [("record", "compute_done[0]", "compute"), ("wait", "comm", "compute_done[0]"),
                   ("record", "comm_done[0]", "comm"), ("wait", "compute", "comm_done[0]"),
                   ("record", "compute_done[1]", "compute"), ("wait", "comm", "compute_done[1]"),
                   ("record", "comm_done[1]", "comm"), ("wait", "compute", "comm_done[1]")]


def test_switch_from_wrong_stream_is_an_error():
    def ub():
        dbo_switch_to_comm()
        dbo_yield_and_switch_from_compute_to_comm()

    with pytest.raises(RuntimeError, match="must be called on the compute stream"):
        UBatchScheduler("cpu").run([ub])


def test_recv_hook_runs_in_the_other_ubatch_after_its_compute():
    events = []

    def ub():
        u = dbo_current_ubatch_id()
        events.append((u, "compute"))
        dbo_maybe_run_recv_hook()
        events.append((u, "send"))
        dbo_register_recv_hook(lambda: events.append((u, "recv", dbo_current_ubatch_id())))
        dbo_yield()
        events.append((u, "use"))

    UBatchScheduler("cpu").run([ub, ub])
    assert events == [
        (0, "compute"), (0, "send"),
        (1, "compute"), (0, "recv", 1), (1, "send"),
        (0, "use"),
        # Ubatch 0 has finished without running ubatch 1's hook: the scheduler runs it
        # before resuming ubatch 1, in ubatch 1's context.
        (1, "recv", 1), (1, "use"),
    ]


def test_get_previous_event_runs_on_compute_stream():
    sched = UBatchScheduler("cpu", log=[])
    seen = []

    def ub():
        dbo_switch_to_comm()
        seen.append(dbo_get_previous_event(lambda tag: (tag, current_stream_name(sched)), "e"))
        seen.append(current_stream_name(sched))

    sched.run([ub])
    assert seen == [("e", "compute"), "comm"]


def test_register_recv_hook_rejects_non_callable():
    with pytest.raises(TypeError, match="callable"):
        dbo_register_recv_hook(3)  # type: ignore[arg-type]


def test_other_ubatch_started():
    seen = []

    def fn():
        seen.append((dbo_current_ubatch_id(), dbo.dbo_other_ubatch_started()))
        dbo_yield()
        seen.append((dbo_current_ubatch_id(), dbo.dbo_other_ubatch_started()))

    assert dbo.dbo_other_ubatch_started() is False  # outside a step
    UBatchScheduler("cpu").run([fn, fn])
    # ubatch 0 begins before ubatch 1 has run; every later check sees both started, and
    # ubatch 1's last check sees ubatch 0 finished (done still counts as started).
    assert seen == [(0, False), (1, True), (0, True), (1, True)]
    single = []
    UBatchScheduler("cpu").run([lambda: single.append(dbo.dbo_other_ubatch_started())])
    assert single == [False]


def test_switching_yields_change_the_current_stream_once_per_resume():
    """The next stream is set on the ubatch before the hand-off, so resuming it makes that
    stream current directly (on CUDA each change is a `torch.cuda.set_stream`). Two
    ubatches moving compute -> comm -> compute in step: one change per two hand-offs."""
    sched = UBatchScheduler("cpu")
    sched.run([lambda: None])  # creates the (cached) stream set
    tracker = sched.streams.current
    set_stream, changes, seen = tracker.set, [], []

    def counting_set(stream):
        if stream is not tracker.get():
            changes.append(stream.name)
        set_stream(stream)

    tracker.set = counting_set

    def fn():
        for _ in range(3):
            dbo_yield_and_switch_from_compute_to_comm()
            seen.append((dbo_current_ubatch_id(), current_stream_name(sched)))
            dbo_yield_and_switch_from_comm_to_compute()
            seen.append((dbo_current_ubatch_id(), current_stream_name(sched)))

    sched.run([fn, fn])
    for ubatch_id in (0, 1):  # each ubatch resumed on its own stream
        assert [name for u, name in seen if u == ubatch_id] == ["comm", "compute"] * 3
    assert changes == ["comm", "compute"] * 3  # 12 hand-offs


def test_switching_yields_skip_events_that_do_nothing():
    """Stand-in events without a log do nothing: the hand-off does not call them."""
    sched = UBatchScheduler("cpu")
    sched.run([lambda: None])
    streams = sched.streams
    assert not streams.live_events

    def refuse(*_):
        raise AssertionError("a no-op event was called on the hand-off path")

    for event in (*streams.compute_done, *streams.comm_done):
        event.record = refuse
    for stream in (streams.compute, streams.comm):
        stream.wait_event = refuse

    def fn():
        dbo_yield_and_switch_from_compute_to_comm()
        dbo_yield_and_switch_from_comm_to_compute()

    sched.run([fn, fn])
    assert UBatchScheduler("cpu", log=[]).run([lambda: None]) == [None]
    logged = UBatchScheduler("cpu", log=[])
    logged.run([lambda: None])
    assert logged.streams.live_events
