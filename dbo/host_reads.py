"""Find the host reads of device data in a model's forward, per ubatch of a DBO step.

    with record_host_reads() as reads:
        runner(input_ids=ids, attention_mask=mask, use_cache=False)
    print(format_host_reads(reads))

A DBO step overlaps only while neither ubatch blocks the host: a read of a device value
(`.item()`, `bool(t)`, `.tolist()`, `torch.nonzero`, a boolean-mask index, ...) makes
the host wait for everything queued on the GPU, the other ubatch's work included, and
serialises the step. Such reads are found on any device, also on a CPU where they cost
nothing: the recorder sees the operators, not their cost.

What is recorded (`HostRead.op`):
- aten operators whose result size or value the host needs (`HOST_READ_OPS`, and
  `aten.index` / `aten.index_put` with a boolean index, `aten.repeat_interleave` without
  `output_size`), seen by a `TorchDispatchMode`;
- the tensor methods that copy to the host without an aten operator on a CPU tensor
  (`Tensor.tolist`, `.cpu`, `.numpy`, `.to("cpu")`), seen by a `TorchFunctionMode`: on a
  CPU tensor they are no-ops, on a GPU tensor a device-to-host copy;
- `aten.lift_fresh` (`torch.tensor(python_data)`): a tensor built from host data; on a
  GPU its copy to the device is a blocking copy that waits for the current stream
  (`HostRead.kind == "from_host"`; reported apart, as on a CPU it is often a CPU scalar).
`aten._assert_async` is not recorded: it does not block the host on CUDA.

Both modes are pushed on the caller's mode stacks; a DBO step starts each ubatch with
the caller's stacks (`dbo.thread_state`), so the reads of both ubatches are seen. Each
read carries its ubatch, its segment (how many times that ubatch had yielded), whether
the other ubatch had started (only then does the read wait on the other ubatch's work)
and the innermost frames of the stack in `MODULES` (transformers, moe, dbo, ...).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Callable, Optional

import greenlet
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from dbo.scheduler import active_scheduler

__all__ = ["HOST_READ_OPS", "MODULES", "HostRead", "format_host_reads", "record_host_reads"]

_aten = torch.ops.aten
#: Operators that always need a device value on the host (their result, or its size).
HOST_READ_OPS: frozenset[Any] = frozenset({
    _aten._local_scalar_dense.default, _aten.item.default, _aten.is_nonzero.default,
    _aten.equal.default, _aten.nonzero.default, _aten.nonzero_numpy.default,
    _aten.masked_select.default, _aten._unique.default, _aten._unique2.default,
    _aten.unique_dim.default, _aten.unique_consecutive.default,
    _aten.unique_dim_consecutive.default,
})
_INDEX_OPS = frozenset({_aten.index.Tensor, _aten.index_put.default, _aten.index_put_.default,
                        _aten._index_put_impl_.default})
_REPEAT_INTERLEAVE = frozenset({_aten.repeat_interleave.Tensor,
                                _aten.repeat_interleave.self_Tensor})
_FROM_HOST = frozenset({_aten.lift_fresh.default})
_TO_HOST_METHODS = frozenset({torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.numpy})

#: Top-level modules whose frames a read's stack keeps (innermost first).
MODULES: tuple[str, ...] = ("transformers", "moe", "dbo", "traces", "streams", "tests")
_THIS = __name__


@dataclass(frozen=True, kw_only=True)
class HostRead:
    """One host read of device data."""

    op: str
    """The aten operator (`aten.nonzero.default`) or tensor method (`Tensor.tolist`)."""
    kind: str
    """"sync": the host waits for the device; "from_host": a tensor from Python data."""
    ubatch_id: Optional[int]
    """The ubatch that read, or None outside a DBO step."""
    segment: int
    """How many times this ubatch had yielded before the read (0: before its first)."""
    other_started: bool
    """Whether the other ubatch had run up to a yield: only then does the read wait for
    the other ubatch's queued work as well as its own."""
    frames: tuple[str, ...]
    """"module:line function" of the innermost frames in `MODULES`, innermost first."""

    @property
    def owner(self) -> str:
        """The top-level module of the innermost recorded frame ("transformers", "moe",
        "dbo", ...), or "other"."""
        return self.frames[0].split(".", 1)[0].split(":", 1)[0] if self.frames else "other"

    @property
    def where(self) -> str:
        """The innermost recorded frame."""
        return self.frames[0] if self.frames else "?"


