"""Layer 2 (two gloo processes): dbo's side groups follow the user's process group.

- A timeout given to torch (`init_process_group(timeout=...)` or `dist.new_group(timeout=
  ...)`) bounds every collective of a step, the `a2a` count exchange on its side group
  included: a peer left waiting fails within it, with dbo's notes naming its place.
- Re-creating the EP group (new group, new `a2a` layer, a step, destroy the group) keeps
  this process's open file descriptors flat, whether the group came from `dbo.new_group`
  or `dist.new_group`, destroyed by `dist.destroy_process_group` or `dbo.destroy_group`.

The in-process test first: a group whose timeout cannot be read is said so (layer 1).
"""
from __future__ import annotations

from dataclasses import replace
import logging
import os
import time
from datetime import timedelta
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist

import dbo
from dbo.groups import group_timeout
from moe import MoEConfig, MoELayer, init_moe_weights
from tests.dist_utils import run_distributed

# Short, as the test waits it out twice; the ranks meet in the group's construction just
# before the step, so the peer reaches the vote well within it even on a loaded machine.
TIMEOUT_S = 2.0
# Well under torch's 30-minute default: the peer is freed by TIMEOUT_S, not by the failed
# rank leaving (it stays connected until BOUND_S has passed).
BOUND_S = 20.0
STEP = dbo.DBOConfig(split="tokens", min_decode_tokens=2)


class Injected(KeyError):
    """The failure injected on one rank."""


def ep_layer(group: dist.ProcessGroup) -> MoELayer:
    cfg = MoEConfig(num_experts=4, top_k=2, hidden_size=16, intermediate_size=8)
    layer = MoELayer(replace(cfg, backend="a2a", experts="reference"), group=group)
    layer.load_weights(init_moe_weights(cfg, seed=2))
    return layer


def outcome(step: Callable[[], Any]) -> dict:
    """Run `step`; report the exception it raised (type, notes, seconds until raised)."""
    start = time.monotonic()
    try:
        with torch.no_grad():
            step()
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return {"type": type(exc).__name__, "notes": "\n".join(getattr(exc, "__notes__", [])),
                "elapsed": time.monotonic() - start}
    return {"type": None, "elapsed": time.monotonic() - start}


def test_group_timeout_says_when_it_cannot_read_the_backend(
        caplog: pytest.LogCaptureFixture) -> None:
    class NoOptions:
        _device_types = [torch.device("cpu").type]

        def _get_backend(self, device: torch.device) -> object:
            return object()

    with caplog.at_level(logging.WARNING, logger="dbo.groups"):
        assert group_timeout(NoOptions()) is None  # type: ignore[arg-type]
    assert "torch's default" in caplog.text


# ------------------------------------------------------------------ two gloo ranks
def peer_fails_after_the_vote(rank: int, world_size: int) -> dict[str, dict]:
    """Per way of giving torch the timeout: rank 1 fails inside the model after the vote,
    rank 0 is left in the count exchange; what each rank's step raised."""
    results = {}
    for made_by in ("init_process_group", "dist.new_group"):
        if made_by == "init_process_group":
            group = dist.group.WORLD  # run_distributed's init_timeout_s
        else:
            group = dist.new_group(timeout=timedelta(seconds=TIMEOUT_S))
        timeout = group_timeout(group)
        layer = ep_layer(group)
        runner = dbo.DBORunner(layer, STEP, group=group)
        store = dist.distributed_c10d._get_default_store()
        if rank == 1:
            def router_fails(*args: Any, **kwargs: Any) -> Any:
                raise Injected("boom")  # after the vote, before the count exchange

            layer.router.forward = router_fails
            results[made_by] = outcome(lambda: runner(torch.randn(12, 16)))
            # Stay connected until rank 0 has failed (leaving would free it at once).
            try:
                store.wait([f"rank 0 failed, {made_by}"], timedelta(seconds=BOUND_S + 5))
            except RuntimeError:
                return results  # rank 0 is still waiting: leave, which frees it
        else:
            results[made_by] = {**outcome(lambda: runner(torch.randn(12, 16))),
                                "timeout": timeout}
            if results[made_by]["elapsed"] >= BOUND_S:
                return results  # freed by rank 1 leaving: there is no next case
            store.set(f"rank 0 failed, {made_by}", "1")
    return results


