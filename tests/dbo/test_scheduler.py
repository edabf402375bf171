"""Layer 1 (CPU): the ubatch scheduler's order, containment, reuse and thread state."""
from __future__ import annotations

import contextvars

import greenlet
import pytest
import torch

import dbo
from dbo import UBatchScheduler, dbo_current_ubatch_id, dbo_yield


def logging_ubatch(log: list, num_yields: int, tag: object = None):
    def fn():
        ub = dbo_current_ubatch_id()
        for step in range(num_yields):
            log.append((ub, step))
            dbo_yield()
        log.append((ub, "end"))
        return tag if tag is not None else ub
    return fn


def test_interleaving_equal_yields():
    log: list = []
    out = UBatchScheduler("cpu").run([logging_ubatch(log, 3), logging_ubatch(log, 3)])
    assert out == [0, 1]
    assert log == [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2), (0, "end"), (1, "end")]


def test_interleaving_unequal_yields_runs_survivor_to_end():
    log: list = []
    UBatchScheduler("cpu").run([logging_ubatch(log, 1), logging_ubatch(log, 4)])
    assert log == [(0, 0), (1, 0), (0, "end"), (1, 1), (1, 2), (1, 3), (1, "end")]


def test_ubatch_without_yields():
    log: list = []
    UBatchScheduler("cpu").run([logging_ubatch(log, 0), logging_ubatch(log, 2)])
    assert log == [(0, "end"), (1, 0), (1, 1), (1, "end")]
    log.clear()
    UBatchScheduler("cpu").run([logging_ubatch(log, 2), logging_ubatch(log, 0)])
    assert log == [(0, 0), (1, "end"), (0, 1), (0, "end")]


def test_single_ubatch_and_results_in_order():
    log: list = []
    assert UBatchScheduler("cpu").run([logging_ubatch(log, 2, tag="x")]) == ["x"]
    assert log == [(0, 0), (0, 1), (0, "end")]


def test_runs_on_calling_thread_in_greenlets():
    hub = greenlet.getcurrent()
    seen = []

    def fn():
        seen.append(greenlet.getcurrent() is not hub)
        dbo_yield()
        return None

    UBatchScheduler("cpu").run([fn, fn])
    assert seen == [True, True]


def test_exception_unwinds_other_and_reraises_with_ubatch_id():
    unwound = []

    def ok():
        try:
            for _ in range(5):
                dbo_yield()
        except greenlet.GreenletExit:
            unwound.append("exit")
            raise
        finally:
            dbo_yield()  # cleanup that yields must not hang or switch during the abort
            unwound.append("finally")

    def bad():
        dbo_yield()
        raise KeyError("boom")

    sched = UBatchScheduler("cpu")
    with pytest.raises(KeyError, match="boom") as info:
        sched.run([ok, bad])
    assert info.value.dbo_ubatch_id == 1
    assert any("ubatch 1" in n for n in getattr(info.value, "__notes__", []))
    assert unwound == ["exit", "finally"]
    assert not dbo.dbo_enabled()
    # Reusable afterwards, with the same deterministic order.
    log: list = []
    sched.run([logging_ubatch(log, 1), logging_ubatch(log, 1)])
    assert log == [(0, 0), (1, 0), (0, "end"), (1, "end")]


def test_exception_in_first_before_second_started():
    started = []

    def bad():
        raise ValueError("early")

    def never():
        started.append(1)

    with pytest.raises(ValueError, match="early") as info:
        UBatchScheduler("cpu").run([bad, never])
    assert info.value.dbo_ubatch_id == 0
    assert started == []


def test_nested_run_is_rejected():
    sched = UBatchScheduler("cpu")

    def nested():
        sched.run([lambda: 1])

    with pytest.raises(RuntimeError, match="nested"):
        UBatchScheduler("cpu").run([nested])


@pytest.mark.parametrize("fns, exc, match", [
    ([], ValueError, "no ubatches"),
    ([lambda: 1] * 3, ValueError, "at most 2"),
    ([lambda: 1, 5], TypeError, "ubatch 1 is a int"),
    ("ab", TypeError, "list of callables"),
])
def test_bad_input(fns, exc, match):
    with pytest.raises(exc, match=match):
        UBatchScheduler("cpu").run(fns)


_CONTEXT_VAR: contextvars.ContextVar = contextvars.ContextVar("test_scheduler", default=None)


def test_ubatches_run_in_copies_of_the_callers_context():
    """A context variable the caller set is seen in both ubatches (a bare greenlet would
    start in an empty context); one a ubatch sets reaches neither the other nor the
    caller."""
    seen: list = []

    def ubatch(value: str):
        def fn():
            seen.append((dbo_current_ubatch_id(), _CONTEXT_VAR.get()))
            _CONTEXT_VAR.set(value)
            dbo_yield()
            seen.append((dbo_current_ubatch_id(), _CONTEXT_VAR.get()))
        return fn

    token = _CONTEXT_VAR.set("caller")
    try:
        UBatchScheduler("cpu").run([ubatch("zero"), ubatch("one")])
        assert _CONTEXT_VAR.get() == "caller"
    finally:
        _CONTEXT_VAR.reset(token)
    assert seen == [(0, "caller"), (1, "caller"), (0, "zero"), (1, "one")]


def test_grad_mode_is_per_ubatch():
    seen = {}

    def no_grad_ub():
        with torch.no_grad():
            dbo_yield()
            seen["ub0_after_yield"] = torch.is_grad_enabled()
            dbo_yield()

    def grad_ub():
        seen["ub1_first"] = torch.is_grad_enabled()
        dbo_yield()
        seen["ub1_second"] = torch.is_grad_enabled()

    assert torch.is_grad_enabled()
    UBatchScheduler("cpu").run([no_grad_ub, grad_ub])
    assert seen == {"ub1_first": True, "ub0_after_yield": False, "ub1_second": True}
    assert torch.is_grad_enabled()


def test_autocast_is_per_ubatch_and_restored():
    seen = {}

    def autocast_ub():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            dbo_yield()
            seen["ub0"] = torch.is_autocast_enabled("cpu")

    def plain_ub():
        seen["ub1"] = torch.is_autocast_enabled("cpu")
        dbo_yield()

    UBatchScheduler("cpu").run([autocast_ub, plain_ub])
    assert seen == {"ub1": False, "ub0": True}
    assert not torch.is_autocast_enabled("cpu")


def test_state_restored_after_failure():
    def bad():
        torch.set_grad_enabled(False)
        raise RuntimeError("x")

    with pytest.raises(RuntimeError):
        UBatchScheduler("cpu").run([bad])
    assert torch.is_grad_enabled()


def test_run_ranges_mark_which_ubatch_holds_the_thread(tmp_path):
    from torch.profiler import ProfilerActivity, profile

    from dbo.ranges import TraceConfig, configure
    from traces.readers import read_chrome_trace

    configure(TraceConfig(record_function=True))
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            UBatchScheduler("cpu").run([logging_ubatch([], 2), logging_ubatch([], 1)])
    finally:
        configure(TraceConfig())
    prof.export_chrome_trace(str(tmp_path / "t.json"))
    runs = sorted((lb for lb in read_chrome_trace(tmp_path / "t.json").labels
                   if lb.phase == "run"), key=lambda lb: lb.start_us)
    assert [lb.ubatch for lb in runs] == [0, 1, 0, 1, 0]
    for a, b in zip(runs, runs[1:]):
        assert a.end_us <= b.start_us  # one holder at a time
