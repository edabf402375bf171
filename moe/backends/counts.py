"""Count exchange off the comm stream, for backends that need split sizes on the host.

Shape legend: W ranks.

On the single in-order comm stream a count exchange queues behind the data transfers
already there (the other ubatch's dispatch), so the host, which needs the counts, waits
for those transfers too, and the next dispatch starts late. `CountExchange.start` issues
the exchange at once on a side CUDA stream (high priority, like the comm stream) and a
communicator of its own (a second process group over the same ranks), copies the result
to pinned host memory without blocking, and returns a `PendingCounts`; `result()` later
waits for that copy alone.

The side group (`dbo.groups.side_group`, which the vote uses too) is created once per EP
group (collectively, in construction order, like every process group), with the EP
group's timeout however that group was made, and destroyed with it (`dbo.groups`). When
the EP group is a subgroup of the world, creating one would need every rank of the world
to join, so the exchange then shares the EP group's communicator (still on the side
stream). On CPU (gloo) the exchange runs synchronously.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from dbo.failures import note_collective
from dbo.groups import side_group
from streams.stream_set import new_comm_stream

class PendingCounts:
    """Counts on their way to the host; `result()` returns (sent, received) per rank."""

    def __init__(self, host_2W: Tensor, event: Optional["torch.cuda.Event"]) -> None:
        self._host = host_2W
        self._event = event

    def result(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        if self._event is not None:
            self._event.synchronize()
        values = self._host.tolist()
        half = len(values) // 2
        return tuple(values[:half]), tuple(values[half:])


class CountExchange:
    """All-to-all of per-rank counts on a side stream and communicator."""

    def __init__(self, group: Optional[dist.ProcessGroup]) -> None:
        self.ep_group = group  # the group a failed step is recorded against (dbo.failures)
        self.group = side_group(group)
        self._streams: dict[int, torch.cuda.Stream] = {}

    def start(self, send_counts_W: Tensor) -> PendingCounts:
        """Start exchanging `send_counts_W` (int64 [W], on the current stream's device)."""
        recv_counts_W = torch.empty_like(send_counts_W)
        if not send_counts_W.is_cuda:
            note_collective("all_to_all_single (counts)", self.ep_group)
            dist.all_to_all_single(recv_counts_W, send_counts_W, group=self.group)
            return PendingCounts(torch.cat([send_counts_W, recv_counts_W]), None)
        device = send_counts_W.device
        stream = self._streams.get(device.index)
        if stream is None:
            stream = self._streams[device.index] = new_comm_stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))  # the counts are computed there
        host_2W = torch.empty(2 * send_counts_W.shape[0], dtype=torch.int64, pin_memory=True)
        with torch.cuda.stream(stream):  # no yield inside: the stream is restored on exit
            note_collective("all_to_all_single (counts)", self.ep_group)
            dist.all_to_all_single(recv_counts_W, send_counts_W, group=self.group)
            world = send_counts_W.shape[0]
            host_2W[:world].copy_(send_counts_W, non_blocking=True)
            host_2W[world:].copy_(recv_counts_W, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        send_counts_W.record_stream(stream)
        recv_counts_W.record_stream(stream)
        return PendingCounts(host_2W, event)
