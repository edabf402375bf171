"""dbo's side groups: a second communicator next to an EP group, with its timeout and life.

    ep_group = dist.new_group(timeout=timedelta(seconds=60))  # or dbo.new_group(timeout_s=60)
    layer = MoELayer(config, group=ep_group)    # config: an MoEConfig(backend="a2a", ...)
    ...
    dbo.destroy_group(ep_group)                 # or dist.destroy_process_group(ep_group)

A rank that stops taking part in a step (it failed, or skipped the step) leaves its
peers blocked in their next collective. The group's timeout bounds that wait: the peer's
collective raises (gloo raises in the calling thread; NCCL's watchdog aborts the
communicator), and dbo's notes on the error name the rank, ubatch, layer and phase it
was in.

Some of a step's collectives run on a side group (`side_group`: `a2a`'s count exchange,
the vote on the device), a second process group over the EP group's ranks (its
`twin_group`). A twin is made with the timeout its EP group was made with, however that
group was made (`init_process_group(timeout=...)`, `dist.new_group(timeout=...)`,
`dbo.new_group(timeout_s=...)`): it is read from the group's backend (`group_timeout`);
where torch does not expose it the twin gets torch's default, with a warning.

A twin goes with its EP group: `dbo.destroy_group(group)` destroys the group's twins at
once, then the group. After a plain `dist.destroy_process_group(group)` (or once the
group is garbage), its twins are destroyed at the next point where dbo makes a side
group, a point that every rank reaches in the same order (the new layers' construction,
a new group's first vote on the device), so re-creating groups does not accumulate. The
registry holds EP groups by weak reference, so it keeps no destroyed group alive; a
gloo group's sockets close when its last reference goes.
"""
from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Twin:
    """The twin of an EP group (held weakly) on a backend (None: the default one)."""

    owner: "weakref.ref[dist.ProcessGroup]"
    backend: Optional[str]
    twin: dist.ProcessGroup


# The longest timeout `new_group` takes: a timedelta holds no more (inf overflows it).
# (Its whole days: `timedelta.max.total_seconds()` rounds up to a value that overflows.)
MAX_TIMEOUT_S = float(timedelta.max.days * 24 * 3600)
# Every twin made here, in the order made (process groups are process-wide objects).
_TWINS: list[_Twin] = []
# Groups whose side traffic shares the group's own communicator (logged once each).
_SHARED: "weakref.WeakSet[dist.ProcessGroup]" = weakref.WeakSet()
# What `destroy_group` runs first (`on_group_destroy`).
_ON_DESTROY: list[Callable[[dist.ProcessGroup], None]] = []


def new_group(ranks: Optional[Sequence[int]] = None, *, timeout_s: Optional[float] = None,
              backend: Optional[str] = None) -> dist.ProcessGroup:
    """`torch.distributed.new_group` with the timeout in seconds (checked here: finite,
    > 0 and at most `MAX_TIMEOUT_S`, about 2.7 million years; None: torch's default).

    Collective like every new_group: every rank of the world calls it, in the same order.
    """
    kwargs = {}
    if timeout_s is not None:
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) \
                or not 0 < timeout_s <= MAX_TIMEOUT_S:
            raise ValueError(f"timeout_s={timeout_s!r}: a finite number of seconds > 0 and "
                             f"at most {MAX_TIMEOUT_S:.0f} (the longest timedelta), or None "
                             f"for torch's default")
        kwargs["timeout"] = timedelta(seconds=float(timeout_s))
    return dist.new_group(ranks=None if ranks is None else list(ranks), backend=backend,
                          **kwargs)


def on_group_destroy(callback: Callable[[dist.ProcessGroup], None]) -> None:
    """Have `destroy_group` call `callback(group)` first, for what a layer above the core
    holds per group and must tear down with it (DeepEP's buffers,
    `moe.backends.deepep_support`). Registering the same callback again does nothing."""
    if callback not in _ON_DESTROY:
        _ON_DESTROY.append(callback)


def destroy_group(group: dist.ProcessGroup) -> None:
    """Tear down what was registered for `group` (`on_group_destroy`), destroy its side
    groups, then `group` (`dist.destroy_process_group`).

    Local, like `dist.destroy_process_group(group)`, but the callbacks may be collective:
    every rank of the group calls it after the group's last collective, in the same
    order. For the default group this destroys every group, as torch does.
    """
    for callback in list(_ON_DESTROY):
        callback(group)
    for entry in [e for e in _TWINS if e.owner() is group]:
        _TWINS.remove(entry)
        _destroy_if_live(entry.twin)
    dist.destroy_process_group(group)


