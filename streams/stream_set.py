"""The streams and events of one DBO step.

One compute stream (the caller's current stream when the step starts) and one comm
stream, both shared by the two ubatches; per-ubatch events order each ubatch's own work
across the two streams:

    compute_done[u]  recorded on compute by ubatch u before it hands work to comm
    comm_done[u]     recorded on comm by ubatch u before it hands work back to compute

Events are per ubatch, never shared: an event recorded on the shared compute stream
after a yield would also cover the other ubatch's queued work and serialise the step.
On CPU the same API is backed by stand-ins (see `streams.standins`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from streams.current import CurrentStream
from streams.standins import OpLog, StandInEvent, StandInStream

# One comm stream per device for the whole process: created once, reused by every step.
_COMM_STREAMS: dict[int, "torch.cuda.Stream"] = {}


def new_comm_stream(device: torch.device | int) -> "torch.cuda.Stream":
    """A CUDA stream for communication kernels, at the device's highest priority.

    Why: a comm kernel queued while a large compute grid is running gets SMs only as the
    grid's blocks retire, and at equal priority the block scheduler keeps handing them
    to the compute grid, so the transfer can start a whole GEMM late (measured: 1.9 ms
    behind a fused-MoE GEMM on an H200). At higher priority its few blocks are placed as
    soon as any SM frees up.
    """
    _, highest = torch.cuda.Stream.priority_range()  # (least, greatest): greatest is lowest
    return torch.cuda.Stream(device=device, priority=highest)


def comm_stream_for(device: torch.device) -> "torch.cuda.Stream":
    """The process-wide comm stream of a CUDA device (created on first use, high priority)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _COMM_STREAMS.get(index)
    if stream is None:
        stream = new_comm_stream(index)
        _COMM_STREAMS[index] = stream
    return stream


@dataclass
class StreamSet:
    """Compute and comm streams plus per-ubatch events for one step on one device."""

    compute: Any
    comm: Any
    compute_done: list[Any]
    comm_done: list[Any]
    current: CurrentStream
    is_cuda: bool
    live_events: bool
    """Whether recording or waiting on an event does anything: on CUDA, or with stand-ins
    that log. The per-hand-off yield points skip the calls when it is False."""

    @classmethod
    def create(cls, device: torch.device | str | None = None, *, num_ubatches: int = 2,
               log: Optional[OpLog] = None) -> "StreamSet":
        """Streams for a step on `device` (None: the current CUDA device, else CPU).

        On CUDA the compute stream is the thread's current stream now; on CPU, stand-ins
        whose operations are appended to `log` when given.
        """
        device = resolve_device(device)
        if device.type == "cuda":
            with torch.cuda.device(device):
                compute = torch.cuda.current_stream()
                comm = comm_stream_for(device)
                compute_done = [torch.cuda.Event() for _ in range(num_ubatches)]
                comm_done = [torch.cuda.Event() for _ in range(num_ubatches)]
            return cls(compute, comm, compute_done, comm_done,
                       CurrentStream(compute, is_cuda=True), True, True)
        compute = StandInStream("compute", log)
        comm = StandInStream("comm", log)
        return cls(compute, comm,
                   [StandInEvent(f"compute_done[{u}]", log) for u in range(num_ubatches)],
                   [StandInEvent(f"comm_done[{u}]", log) for u in range(num_ubatches)],
                   CurrentStream(compute, is_cuda=False), False, log is not None)


def resolve_device(device: torch.device | str | None) -> torch.device:
    """None -> the current CUDA device when CUDA is available, else CPU."""
    if device is None:
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device
