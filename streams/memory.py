"""Caching-allocator safety for tensors that cross streams.

PyTorch's caching allocator ties a block to the stream it was allocated on; once the
Python tensor is freed, the block is reused by later work on *that* stream at once. A
tensor made on the compute stream and read by a collective on the comm stream must
therefore be marked as used by comm (`record_stream`), or compute may overwrite it while
the collective still reads it. No-op for CPU tensors.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor


def record_on_current_stream(*tensors: Optional[Tensor]) -> None:
    """Mark CUDA `tensors` as in use by the current stream until its queued work ends."""
    stream = None
    for t in tensors:
        if t is None or not t.is_cuda:
            continue
        if stream is None:
            stream = torch.cuda.current_stream(t.device)
        t.record_stream(stream)
