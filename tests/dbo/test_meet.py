"""Layer 1 (CPU, no ranks): where the two ubatches of a step meet (`dbo.meet`,
`dbo_meet`): the second to arrive runs the work once for both, each gets its own result;
the first waits by yielding and runs the hooks handed to it meanwhile; a meeting the other
ubatch never reaches raises instead of spinning; outside a step and with one ubatch the
work runs at once."""
from __future__ import annotations

import pytest

from dbo import UBatchScheduler
from dbo.yield_points import (dbo_joined_experts, dbo_meet, dbo_register_recv_hook,
                              dbo_yield)


def test_the_second_to_arrive_runs_the_work_once_for_both_in_ubatch_order():
    calls, order = [], []

    def work(values):
        calls.append(list(values))
        return [v * 10 for v in values]

    def ubatch(u, yields_before):
        def run():
            for _ in range(yields_before):
                dbo_yield()
            order.append(f"ub{u} arrives")
            got = dbo_meet("layer0", u + 1, work)
            order.append(f"ub{u} leaves")
            return got
        return run

    # ub1 arrives first (ub0 yields twice before it reaches the meeting)
    assert UBatchScheduler("cpu").run([ubatch(0, 2), ubatch(1, 0)]) == [10, 20]
    assert calls == [[1, 2]]  # one call, values by ubatch id, not by arrival
    assert order == ["ub1 arrives", "ub0 arrives", "ub0 leaves", "ub1 leaves"]


def test_meetings_at_one_key_in_turn_and_at_several_keys():
    def ubatch(u):
        def run():
            return [dbo_meet(key, u, lambda vs: [sum(vs)] * 2) for key in ("a", "b", "a")]
        return run

    assert UBatchScheduler("cpu").run([ubatch(0), ubatch(1)]) == [[1, 1, 1]] * 2


def test_the_waiting_ubatch_runs_the_hooks_handed_to_it():
    events = []

    def ub0():
        return dbo_meet("k", 0, lambda vs: [events.copy(), events.copy()])

    def ub1():
        dbo_register_recv_hook(lambda: events.append("ub1's receive"))
        dbo_yield()  # ub0 is waiting at the meeting: it must run the hook
        return dbo_meet("k", 1, lambda vs: [events.copy(), events.copy()])

    out0, out1 = UBatchScheduler("cpu").run([ub0, ub1])
    assert out0 == out1 == ["ub1's receive"]


def test_a_meeting_the_other_ubatch_never_reaches_raises():
    def ub0():
        return dbo_meet("only ub0", 0, lambda vs: vs)

    with pytest.raises(RuntimeError, match="waits at 'only ub0' for ubatch 1, which "
                                           "finished without reaching it"):
        UBatchScheduler("cpu").run([ub0, lambda: None])


def test_work_must_return_one_result_per_ubatch():
    def ubatch(u):
        return lambda: dbo_meet("k", u, lambda vs: [sum(vs)])

    with pytest.raises(TypeError, match="one result per ubatch \\(2\\), got list of 1"):
        UBatchScheduler("cpu").run([ubatch(0), ubatch(1)])


def test_outside_a_step_and_with_one_ubatch_the_work_runs_at_once():
    assert dbo_meet("k", 3, lambda vs: [vs[0] + 1]) == 4
    assert UBatchScheduler("cpu").run([lambda: dbo_meet("k", 3, lambda vs: [vs])]) == [[3]]


def test_joined_experts_holds_in_a_step_of_two_only_and_is_cleared_after_it():
    scheduler = UBatchScheduler("cpu")
    assert scheduler.run([dbo_joined_experts, dbo_joined_experts],
                         joined_experts=True) == [True, True]
    assert scheduler.run([dbo_joined_experts], joined_experts=True) == [False]
    assert scheduler.run([dbo_joined_experts, dbo_joined_experts]) == [False, False]
    assert dbo_joined_experts() is False


def test_a_failed_step_leaves_no_meeting_behind():
    scheduler = UBatchScheduler("cpu")

    def fails():
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        scheduler.run([lambda: dbo_meet("k", 0, lambda vs: vs), fails])
    # the next step meets at the same key afresh
    assert scheduler.run([lambda: dbo_meet("k", 0, lambda vs: [vs, vs]),
                          lambda: dbo_meet("k", 1, lambda vs: [vs, vs])]) == [[0, 1]] * 2


def test_ubatches_waiting_at_different_keys_raise_instead_of_waiting_for_ever():
    def at(key):
        return lambda: dbo_meet(key, 0, lambda vs: vs)

    # ubatch 0 waits first; ubatch 1, arriving at another key, sees it and raises.
    with pytest.raises(RuntimeError, match="ubatch 1 waits at 'layer 2' while ubatch 0 "
                                           "waits at 'layer 1'"):
        UBatchScheduler("cpu").run([at("layer 1"), at("layer 2")])