def test_new_group_refuses_a_timeout_torch_cannot_hold_naming_the_bound() -> None:
    # No process group is made: the timeout is checked before torch is called.
    for timeout_s in (float("inf"), 1e20, float("nan")):
        with pytest.raises(ValueError, match=r"timeout_s=.*: a finite number of seconds > 0 "
                                             r"and at most 86399999913600 \(the longest"):
            dbo.new_group(timeout_s=timeout_s)


@pytest.mark.distributed
def test_a_timeout_given_to_torch_bounds_the_count_exchange() -> None:
    waiting, failed = run_distributed(2, peer_fails_after_the_vote, init_timeout_s=TIMEOUT_S)
    for made_by in ("init_process_group", "dist.new_group"):
        assert failed[made_by]["type"] == "Injected", (made_by, failed)
        result = waiting[made_by]
        assert result["type"] == "RuntimeError", (made_by, result)
        assert "[dbo] rank 0, ubatch 0, layer 0, phase dispatch_send" in result["notes"], \
            (made_by, result)
        assert "re-create the process group" in result["notes"]
        assert 0.9 * TIMEOUT_S <= result["elapsed"] < BOUND_S, (made_by, result["elapsed"])
        assert result["timeout"] == timedelta(seconds=TIMEOUT_S)  # read from the group


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def fds_over_recreations(rank: int, world_size: int, cycles: int) -> dict[str, list]:
    """Per way of making the group: (open files, process groups torch holds) after each
    cycle; the cycles alternate `dist.destroy_process_group` and `dbo.destroy_group`."""
    makers = {
        "dbo.new_group": lambda: dbo.new_group(timeout_s=60),
        "dist.new_group": lambda: dist.new_group(timeout=timedelta(seconds=60)),
    }
    destroyers = (dist.destroy_process_group, dbo.destroy_group)
    counts = {}
    for name, make in makers.items():
        counts[name] = []
        for cycle in range(cycles):
            group = make()
            runner = dbo.DBORunner(ep_layer(group), STEP, group=group)
            with torch.no_grad():
                runner(torch.randn(12, 16))
            destroyers[cycle % 2](group)
            del runner, group
            counts[name].append((open_fds(), len(dist.distributed_c10d._world.pg_map)))
    return counts


@pytest.mark.distributed
def test_recreating_the_group_keeps_open_files_flat() -> None:
    # Cycles 6-7 against 2-3: a file left open per cycle (or per destroyer, every other
    # cycle) is 2 or more files over the warm count there.
    cycles = 8
    for counts in run_distributed(2, fds_over_recreations, cycles):
        for how, after in counts.items():
            fds = [f for f, _ in after]
            # Flat once warm (the first cycles may open what every later one reuses),
            # per destroyer: a plain destroy leaves the side group until the next one.
            assert all(late <= warm for late, warm in zip(fds[-2:], fds[2:4])), (how, fds)
            # dbo.destroy_group takes the side group down with the group, at once: torch
            # holds the default group alone.
            assert all(groups == 1 for _, groups in after[1::2]), (how, after)


def teardown_calls(rank: int, world_size: int) -> list[str]:
    seen: list[str] = []

    def note(group: dist.ProcessGroup) -> None:
        seen.append(f"callback sees {dist.get_world_size(group)} ranks")

    from dbo.groups import _ON_DESTROY, on_group_destroy
    try:
        on_group_destroy(note)
        on_group_destroy(note)  # once is enough
        group = dbo.new_group(timeout_s=30)
        dbo.destroy_group(group)  # the callback runs first, while the group is usable
        seen.append(f"destroyed: {group not in dist.distributed_c10d._world.pg_map}")
    finally:
        _ON_DESTROY.remove(note)  # the forked rank is reused by later tests
    return seen


@pytest.mark.distributed
def test_destroy_group_runs_the_registered_teardowns_first() -> None:
    for seen in run_distributed(2, teardown_calls):
        assert seen == ["callback sees 2 ranks", "destroyed: True"]
