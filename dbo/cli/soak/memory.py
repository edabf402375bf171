"""Memory samples and the flatness verdict of the soak run."""
from __future__ import annotations

import gc
import os
import tracemalloc
from dataclasses import astuple, dataclass
from typing import Callable, Optional

import torch
from torch import Tensor

from dbo.cli.soak.config import MAX_OBJECT_GROWTH, MAX_TENSOR_GROWTH


# ------------------------------------------------------------------------------ memory
@dataclass(frozen=True, kw_only=True)
class MemorySample:
    """One rank's memory between steps, after gc.collect()."""

    step: int
    """Steps completed."""
    traced_bytes: Optional[int]
    """Python-heap bytes allocated since tracing started (warmup or the window's start) and
    still alive (CPU; tracemalloc), else None."""
    objects: int
    """gc-tracked Python objects."""
    tensors: int
    """Tensors reachable from Python (gc-tracked)."""
    tensor_bytes: int
    """Bytes of the distinct storages of those tensors."""
    cuda_allocated: Optional[int]
    """torch.cuda.memory_allocated() on the rank's GPU, else None."""
    workspace_bytes: int
    """Bytes of the MoE layers' scratch workspaces."""
    rss_bytes: Optional[int]
    """Process resident set size (/proc/self/statm); None where unavailable."""


@dataclass(frozen=True, kw_only=True)
class MemoryVerdict:
    """Growth from the baseline to the last sample, and whether it stayed in bounds."""

    growth: dict[str, Optional[int]]
    """Growth of every MemorySample field (None where not measured)."""
    checked: dict[str, tuple[int, int]]
    """Each asserted quantity: (growth, bound)."""

    @property
    def ok(self) -> bool:
        return all(g <= b for g, b in self.checked.values())


