"""Host buffers that a captured CUDA graph reads at every replay, owned by that graph.

A host-to-device copy captured in a CUDA graph reads its pinned source again at every
replay, so the source must stay alive and unchanged as long as the graph exists. Code
that makes such a copy while a capture runs passes its pinned buffer through
`keep_for_graph`:

- inside `dbo.graphs.capture_graph` (`collect_graph_host_buffers`), the buffer joins the
  `CapturedGraph`, and is freed with it when `GraphedRunner` drops the graph;
- in a capture that code outside dbo opened itself (`torch.cuda.graph`), nothing can tell
  when that graph dies, so the buffer is kept for the life of the process, one per
  distinct value (repeated captures of one layout share it).

Collection is per thread: the DBO ubatches run as greenlets on the capturing thread.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator

from torch import Tensor

_local = threading.local()
# (dtype, shape, values) -> pinned tensor, for captures outside `capture_graph`.
_process_lifetime: dict[tuple, Tensor] = {}


def _stack() -> list[list[Tensor]]:
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    return stack


@contextmanager
def collect_graph_host_buffers() -> Iterator[list[Tensor]]:
    """Within the block, `keep_for_graph` adds its buffers to the yielded list (the
    innermost such block's, on this thread) instead of keeping them for the process."""
    buffers: list[Tensor] = []
    stack = _stack()
    stack.append(buffers)
    try:
        yield buffers
    finally:
        stack.pop()


def keep_for_graph(pinned: Tensor) -> Tensor:
    """Keep `pinned` (a pinned CPU tensor whose copy is being captured) alive as long as
    the graph being captured; returns the tensor to copy from, which is `pinned` or,
    outside `collect_graph_host_buffers`, an equal buffer already kept."""
    stack = _stack()
    if stack:
        stack[-1].append(pinned)
        return pinned
    key = (pinned.dtype, tuple(pinned.shape), tuple(pinned.flatten().tolist()))
    return _process_lifetime.setdefault(key, pinned)


def num_process_lifetime_buffers() -> int:
    """How many buffers are kept for the life of the process (captures outside dbo)."""
    return len(_process_lifetime)
