"""Where a device's compute stream sat idle in a trace's window, and why.

The compute stream is the stream with the most compute-kernel time. Its idle time in the
window is split into:

- ``host_us``: gaps the GPU spent waiting for the host. The kernel after the gap was
  launched (its launch call began) after the kernel before it had ended: the stream had
  nothing queued. Counted from the previous kernel's end to that launch, at most the gap.
- ``peer_us``: on a CPU trace, the part of the host's gaps in which the thread was
  blocked on a collective until it completed: waiting for a peer (`traces.waits`). On a
  GPU trace it is 0: a kernel waiting for a peer is a comm kernel, not a gap.
- ``wait_us``: the rest of the gaps between its kernels. Work was queued but held back:
  an event wait on another stream (a transfer the next kernel reads), or a launch call
  still in flight.
- ``edges_us``: before its first kernel and after its last one, inside the window.

``largest`` lists the longest gaps with the phase label of the kernel after each
(``ub1/L3/combine_recv``: what the stream was waiting to run). In a DBO step, a long gap
before the last ubatch's last ``combine_recv`` is the combine with nothing left to
overlap; gaps mostly waiting for the host mean launches, not the GPU, set the pace there.
Kernels without a linked launch (traces that do not record them) count as ``wait_us``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from traces.intervals import Span, clip, intersect, merge, total
from traces.model import KernelInterval, Label

NUM_LARGEST = 5


@dataclass(frozen=True, kw_only=True)
class Gap:
    """One idle stretch between two kernels of the compute stream (microseconds)."""

    offset_us: float
    """Start, from the window's start."""
    length_us: float
    host_us: float
    """The part spent waiting for the host (see the module doc)."""
    peer_us: float
    """The part spent waiting for a peer (see the module doc)."""
    before: str
    """The phase label of the kernel after the gap, else that kernel's name."""


@dataclass(frozen=True, kw_only=True)
class IdleReport:
    """The compute stream's idle time in the window, split by cause (microseconds)."""

    stream: int
    idle_us: float
    host_us: float
    peer_us: float
    wait_us: float
    edges_us: float
    num_gaps: int
    largest: list[Gap]

    def to_json(self) -> dict[str, Any]:
        r = lambda x: round(x, 3)  # noqa: E731
        return {
            "stream": self.stream, "idle_us": r(self.idle_us), "host_us": r(self.host_us),
            "peer_us": r(self.peer_us), "wait_us": r(self.wait_us),
            "edges_us": r(self.edges_us), "num_gaps": self.num_gaps,
            "largest": [{"offset_us": r(g.offset_us), "length_us": r(g.length_us),
                         "host_us": r(g.host_us), "peer_us": r(g.peer_us), "before": g.before}
                        for g in self.largest],
        }

    def format_lines(self) -> list[str]:
        peer = f", for a peer {self.peer_us:.1f}" if self.peer_us else ""
        lines = [f"  compute stream {self.stream} idle {self.idle_us:.1f} us: between kernels "
                 f"{self.host_us + self.peer_us + self.wait_us:.1f} ({self.num_gaps} gaps; "
                 f"waiting for the host {self.host_us:.1f}{peer}, held back "
                 f"{self.wait_us:.1f}), before its first and after its last kernel "
                 f"{self.edges_us:.1f}"]
        for g in self.largest:
            peer = f", peer {g.peer_us:.1f}" if g.peer_us else ""
            lines.append(f"    gap {g.length_us:9.1f} us at +{g.offset_us:.1f} (host "
                         f"{g.host_us:.1f}{peer}) before {g.before}")
        return lines


def compute_stream(compute_us: dict[int, float]) -> int | None:
    """The stream with the most compute time (the lower id on a tie); None without any."""
    if not compute_us or max(compute_us.values()) <= 0:
        return None
    return max(compute_us, key=lambda s: (compute_us[s], -s))


def compute_idle(kernels: list[KernelInterval], labels: list[Label], window: Span, *,
                 device: int, stream: int, peer_waits: list[Span] | None = None) -> IdleReport:
    """The idle report of `device`'s compute stream `stream` (`compute_stream`) in `window`;
    `peer_waits` (canonical, `traces.waits.peer_waits`) is where it waited for a peer."""
    waits = peer_waits or []
    on_stream = sorted((k for k in kernels if k.stream == stream
                        and k.end_us > window.start and k.start_us < window.end),
                       key=lambda k: k.start_us)
    phase_labels = [lb for lb in labels if lb.device == device and lb.phase is not None]
    gaps: list[Gap] = []
    busy_end = max(on_stream[0].start_us, window.start)
    for k in on_stream:
        start = min(k.start_us, window.end)
        if start > busy_end:
            length = start - busy_end
            host = 0.0
            if k.launch_us is not None and k.launch_us > busy_end:
                host = min(length, k.launch_us - busy_end)
            # A peer wait lies where nothing ran on the thread, the host's part of a gap.
            peer = min(host, total(intersect(waits, [Span(busy_end, start)])))
            gaps.append(Gap(offset_us=busy_end - window.start, length_us=length,
                            host_us=host - peer, peer_us=peer,
                            before=_label_at(phase_labels, k.start_us) or k.name[:60]))
        busy_end = max(busy_end, min(k.end_us, window.end))
    stream_busy = total(clip(merge([Span(k.start_us, k.end_us) for k in on_stream]), window))
    between = sum(g.length_us for g in gaps)
    host = sum(g.host_us for g in gaps)
    peer = sum(g.peer_us for g in gaps)
    largest = sorted(gaps, key=lambda g: -g.length_us)[:NUM_LARGEST]
    return IdleReport(stream=stream, idle_us=window.length - stream_busy, host_us=host,
                      peer_us=peer, wait_us=between - host - peer,
                      edges_us=window.length - stream_busy - between,
                      num_gaps=len(gaps), largest=largest)


def _label_at(labels: list[Label], t: float) -> str | None:
    """The innermost phase label holding time t."""
    holding = [lb for lb in labels if lb.start_us <= t < lb.end_us]
    if not holding:
        return None
    return min(holding, key=lambda lb: lb.end_us - lb.start_us).name
