"""Where a rank of a CPU trace waited for its peers: a collective was in flight and the
thread that runs the step computed nothing until it completed.

On CPU the ranks' collectives run over gloo, whose worker threads record each one as a
range (``gloo:all_reduce``, ``gloo:all_to_all``) from when it was handed to them until it
completed, which includes waiting for the other ranks to join. The step's thread either
computes meanwhile (a DBO ubatch computes while the other's dispatch is in flight) or
waits, idle or inside the collective's own op (``c10d::alltoall_base_`` returns only
when a synchronous collective has completed). Where it computed nothing from some time
until such a range closed (its next compute op came after the collective completed), it
was blocked on that collective: on one host gloo moves a step's tensors in microseconds,
so that time is the wait for a peer that had not yet joined. A pause between ops while a
collective stays in flight past it is not a wait: the thread was running Python (the
host), and went on before the collective ended. A rank that enters a step before the others
waits in the step's first collective (the vote), which is what a capture of unaligned
ranks shows (`traces.alignment`).

GPU traces are left alone: an NCCL kernel that waits for its peer is indistinguishable
from one that moves data (both are comm), and their host-side ranges cover the launch,
not the wait. A Chrome trace from torch.profiler holds one process, so every collective
range in it is the rank's own.
"""
from __future__ import annotations

from bisect import bisect_left

from traces.classify import Classifier
from traces.intervals import Span, clip, merge, subtract
from traces.model import KernelInterval, Label


def collective_spans(labels: list[Label], classifier: Classifier) -> list[Span]:
    """CPU-side ranges of collectives in flight, one per collective, sorted: labels that
    are not dbo phases and whose name matches a comm pattern (``gloo:all_to_all``)."""
    return sorted((Span(lb.start_us, lb.end_us) for lb in labels
                   if lb.device is None and lb.ubatch is None and lb.layer is None
                   and lb.end_us > lb.start_us and classifier.is_comm_name(lb.name)),
                  key=lambda s: (s.start, s.end))


def peer_waits(kernels: list[KernelInterval], labels: list[Label], window: Span, *,
               classifier: Classifier, stream: int) -> list[Span]:
    """The spans of ``window`` in which ``stream`` (the thread running the step, of a CPU
    trace's device) computed nothing until a collective in flight completed: waits for a
    peer. A stretch without compute is a gap between compute ops, or a comm op (and the
    ops inside it); each wait runs from the later of that stretch's start and the
    collective's start to the collective's end, for the collectives that ended inside it.

    Empty unless every one of ``kernels`` (one device's) is a CPU op.
    """
    if not kernels or any(k.category != "cpu_op" for k in kernels):
        return []
    own = [k for k in kernels if k.stream == stream]
    comm = merge(Span(k.start_us, k.end_us) for k in own if classifier.is_comm_name(k.name))
    computing = subtract(merge(Span(k.start_us, k.end_us) for k in own
                               if not classifier.is_comm_name(k.name)), comm)
    gaps = subtract([window], clip(computing, window))
    gap_ends = [gap.end for gap in gaps]
    waits = []
    for c in collective_spans(labels, classifier):
        i = bisect_left(gap_ends, c.end)  # the first gap that ends at or after c.end
        if i < len(gaps) and gaps[i].start < c.end:
            waits.append(Span(max(gaps[i].start, c.start), c.end))
    return merge(waits)
