"""Process groups with a collective timeout that dbo's own side groups inherit.

    ep_group = dbo.new_group(timeout_s=60)          # all ranks; or ranks=[...]
    layer = MoELayer(config, group=ep_group, backend="a2a")

A rank that stops taking part in a step (it failed, or skipped the step) leaves its
peers blocked in their next collective. The group's timeout bounds that wait: the peer's
collective raises (gloo raises in the calling thread; NCCL's watchdog aborts the
communicator), and dbo's notes on the error name the rank, ubatch, layer and phase it
was in. Groups that dbo creates next to an EP group (`twin_group`: the communicator of
`a2a`'s count exchange and of the vote) take the EP group's timeout when
it was made here; otherwise torch's default.
"""
from __future__ import annotations

import logging
from datetime import timedelta
from typing import Optional, Sequence

import torch.distributed as dist

logger = logging.getLogger(__name__)

# Timeouts of the groups made by new_group (process groups are process-wide objects).
_TIMEOUTS: dict[dist.ProcessGroup, timedelta] = {}
# (group, backend) -> its twin (see twin_group); None where none can be made.
_TWINS: dict[tuple[dist.ProcessGroup, Optional[str]], Optional[dist.ProcessGroup]] = {}
# Groups whose side traffic shares the group's own communicator (logged once each).
_SHARED: set[dist.ProcessGroup] = set()


def new_group(ranks: Optional[Sequence[int]] = None, *, timeout_s: Optional[float] = None,
              backend: Optional[str] = None) -> dist.ProcessGroup:
    """`torch.distributed.new_group` whose timeout dbo's side groups reuse.

    Collective like every new_group: every rank of the world calls it, in the same order.
    """
    kwargs = {}
    if timeout_s is not None:
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) \
                or not timeout_s > 0:
            raise ValueError(f"timeout_s={timeout_s!r}: a number of seconds > 0, or None "
                             f"for torch's default")
        kwargs["timeout"] = timedelta(seconds=float(timeout_s))
    group = dist.new_group(ranks=None if ranks is None else list(ranks), backend=backend,
                           **kwargs)
    if "timeout" in kwargs:
        _TIMEOUTS[group] = kwargs["timeout"]
    return group


def group_timeout(group: Optional[dist.ProcessGroup]) -> Optional[timedelta]:
    """The timeout `group` was made with here, or None when unknown (torch's default)."""
    return None if group is None else _TIMEOUTS.get(group)


def twin_group(group: dist.ProcessGroup, *, backend: Optional[str] = None
               ) -> Optional[dist.ProcessGroup]:
    """A second process group over the same ranks as `group` (on `backend`, or the default
    one), with `group`'s timeout; made on the first call for (group, backend), then cached.

    Making a group is collective over the whole world, so call this at a point every rank
    reaches in the same order (a layer's construction, a step's vote). When `group` is a
    subgroup of the world the other ranks are not there: returns None, and the caller
    uses `group` itself.
    """
    key = (group, backend)
    if key not in _TWINS:
        twin = None
        if dist.get_world_size(group) == dist.get_world_size():
            timeout = group_timeout(group)
            twin = dist.new_group(ranks=list(range(dist.get_world_size())), backend=backend,
                                  **({} if timeout is None else {"timeout": timeout}))
            if timeout is not None:
                _TIMEOUTS[twin] = timeout
        _TWINS[key] = twin
    return _TWINS[key]


def side_group(group: Optional[dist.ProcessGroup]) -> Optional[dist.ProcessGroup]:
    """The communicator for `group`'s side traffic (`a2a`'s count exchange, the vote on
    the device): its twin on the same backend, or, for a subgroup of the world, `group`
    itself (logged once). None for None."""
    if group is None:
        return None
    twin = twin_group(group)
    if twin is not None:
        return twin
    if group not in _SHARED:
        logger.info("count exchanges and votes share the EP group's communicator: a separate "
                    "one for a subgroup would need every rank of the world to create it")
        _SHARED.add(group)
    return group
