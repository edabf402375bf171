"""Classify kernels as communication, compute or copy, and attribute them to ubatches.

Comm vs compute is decided by case-insensitive regular expressions searched in the kernel
name (plain substrings such as ``nccl`` are valid patterns). Anything else that is a
kernel (or a CPU op) is compute; memcpys/memsets that match no comm pattern are ``copy``
and count as neither. Peer-to-peer copies match the default comm patterns.

Ubatch attribution (``kernel_ubatches``): a kernel belongs to the latest-started phase
label (one with a ``ub<n>`` prefix) open when it was launched (CPU-side labels, launching
thread), else open at its midpoint on its stream (device-side labels). "Latest started"
is exact when the running ubatch opened a range after it was switched in: ranges the other
ubatch left open across its yield started earlier. It is wrong for kernels a ubatch
launches outside any of its own ranges while the other ubatch has one open; a scheduler
that opens a ``ub<n>/run`` range per switch-in (``dbo.ranges.start_phase("run", ...)``)
makes it exact. Kineto's own device-side annotations come from a per-thread correlation
stack and can be wrong in the same way.
"""
from __future__ import annotations

import enum
import heapq
import re
from collections import defaultdict
from dataclasses import dataclass

from traces.model import KernelInterval, Label, Trace

DEFAULT_COMM_PATTERNS: tuple[str, ...] = (
    "nccl",
    "all_to_all", "alltoall", "a2a",
    "allgather", "all_gather",
    "reduce_scatter", "reducescatter",
    "allreduce", "all_reduce",
    "sendrecv", "send_recv",
    "nvshmem", "deep_ep", "deepep",
    "symm_mem", "symmetric_memory", "multimem", "cross_device",
    "exchangesplit",
    "gloo", "c10d::",
    r"memcpy ptop", r"memcpy peer",
)
"""Name patterns of communication kernels (case-insensitive regular expressions)."""


class Kind(str, enum.Enum):
    """What a kernel does, for the overlap analysis."""

    COMPUTE = "compute"
    COMM = "comm"
    COPY = "copy"


@dataclass(frozen=True, kw_only=True)
class ClassifyConfig:
    """How kernel names map to comm or compute."""

    comm_patterns: tuple[str, ...] = DEFAULT_COMM_PATTERNS
    """Case-insensitive regexes; a kernel whose name matches any of them is comm."""

    def __post_init__(self) -> None:
        if isinstance(self.comm_patterns, str):
            raise TypeError(
                f"comm_patterns must be a tuple of strings, got the string {self.comm_patterns!r}; "
                f"write ({self.comm_patterns!r},)"
            )
        for pattern in self.comm_patterns:
            try:
                re.compile(pattern)
            except re.error as exc:
                raise ValueError(f"comm pattern {pattern!r} is not a valid regex: {exc}") from exc

    def with_extra(self, *patterns: str) -> ClassifyConfig:
        """A copy with ``patterns`` added to the comm patterns."""
        return ClassifyConfig(comm_patterns=self.comm_patterns + tuple(patterns))


class Classifier:
    """Caches the kind of each kernel name under one ``ClassifyConfig``."""

    def __init__(self, config: ClassifyConfig | None = None) -> None:
        self.config = config or ClassifyConfig()
        joined = "|".join(f"(?:{p})" for p in self.config.comm_patterns) or r"(?!)"
        self._comm = re.compile(joined, re.IGNORECASE)
        self._cache: dict[tuple[str, str], Kind] = {}

    def is_comm_name(self, name: str) -> bool:
        """True when ``name`` matches a comm pattern."""
        return self._comm.search(name) is not None

    def kind(self, kernel: KernelInterval) -> Kind:
        """The ``Kind`` of ``kernel`` (by name, then by category)."""
        key = (kernel.name, kernel.category)
        kind = self._cache.get(key)
        if kind is None:
            if self.is_comm_name(kernel.name):
                kind = Kind.COMM
            elif kernel.category in ("kernel", "cpu_op"):
                kind = Kind.COMPUTE
            else:
                kind = Kind.COPY
            self._cache[key] = kind
        return kind


def _latest_open(points: list[tuple[float, int]], labels: list[Label], out: list[int | None]) -> None:
    """For each (time, kernel index) point, set out[index] to the ubatch of the
    latest-started label open at that time (labels: all with a ubatch). A sweep:
    O((points + labels) log labels)."""
    ordered = sorted(labels, key=lambda lb: lb.start_us)
    heap: list[tuple[float, float, int]] = []  # (-start, end, ubatch)
    i = 0
    for t, index in sorted(points):
        while i < len(ordered) and ordered[i].start_us <= t:
            lb = ordered[i]
            heapq.heappush(heap, (-lb.start_us, lb.end_us, lb.ubatch))  # type: ignore[arg-type]
            i += 1
        # Times only grow, so a label that ended before t is closed for every later point.
        while heap and heap[0][1] < t:
            heapq.heappop(heap)
        if heap:
            out[index] = heap[0][2]


def kernel_ubatches(trace: Trace) -> list[int | None]:
    """The ubatch of each kernel of ``trace`` (same order), None where no label says.

    First by launch: the latest-started CPU-side phase label open at the kernel's launch
    on its launching thread. Then, for kernels without launch information, by position:
    the latest-started device-side phase label open at the kernel's midpoint on its
    (device, stream), or on its device when that stream has no labels.
    """
    out: list[int | None] = [None] * len(trace.kernels)
    cpu_by_tid: dict[int | None, list[Label]] = defaultdict(list)
    dev_by_stream: dict[tuple[int, int | None], list[Label]] = defaultdict(list)
    dev_all: dict[int, list[Label]] = defaultdict(list)
    for lb in trace.labels:
        if lb.ubatch is None:
            continue
        if lb.device is None:
            cpu_by_tid[lb.tid].append(lb)
        else:
            dev_by_stream[(lb.device, lb.stream)].append(lb)
            dev_all[lb.device].append(lb)
    cpu_labels = [lb for labels in cpu_by_tid.values() for lb in labels]

    if cpu_labels:
        # Same launching thread when labels of that thread exist, else any CPU label.
        launch_points: dict[int | None, list[tuple[float, int]]] = defaultdict(list)
        for index, k in enumerate(trace.kernels):
            if k.launch_us is not None:
                key = k.launch_tid if k.launch_tid in cpu_by_tid else None
                launch_points[key].append((k.launch_us, index))
        for tid, pts in launch_points.items():
            _latest_open(pts, cpu_by_tid[tid] if tid is not None else cpu_labels, out)

    if dev_all:
        points: dict[tuple[int, int | None], list[tuple[float, int]]] = defaultdict(list)
        for index, k in enumerate(trace.kernels):
            if out[index] is None and k.device in dev_all:
                key = (k.device, k.stream) if (k.device, k.stream) in dev_by_stream else (k.device, None)
                points[key].append(((k.start_us + k.end_us) / 2.0, index))
        for (device, stream), pts in points.items():
            labels = dev_by_stream[(device, stream)] if stream is not None else dev_all[device]
            _latest_open(pts, labels, out)
    return out
