"""Phase ranges per ubatch/layer that stay correct while two greenlets interleave.

Names look like ``ub0/L3/dispatch_send`` (``ub<ubatch>/L<layer>/<phase>``; the layer part
is left out when ``layer`` is None). The analyzer (``traces.readers.parse_label_name``)
parses them back.

Why start/end and not push/pop: NVTX push/pop and ``torch.cuda.nvtx.range_push`` keep a
per-OS-thread stack, and both ubatch greenlets share one thread, so ``ub0`` can pop the
range ``ub1`` pushed. NVTX start/end ranges are process-wide and closed by id, so any
interleaving (A start, B start, A end, B end) closes the right range. For the same reason
``torch.profiler`` labels are opened with ``_record_function_enter_new`` (which returns a
handle) and closed with that handle, not through ``record_function``'s context manager
(which also pushes onto the experimental CUPTI monitor's per-thread stack).

Off by default. When off, ``start_phase``/``end_phase``/``phase_range`` read one module
flag and return; they allocate nothing (the name is built only when on).

Usage::

    from dbo import TraceConfig, configure, end_phase, phase_range, start_phase
    configure(TraceConfig(nvtx=True, record_function=True))
    with phase_range("attention", ubatch_id=0, layer=3):
        ...
    h = start_phase("dispatch_send", ubatch_id=1, layer=3)   # may span a greenlet switch
    ...
    end_phase(h)
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

# Colours of the two ubatches (ARGB); any other ubatch id is grey.
UBATCH_COLORS: tuple[int, ...] = (0xFF1F77B4, 0xFFFF7F0E)
OTHER_COLOR = 0xFF7F7F7F

PHASES: tuple[str, ...] = (
    "attention",
    "router",
    "dispatch_send",
    "dispatch_recv",
    "experts",
    "combine_send",
    "own_experts",
    "combine_recv",
    "shared_experts",
)
"""The phases the MoE layer and model use; any other string is allowed too."""


@dataclass(frozen=True, kw_only=True)
class TraceConfig:
    """Which range annotations ``start_phase``/``end_phase`` emit."""

    nvtx: bool = False
    """Emit NVTX start/end ranges (``nvtx`` package; else torch.cuda.nvtx on CUDA)."""
    record_function: bool = False
    """Also open ``torch.profiler`` labels (~4 us each) so ranges show in Kineto traces."""
    domain: str = "dbo"
    """NVTX domain of the ranges (the ``nvtx`` package backend only)."""

    def __post_init__(self) -> None:
        if not isinstance(self.domain, str) or not self.domain:
            raise ValueError(f"TraceConfig.domain must be a non-empty string, got {self.domain!r}")


@dataclass(frozen=True, slots=True)
class PhaseHandle:
    """An open range, returned by ``start_phase`` and consumed by ``end_phase``.

    Owned by the ubatch that opened it; never shared between ubatches.
    """

    name: str
    nvtx_id: Any
    """The NVTX backend's range id, or None when NVTX is off."""
    record: Any
    """The profiler's RecordFunction handle, or None when record_function is off."""
    nvtx_end: Callable[[Any], None] | None
    """Closes ``nvtx_id`` (kept so a reconfigure while open still closes it)."""
    record_exit: Callable[[Any], None] | None
    """Closes ``record``."""


class _NvtxBackend:
    """One NVTX start/end implementation: ``start(name, color) -> id`` and ``end(id)``."""

    def __init__(self, start: Callable[[str, int], Any], end: Callable[[Any], None], kind: str):
        self.start = start
        self.end = end
        self.kind = kind


def _make_nvtx_package_backend(domain_name: str) -> _NvtxBackend:
    import nvtx  # noqa: PLC0415 (optional dependency)

    domain = nvtx.get_domain(domain_name)
    attributes: dict[tuple[str, int], Any] = {}

    def start(name: str, color: int) -> Any:
        attr = attributes.get((name, color))
        if attr is None:
            attr = domain.get_event_attributes(message=name, color=color)
            attributes[(name, color)] = attr
        return domain.start_range(attr)

    return _NvtxBackend(start, domain.end_range, "nvtx")


def _make_torch_cuda_backend() -> _NvtxBackend:
    import torch  # noqa: PLC0415

    return _NvtxBackend(
        lambda name, color: torch.cuda.nvtx.range_start(name),
        torch.cuda.nvtx.range_end,
        "torch.cuda.nvtx",
    )


def _select_nvtx_backend(domain_name: str) -> _NvtxBackend | None:
    """The best available NVTX start/end implementation, or None (logged once)."""
    try:
        return _make_nvtx_package_backend(domain_name)
    except ImportError:
        pass
    import torch  # noqa: PLC0415

    if torch.cuda.is_available():
        _log_once("nvtx package not installed: using torch.cuda.nvtx.range_start/range_end "
                  "(no domain, no colours); pip install nvtx for both")
        return _make_torch_cuda_backend()
    _log_once("NVTX ranges requested but neither the nvtx package nor CUDA is available: "
              "NVTX ranges are off (pip install nvtx)")
    return None


_logged: set[str] = set()


def _log_once(message: str) -> None:
    if message not in _logged:
        _logged.add(message)
        logger.warning(message)


