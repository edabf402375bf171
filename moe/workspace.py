"""Reusable scratch buffers for the expert kernels: one `Workspace` per ubatch.

A `Workspace` keeps one flat byte buffer per name and hands out typed views of it, so the
large temporaries of the expert path (sorted inputs, GEMM outputs) are allocated during
warmup and reused by every later step and layer. Under DBO each ubatch uses its own set
(`WorkspaceSets.for_ubatch(dbo_current_ubatch_id())`): the two ubatches interleave, and a
shared buffer would be overwritten by the other ubatch while its kernels are still queued.

A view returned by `get(name, ...)` is valid until the next `get` of the same name on the
same workspace (by any layer of the same ubatch), in stream order: work queued on the
compute stream before that next `get` has finished with it by the time later work runs.
Never return a workspace view to a caller that keeps it.

CUDA graphs: a buffer that grows after a graph capture began (`streams.graph_capture`)
may be baked into that graph, whose replays keep writing it, so the old buffer is kept
alive (`pinned_nbytes`) rather than freed; e.g. a graph of a small step captured before a
larger step grows the buffer, or a DBO step's before a joined one's.
"""
from __future__ import annotations

import math
from typing import Any, Callable, TypeVar

import torch
from torch import Tensor

from streams.graph_capture import GRAPH_CAPTURES

__all__ = ["Workspace", "WorkspaceSets", "empty_from"]

T = TypeVar("T")

_ALIGN_BYTES = 512  # round buffer sizes up so small growth steps do not reallocate each time


def _resolve_device(device: torch.device | str) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


