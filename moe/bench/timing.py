"""Timing helpers of the benchmarks: medians of CUDA-event times, sustained load, peak
memory (the expert benchmarks; on CPU, one wall-clock call: they run there as smoke
tests), and the barrier that aligns the ranks before a timed call (`barrier`: the comm
benchmark's `moe.bench.comm_timing` and `dbo bench`'s `dbo.cli.bench.timing`).
"""
from __future__ import annotations

import statistics
import time
from typing import Callable, Optional

import torch
import torch.distributed as dist


def time_ms(fn: Callable[[], object], device: torch.device, budget_ms: float, *,
            during: Callable[[], object] | None = None) -> float:
    """Median milliseconds of `fn` after one warmup, over repeats filling ~budget_ms.
    `during` is called once while the timed calls run on the GPU (after they are queued)."""
    fn()
    if device.type != "cuda":
        start = time.perf_counter()
        fn()
        elapsed = (time.perf_counter() - start) * 1e3
        if during is not None:
            during()
        return elapsed
    probe = statistics.median(event_times(fn, device, 3))
    reps = int(min(50, max(5, budget_ms / max(probe, 1e-3))))
    return statistics.median(event_times(fn, device, reps, during=during))


def event_times(fn: Callable[[], object], device: torch.device, reps: int, *,
                 during: Callable[[], object] | None = None) -> list[float]:
    """Per-call milliseconds from CUDA events around each of `reps` back-to-back calls;
    `during()` runs on the host after the last call is queued, before the sync."""
    events = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        for _ in range(reps)
    ]
    for start, end in events:
        start.record()
        fn()
        end.record()
    if during is not None:
        during()
    torch.cuda.synchronize(device)
    return [start.elapsed_time(end) for start, end in events]


def sustain(fn: Callable[[], object], device: torch.device, seconds: float) -> int:
    """Call `fn` back to back for about `seconds` (syncing every few calls, so the host
    never runs far ahead); returns the number of calls."""
    calls, deadline = 0, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        for _ in range(4):
            fn()
        calls += 4
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return calls


def peak_gb(fn: Callable[[], object], device: torch.device) -> float | None:
    """Peak allocated GB over one call of `fn` (everything live counts, inputs included)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    result = fn()
    torch.cuda.synchronize(device)
    del result
    return torch.cuda.max_memory_allocated(device) / 1e9


def barrier(group: Optional[dist.ProcessGroup], device: torch.device) -> None:
    """Align the ranks of `group` (no-op without one or without torch.distributed). On
    CUDA the barrier names `device`, so that NCCL runs it there rather than on the device
    it guesses from the rank."""
    if group is None or not dist.is_initialized():
        return
    if device.type == "cuda":
        dist.barrier(group=group, device_ids=[device.index])
    else:
        dist.barrier(group=group)