class _State:
    """Module state: set only by ``configure``; read on every call."""

    def __init__(self) -> None:
        self.config = TraceConfig()
        self.nvtx: _NvtxBackend | None = None
        self.record_enter: Callable[[str, Any], Any] | None = None
        self.record_exit: Callable[[Any], None] | None = None


_ENABLED = False
_STATE = _State()


def configure(config: TraceConfig) -> None:
    """Turn phase ranges on or off for the whole process.

    Best called outside a DBO step. A handle remembers how to close what it opened, so
    reconfiguring while ranges are open is safe: ``end_phase`` still closes them.
    """
    global _ENABLED
    if not isinstance(config, TraceConfig):
        raise TypeError(f"configure() takes a TraceConfig, got {type(config).__name__}")
    _STATE.config = config
    _STATE.nvtx = _select_nvtx_backend(config.domain) if config.nvtx else None
    if config.record_function:
        import torch  # noqa: PLC0415

        _STATE.record_enter = torch.ops.profiler._record_function_enter_new
        _STATE.record_exit = torch.ops.profiler._record_function_exit._RecordFunction
    else:
        _STATE.record_enter = _STATE.record_exit = None
    _ENABLED = _STATE.nvtx is not None or _STATE.record_enter is not None


def current_config() -> TraceConfig:
    """The configuration last passed to ``configure`` (default: everything off)."""
    return _STATE.config


def enabled() -> bool:
    """True when ``start_phase`` emits anything."""
    return _ENABLED


def nvtx_backend() -> str | None:
    """Name of the NVTX implementation in use (``nvtx``, ``torch.cuda.nvtx``) or None."""
    return None if _STATE.nvtx is None else _STATE.nvtx.kind


def phase_name(phase: str, *, ubatch_id: int, layer: int | None = None) -> str:
    """``ub<ubatch_id>/L<layer>/<phase>``, or ``ub<ubatch_id>/<phase>`` without a layer."""
    if layer is None:
        return f"ub{ubatch_id}/{phase}"
    return f"ub{ubatch_id}/L{layer}/{phase}"


def start_label(name: str, *, ubatch_id: int | None = None) -> PhaseHandle | None:
    """Open a range with a free-form ``name``; None when ranges are off.

    ``ubatch_id`` picks the colour. Pass the result to ``end_phase``.
    """
    if not _ENABLED:
        return None
    if ubatch_id is not None and 0 <= ubatch_id < len(UBATCH_COLORS):
        color = UBATCH_COLORS[ubatch_id]
    else:
        color = OTHER_COLOR
    nvtx = _STATE.nvtx
    nvtx_id = nvtx.start(name, color) if nvtx is not None else None
    enter = _STATE.record_enter
    record = enter(name, None) if enter is not None else None
    return PhaseHandle(
        name,
        nvtx_id,
        record,
        nvtx.end if nvtx is not None else None,
        _STATE.record_exit if record is not None else None,
    )


def start_phase(phase: str, *, ubatch_id: int, layer: int | None = None) -> PhaseHandle | None:
    """Open the range ``ub<ubatch_id>/L<layer>/<phase>``; None when ranges are off.

    The range may stay open across greenlet switches; close it with ``end_phase``.
    """
    if not _ENABLED:
        return None
    return start_label(phase_name(phase, ubatch_id=ubatch_id, layer=layer), ubatch_id=ubatch_id)


def end_phase(handle: PhaseHandle | None) -> None:
    """Close a range opened by ``start_phase``/``start_label`` (None is a no-op)."""
    if handle is None:
        return
    if handle.record_exit is not None:
        handle.record_exit(handle.record)
    if handle.nvtx_end is not None:
        handle.nvtx_end(handle.nvtx_id)


class _Range:
    """Context manager over ``start_label``/``end_phase`` (made only when ranges are on)."""

    __slots__ = ("_name", "_ubatch_id", "_handle")

    def __init__(self, name: str, ubatch_id: int | None) -> None:
        self._name = name
        self._ubatch_id = ubatch_id
        self._handle: PhaseHandle | None = None

    def __enter__(self) -> PhaseHandle | None:
        self._handle = start_label(self._name, ubatch_id=self._ubatch_id)
        return self._handle

    def __exit__(self, *exc: object) -> None:
        end_phase(self._handle)
        self._handle = None


class _NullRange:
    """The shared do-nothing context manager returned while ranges are off."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


_NULL_RANGE = _NullRange()


def phase_range(phase: str, *, ubatch_id: int, layer: int | None = None) -> _Range | _NullRange:
    """``with phase_range("experts", ubatch_id=0, layer=3): ...``.

    Safe to hold across a greenlet switch (start/end ranges, closed by handle). Returns a
    shared no-op object, allocating nothing, while ranges are off.
    """
    if not _ENABLED:
        return _NULL_RANGE
    return _Range(phase_name(phase, ubatch_id=ubatch_id, layer=layer), ubatch_id)


def label_range(name: str, *, ubatch_id: int | None = None) -> _Range | _NullRange:
    """``with label_range("step/3"): ...``: a free-form range, same rules as ``phase_range``."""
    if not _ENABLED:
        return _NULL_RANGE
    return _Range(name, ubatch_id)


def step_name(step: int) -> str:
    """``step/<step>``: the label name the analyzer takes as a step window by default."""
    return f"step/{step}"