class Workspace:
    """Named scratch buffers that only grow; contents are uninitialised (like ``torch.empty``).

    Attributes:
        num_allocations: buffers allocated so far (grows only when a request does not fit).
        frozen: when True, a request that would allocate raises ``RuntimeError``.
    """

    def __init__(self) -> None:
        self._buffers: dict[str, Tensor] = {}
        # name -> (shape, dtype, device) of its last request and the view handed out: a
        # repeated request costs a dict look-up instead of three tensor views (~8 us of
        # host time on the GPU machine, paid several times per layer and ubatch). One
        # entry per name, so request shapes that change every step do not pile up.
        self._views: dict[str, tuple[tuple, Tensor]] = {}
        self._kept: dict[str, Any] = {}
        # name -> the graph-capture count when its buffer was allocated; buffers replaced
        # after a capture began, kept alive for the graphs that may hold them.
        self._captures_at: dict[str, int] = {}
        self._pinned: list[Tensor] = []
        self.num_allocations = 0
        self.frozen = False

    @property
    def nbytes(self) -> int:
        """Bytes held by all buffers of this workspace (pinned ones not counted)."""
        return sum(buf.numel() for buf in self._buffers.values())

    @property
    def pinned_nbytes(self) -> int:
        """Bytes of replaced buffers kept alive for CUDA graphs that may hold them."""
        return sum(buf.numel() for buf in self._pinned)

    def get(
        self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str
    ) -> Tensor:
        """A contiguous ``shape`` tensor of ``dtype`` on ``device`` viewing buffer ``name``.

        The buffer is reallocated only when it has fewer bytes than requested or lives on
        another device; a different dtype reuses the same bytes. It never shrinks. The same
        request as the name's last one (a tuple shape, an indexed device) returns the same
        view object while the buffer stays: never change a view's shape or strides in place.
        """
        key = (shape, dtype, device)
        cacheable = type(shape) is tuple and isinstance(device, torch.device) and (
            device.index is not None or device.type == "cpu")
        if cacheable and (last := self._views.get(name)) is not None and last[0] == key:
            return last[1]
        shape = tuple(int(s) for s in shape)
        if any(s < 0 for s in shape):
            raise ValueError(f"Workspace.get({name!r}): negative size in shape {shape}.")
        device = _resolve_device(device)
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype, device=device)
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < nbytes or buf.device != device:
            if self.frozen:
                have = 0 if buf is None else buf.numel()
                raise RuntimeError(
                    f"Workspace is frozen but buffer {name!r} needs {nbytes} bytes on {device} "
                    f"(has {have}): warm up with the largest batch before freeze()."
                )
            size = -(-nbytes // _ALIGN_BYTES) * _ALIGN_BYTES
            # Drop the old buffer first so the allocator can reuse its memory, unless a
            # graph captured since it was allocated may still write it.
            old = self._buffers.pop(name, None)
            self._views.pop(name, None)
            if old is not None and self._captures_at.get(name) != GRAPH_CAPTURES.count:
                self._pinned.append(old)
            del old
            buf = torch.empty(size, dtype=torch.uint8, device=device)
            self._buffers[name] = buf
            self._captures_at[name] = GRAPH_CAPTURES.count
            self.num_allocations += 1
        view = buf[:nbytes].view(dtype).view(shape)
        if cacheable:
            self._views[name] = (key, view)
        return view

    def keep(self, name: str, make: Callable[[], T]) -> T:
        """The object kept under ``name``, made by ``make()`` on the first request and
        returned as it is by every later one, until `clear`. For buffers that must never
        move or grow once made, whatever the later requests: symmetric memory, which the
        peer ranks address and every rank allocates alike (``moe.backends.symm_mem``).
        Making one counts as an allocation; a frozen workspace refuses to make one."""
        kept = self._kept.get(name)
        if kept is None:
            if self.frozen:
                raise RuntimeError(
                    f"Workspace is frozen but {name!r} is not made yet: warm up before "
                    f"freeze()."
                )
            kept = make()
            self._kept[name] = kept
            self.num_allocations += 1
        return kept

    def freeze(self) -> None:
        """Forbid further allocations (e.g. after warmup, or before CUDA graph capture)."""
        self.frozen = True

    def clear(self) -> None:
        """Release all buffers and kept objects, pinned ones too: release the CUDA graphs
        captured with them first (the counters are kept; ``frozen`` is reset)."""
        self._buffers.clear()
        self._views.clear()
        self._kept.clear()
        self._captures_at.clear()
        self._pinned.clear()
        self.frozen = False

    def __repr__(self) -> str:
        return (
            f"Workspace(buffers={sorted(self._buffers)}, nbytes={self.nbytes}, "
            f"num_allocations={self.num_allocations})"
        )


class WorkspaceSets:
    """One independent `Workspace` per ubatch."""

    def __init__(self, num_ubatches: int = 2) -> None:
        if isinstance(num_ubatches, bool) or not isinstance(num_ubatches, int) or num_ubatches < 1:
            raise ValueError(f"WorkspaceSets: num_ubatches={num_ubatches!r} must be an int >= 1.")
        self._sets = tuple(Workspace() for _ in range(num_ubatches))

    @property
    def num_ubatches(self) -> int:
        """Number of workspaces (ubatches)."""
        return len(self._sets)

    def for_ubatch(self, ubatch_id: int) -> Workspace:
        """The workspace of ubatch ``ubatch_id`` (0 outside a DBO step)."""
        if not 0 <= ubatch_id < len(self._sets):
            raise ValueError(
                f"WorkspaceSets.for_ubatch: ubatch_id={ubatch_id} out of range [0, "
                f"{len(self._sets)}): create WorkspaceSets(num_ubatches=...) with more sets."
            )
        return self._sets[ubatch_id]

    @property
    def num_allocations(self) -> int:
        """Allocations over all ubatch workspaces."""
        return sum(ws.num_allocations for ws in self._sets)

    @property
    def nbytes(self) -> int:
        """Bytes held over all ubatch workspaces."""
        return sum(ws.nbytes for ws in self._sets)

    def freeze(self) -> None:
        """Freeze every ubatch workspace (see `Workspace.freeze`)."""
        for ws in self._sets:
            ws.freeze()


def empty_from(
    workspace: Workspace | None,
    name: str,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device | str,
) -> Tensor:
    """``workspace.get(...)`` when a workspace is given, else a fresh ``torch.empty``."""
    if workspace is None:
        return torch.empty(shape, dtype=dtype, device=device)
    return workspace.get(name, shape, dtype, device)