def group_timeout(group: Optional[dist.ProcessGroup]) -> Optional[timedelta]:
    """The collective timeout `group` was made with, read from its backend's options;
    None for None, or where torch does not expose it (warned: torch's default applies)."""
    if group is None:
        return None
    timeout = _read_timeout(group)
    if timeout is not None:
        return timeout
    logger.warning("cannot read the collective timeout of process group %r from its "
                   "backend's options: dbo's side group for it gets torch's default "
                   "timeout", group)
    return None


def _read_timeout(group: dist.ProcessGroup) -> Optional[timedelta]:
    """`group`'s collective timeout from its backend's options; None where not exposed."""
    for device_type in getattr(group, "_device_types", ()):
        try:
            options = group._get_backend(torch.device(device_type)).options
        except (AttributeError, RuntimeError):
            continue
        timeout = getattr(options, "_timeout", None)
        if isinstance(timeout, timedelta):
            return timeout
    return None


def describe_group(group: Optional[dist.ProcessGroup]) -> str:
    """`group` in words for an error message: its name, ranks, backend and timeout, e.g.
    "'1' (ranks [0, 1], gloo, timeout 3 s)"; None: the default group. Never raises."""
    if group is None:
        group = dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
        if group is None:
            return "None (torch.distributed not initialized)"
    parts = []
    for read in (lambda g: f"ranks {dist.get_process_group_ranks(g)}",
                 lambda g: str(dist.get_backend(g))):
        try:
            parts.append(read(group))
        except (RuntimeError, ValueError, AttributeError, TypeError):
            pass
    timeout = _read_timeout(group)
    parts.append("torch's default timeout" if timeout is None
                 else f"timeout {timeout.total_seconds():g} s")
    name = getattr(group, "group_name", None)
    return f"{name!r} ({', '.join(parts)})"


def twin_group(group: dist.ProcessGroup, *, backend: Optional[str] = None
               ) -> Optional[dist.ProcessGroup]:
    """A second process group over the same ranks as `group` (on `backend`, or the default
    one), with `group`'s timeout; made on the first call for (group, backend), then cached
    until `group` is destroyed (see the module doc).

    Making a group is collective over the whole world, so call this at a point every rank
    reaches in the same order (a layer's construction, a step's vote). When `group` is a
    subgroup of the world the other ranks are not there: returns None, and the caller
    uses `group` itself.
    """
    if dist.get_world_size(group) != dist.get_world_size():
        return None  # a subgroup, or this rank is not in `group`
    for entry in _TWINS:
        if entry.owner() is group and entry.backend == backend:
            return entry.twin
    _destroy_orphans()
    timeout = group_timeout(group)
    twin = dist.new_group(ranks=list(range(dist.get_world_size())), backend=backend,
                          **({} if timeout is None else {"timeout": timeout}))
    _TWINS.append(_Twin(weakref.ref(group), backend, twin))
    return twin


def side_group(group: Optional[dist.ProcessGroup]) -> Optional[dist.ProcessGroup]:
    """The communicator for `group`'s side traffic (`a2a`'s count exchange, the vote on
    the device): its twin on the same backend, or, for a subgroup of the world, `group`
    itself (logged once). None for None."""
    if group is None:
        return None
    twin = twin_group(group)
    if twin is not None:
        return twin
    if isinstance(group, dist.ProcessGroup) and group not in _SHARED:  # not a sentinel
        logger.info("count exchanges and votes share the EP group's communicator: a separate "
                    "one for a subgroup would need every rank of the world to create it")
        _SHARED.add(group)
    return group


def _live(group: dist.ProcessGroup) -> bool:
    """Whether `group` is still registered with torch (not destroyed)."""
    # torch has no public query for this; destroy_process_group takes the group out of
    # this map (and clears it for the default group).
    return group in dist.distributed_c10d._world.pg_map


def _destroy_if_live(group: dist.ProcessGroup) -> None:
    if _live(group):
        dist.destroy_process_group(group)


def _destroy_orphans() -> None:
    """Destroy the twins of EP groups that were destroyed or collected, in the order made
    (the same on every rank), and forget them."""
    for entry in list(_TWINS):
        owner = entry.owner()
        if owner is None or not _live(owner):
            _TWINS.remove(entry)
            _destroy_if_live(entry.twin)
