"""Cheap current-stream switching.

PyTorch's current CUDA stream is per OS thread, so every greenlet of the thread shares
it. `CurrentStream` is the one place the scheduler changes it: it caches the stream it
last set and calls into PyTorch only when the stream really changes (a
`torch.cuda.current_stream()` + `set_stream()` pair costs ~3.5 us; an `is` test costs
nothing). With stand-in streams (CPU) it only tracks the value.
"""
from __future__ import annotations

from typing import Any

import torch


class CurrentStream:
    """Tracks and sets the thread's current stream; `get()` never calls into PyTorch."""

    def __init__(self, initial: Any, *, is_cuda: bool) -> None:
        self._current = initial
        self._is_cuda = is_cuda

    def get(self) -> Any:
        return self._current

    def set(self, stream: Any) -> None:
        if stream is self._current:
            return
        if self._is_cuda:
            torch.cuda.set_stream(stream)
        self._current = stream

    def force(self, stream: Any) -> None:
        """Set `stream` even if it is the one cached (code outside our control may have
        changed the real current stream meanwhile)."""
        if self._is_cuda:
            torch.cuda.set_stream(stream)
        self._current = stream

    def resync(self) -> None:
        """Re-read the real current stream (after code outside our control changed it)."""
        if self._is_cuda:
            self._current = torch.cuda.current_stream()