class MemoryTracker:
    """Samples this process's memory between steps.

    `start` takes the baseline; with `trace_python`, tracemalloc runs from there on, or,
    with `trace_window`, from each `begin_window` to the next `record`.
    """

    def __init__(self, device: torch.device, *, trace_python: bool, trace_window: int = 0,
                 workspace_bytes: Callable[[], int] = lambda: 0) -> None:
        self.device = device
        self.trace_python = trace_python
        self.trace_window = trace_window
        self.workspace_bytes = workspace_bytes
        # Samples kept as plain tuples of ints: gc untracks those, so the tracker's own
        # history does not show up as object growth.
        self._rows: list[tuple] = []
        self._tracing = False

    @property
    def samples(self) -> list[MemorySample]:
        """The baseline, then every recorded sample."""
        return [MemorySample(**dict(zip(MemorySample.__dataclass_fields__, row)))
                for row in self._rows]

    def start(self, step: int) -> None:
        if self.trace_python and not self.trace_window:
            self._start_tracing()
        self._rows = [astuple(self.sample(step))]

    def begin_window(self) -> None:
        if self.trace_python and self.trace_window:
            self._start_tracing()

    def record(self, step: int) -> MemorySample:
        sample = self.sample(step)
        self._rows.append(astuple(sample))
        if self.trace_window:
            self.stop()
        return sample

    def stop(self) -> None:
        if self._tracing:
            tracemalloc.stop()
            self._tracing = False

    def _start_tracing(self) -> None:
        if tracemalloc.is_tracing():
            raise RuntimeError("tracemalloc is already tracing in this process: the soak "
                               "needs it to itself (its counts start from zero)")
        tracemalloc.start(1)  # one frame: the cheapest tracing
        self._tracing = True

    def sample(self, step: int) -> MemorySample:
        gc.collect()
        objects = gc.get_objects()
        tensors, storages = 0, {}
        for obj in objects:
            # type(), not isinstance(obj): some objects warn on any attribute access.
            if issubclass(type(obj), Tensor):
                tensors += 1
                try:
                    storage = obj.untyped_storage()
                    storages[storage.data_ptr()] = storage.nbytes()
                except (RuntimeError, NotImplementedError):
                    pass  # no data of its own (a fake tensor torch.compile left alive)
        num_objects = len(objects)
        del objects
        cuda = None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            cuda = torch.cuda.memory_allocated(self.device)
        traced = tracemalloc.get_traced_memory()[0] if self._tracing else None
        return MemorySample(step=step, traced_bytes=traced, objects=num_objects,
                            tensors=tensors, tensor_bytes=sum(storages.values()),
                            cuda_allocated=cuda, workspace_bytes=self.workspace_bytes(),
                            rss_bytes=_rss_bytes())

    def verdict(self, bound_bytes: int) -> MemoryVerdict:
        """Growth from the baseline to the last sample, checked against the bounds.

        The checks take the smaller of the last two samples: an isolated sample can catch
        the tensors of the step's last collective before the communication thread has let
        go of them (seen on gloo under load: +1 or +2 tensors), while a leak raises both.
        """
        samples = self.samples
        first, last = samples[0], samples[-1]
        tail = samples[1:][-2:]
        growth = {}
        for name in MemorySample.__dataclass_fields__:
            if name != "step":
                a, b = getattr(first, name), getattr(last, name)
                growth[name] = None if a is None or b is None else b - a

        def settled(value: Callable[[MemorySample], int]) -> int:
            return min(value(x) for x in tail) - value(first)

        storage = "cuda_allocated" if growth["cuda_allocated"] is not None else "tensor_bytes"
        checked = {
            f"{storage}_less_workspace": (
                settled(lambda x: getattr(x, storage) - x.workspace_bytes), bound_bytes),
            "objects": (min(x.objects for x in tail) - _object_baseline(samples).objects,
                        MAX_OBJECT_GROWTH),
            "tensors": (settled(lambda x: x.tensors), MAX_TENSOR_GROWTH),
        }
        rss = [x.rss_bytes for x in samples]
        if self.device.type == "cpu" and len(samples) >= 5 and None not in rss:
            # Over the later half only, as the object count: malloc takes pages for good
            # while the run's sizes first spread (2 gloo ranks, a2a, the defaults: +2.6 MiB
            # by step 250, +3.0 MiB by 1050), then creeps (+0.23 MiB from 1050 to 2000).
            checked["rss_later_half"] = (
                min(x.rss_bytes for x in tail) - _object_baseline(samples).rss_bytes,
                bound_bytes)
        if self.trace_python and not self.trace_window:
            growth["traced_bytes"] = last.traced_bytes - first.traced_bytes
            checked["tracemalloc"] = (settled(lambda x: x.traced_bytes), bound_bytes)
        elif self.trace_python:
            # Each window counts from zero; hold each to the whole run's rate per step.
            measured = last.step - first.step
            windows = [x.traced_bytes for x in samples[1:] if x.traced_bytes is not None]
            growth["traced_bytes"] = max(windows)
            checked["tracemalloc_window"] = (
                max(windows), bound_bytes * min(self.trace_window, measured) // measured)
        return MemoryVerdict(growth=growth, checked=checked)


def _object_baseline(samples: list[MemorySample]) -> MemorySample:
    """The sample the object count (and on CPU the RSS) is held from: the middle one when
    at least five were
    taken (so that it precedes the last two), else the first. Lazily filled caches
    (CPython's, torch's, a code path's first occurrence such as a rank's first zero-token
    step) add a fixed number of objects some time after warmup and then stop, which a
    leak does not: over the later half of a run a leak of one object per step still adds
    one per step, while a one-off fill adds nothing (a graphed `deepep_ll` soak of 2000
    steps on 2 GPUs rose by 63 and 149 objects from the warmup baseline, and rank 0's
    count stood still from step 1250 on)."""
    return samples[len(samples) // 2] if len(samples) >= 5 else samples[0]


def _rss_bytes() -> Optional[int]:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None
