"""Process groups with a collective timeout that dbo's own side groups inherit.

    ep_group = dbo.new_group(timeout_s=60)          # all ranks; or ranks=[...]
    layer = MoELayer(config, group=ep_group, backend="a2a")

A rank that stops taking part in a step (it failed, or skipped the step) leaves its
peers blocked in their next collective. The group's timeout bounds that wait: the peer's
collective raises (gloo raises in the calling thread; NCCL's watchdog aborts the
communicator), and dbo's notes on the error name the rank, ubatch, layer and phase it
was in. Groups that dbo creates next to an EP group (the count-exchange communicator of
`a2a`) take the EP group's timeout when it was made here; otherwise torch's default.
"""
from __future__ import annotations

from datetime import timedelta
from typing import Optional, Sequence

import torch.distributed as dist

# Timeouts of the groups made by new_group (process groups are process-wide objects).
_TIMEOUTS: dict[dist.ProcessGroup, timedelta] = {}


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