class _Recorder:
    """Shared by the two modes: builds the `HostRead`s and counts each greenlet's
    resumptions (greenlet's trace hook sees every switch)."""

    def __init__(self, reads: list[HostRead], depth: int) -> None:
        self.reads = reads
        self.depth = depth
        self.resumed: dict[Any, int] = {}
        self.previous_trace: Optional[Callable[..., Any]] = None

    def trace(self, event: str, args: Any) -> None:
        if event in ("switch", "throw"):
            target = args[1]
            self.resumed[target] = self.resumed.get(target, 0) + 1
        if self.previous_trace is not None:
            self.previous_trace(event, args)

    def add(self, op: str, kind: str) -> None:
        scheduler = active_scheduler()
        ubatch = None if scheduler is None else scheduler.running
        other_started = False
        if ubatch is not None:
            other = scheduler.other(ubatch)
            other_started = other is not None and (other.done or bool(other.glet))
        segment = max(0, self.resumed.get(greenlet.getcurrent(), 1) - 1)
        self.reads.append(HostRead(
            op=op, kind=kind, ubatch_id=None if ubatch is None else ubatch.ubatch_id,
            segment=segment if ubatch is not None else 0, other_started=other_started,
            frames=_frames(self.depth)))


def _frames(depth: int) -> tuple[str, ...]:
    out: list[str] = []
    frame = sys._getframe(2)
    while frame is not None and len(out) < depth:
        module = frame.f_globals.get("__name__", "")
        if module != _THIS and module.split(".", 1)[0] in MODULES:
            out.append(f"{module}:{frame.f_lineno} {frame.f_code.co_name}")
        frame = frame.f_back
    return tuple(out)


class _DispatchMode(TorchDispatchMode):
    def __init__(self, recorder: _Recorder) -> None:
        super().__init__()
        self.recorder = recorder

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if func in HOST_READ_OPS:
            self.recorder.add(str(func), "sync")
        elif func in _INDEX_OPS and _has_bool_index(args[1]):
            self.recorder.add(f"{func} (boolean index)", "sync")
        elif func in _REPEAT_INTERLEAVE and kwargs.get("output_size") is None:
            self.recorder.add(f"{func} (no output_size)", "sync")
        elif func in _FROM_HOST and args[0].dim() > 0:
            # A 0-dim one is a Python scalar (`x[rows] = -1`): torch fills with it, no copy.
            self.recorder.add(str(func), "from_host")
        return func(*args, **kwargs)


class _FunctionMode(TorchFunctionMode):
    def __init__(self, recorder: _Recorder) -> None:
        super().__init__()
        self.recorder = recorder

    def __torch_function__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if func in _TO_HOST_METHODS or (func is torch.Tensor.to and _to_cpu(args, kwargs)):
            self.recorder.add(f"Tensor.{func.__name__}", "sync")
        return func(*args, **kwargs)


def _has_bool_index(indices: Any) -> bool:
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
               for i in indices or ())


def _to_cpu(args: tuple, kwargs: dict) -> bool:
    """`Tensor.to` from another device to the CPU (on a CPU tensor it is a no-op, as
    `x.to(y.device)` with everything on the CPU is)."""
    if not isinstance(args[0], torch.Tensor) or args[0].device.type == "cpu":
        return False
    target = kwargs.get("device", args[1] if len(args) > 1 else None)
    if isinstance(target, (str, torch.device)):
        return torch.device(target).type == "cpu"
    return False


class record_host_reads:  # noqa: N801 - used like a function: `with record_host_reads()`
    """Record the host reads of device data made inside the block (a list of `HostRead`
    in call order). `depth`: the recorded frames per read. Not reentrant."""

    def __init__(self, *, depth: int = 4) -> None:
        self.reads: list[HostRead] = []
        self._recorder = _Recorder(self.reads, depth)
        self._modes = (_FunctionMode(self._recorder), _DispatchMode(self._recorder))

    def __enter__(self) -> list[HostRead]:
        self._recorder.previous_trace = greenlet.settrace(self._recorder.trace)
        for mode in self._modes:
            mode.__enter__()
        return self.reads

    def __exit__(self, *exc: Any) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
        greenlet.settrace(self._recorder.previous_trace)


def format_host_reads(reads: list[HostRead]) -> str:
    """One line per distinct (ubatch, segment, op, stack), with its count."""
    counts: dict[tuple, int] = {}
    for r in reads:
        key = (r.ubatch_id, r.segment, r.other_started, r.kind, r.op, r.frames)
        counts[key] = counts.get(key, 0) + 1
    lines = []
    for (ub, seg, other, kind, op, frames), n in counts.items():
        place = "outside a step" if ub is None else (
            f"ubatch {ub} segment {seg}" + (" (other started)" if other else ""))
        lines.append(f"{n:3d}x {place}: {op} [{kind}] at {' < '.join(frames) or '?'}")
    return "\n".join(lines)

