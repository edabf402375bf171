"""The normalized trace form shared by the readers, the analyzer and the timeline.

Times are microseconds on the trace's own clock. Label names follow ``dbo.ranges``:
``ub<ubatch>/L<layer>/<phase>``.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

_LABEL_RE = re.compile(r"^(?:ub(?P<ub>\d+)/)?(?:L(?P<layer>\d+)/)?(?P<phase>[^/]+)$")


@dataclass(frozen=True, kw_only=True)
class ReadConfig:
    """What the readers turn into kernel intervals."""

    include_memcpy: bool = True
    """Keep memory copies (``gpu_memcpy`` / ``CUPTI_ACTIVITY_KIND_MEMCPY``) as intervals."""
    include_memset: bool = True
    """Keep memsets (``gpu_memset`` / ``CUPTI_ACTIVITY_KIND_MEMSET``) as intervals."""
    cpu_ops_as_kernels: bool | None = None
    """Chrome only: treat ``cpu_op`` events as kernels, device = process id and stream =
    thread id, so CPU-only traces can be analyzed. None: only when the trace has no GPU
    kernels; False: never (a CPU trace then has zero devices); True: always."""
    max_unpacked_bytes: int = 512 << 20
    """The most bytes a gzip-compressed trace may unpack to (512 MiB): a file that unpacks
    to more is refused, not read into memory (or, for an SQLite export, onto the disk).
    Raise it for a trace that is really larger (`dbo inspect --max-unpacked-mb N`)."""

    def __post_init__(self) -> None:
        limit = self.max_unpacked_bytes
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ValueError(f"max_unpacked_bytes={limit!r}: must be an int >= 1 (the bytes "
                             f"a gzip-compressed trace may unpack to)")


@dataclass(frozen=True, slots=True)
class KernelInterval:
    """One kernel (or copy, or CPU op) execution on a device stream, in microseconds."""

    device: int
    stream: int
    name: str
    start_us: float
    end_us: float
    category: str = "kernel"
    """``kernel``, ``memcpy``, ``memset`` or ``cpu_op``."""
    launch_us: float | None = None
    """CPU time of the launch call, when the trace links it."""
    launch_tid: int | None = None
    """CPU thread of the launch call, when the trace links it."""


@dataclass(frozen=True, kw_only=True)
class LabelName:
    """The parts of a ``ub<u>/L<l>/<phase>`` label name (None where absent)."""

    ubatch: int | None
    layer: int | None
    phase: str | None


def parse_label_name(name: str) -> LabelName:
    """Split ``ub0/L3/dispatch`` into ubatch 0, layer 3, phase ``dispatch``.

    ``ub1/attention`` has no layer; ``L3/experts`` no ubatch. A name with neither an
    ``ub`` nor an ``L`` prefix (``ProfilerStep#2``, ``aten::mm``) is not a phase label.
    """
    match = _LABEL_RE.match(name)
    if match is None or (match["ub"] is None and match["layer"] is None):
        return LabelName(ubatch=None, layer=None, phase=None)
    return LabelName(
        ubatch=None if match["ub"] is None else int(match["ub"]),
        layer=None if match["layer"] is None else int(match["layer"]),
        phase=match["phase"],
    )


@dataclass(frozen=True, kw_only=True)
class Label:
    """A named time span: an NVTX range or a profiler annotation, in microseconds."""

    name: str
    start_us: float
    end_us: float
    device: int | None
    """The GPU of a device-side span; None for a CPU-side span (CPU clock)."""
    ubatch: int | None
    layer: int | None
    phase: str | None
    tid: int | None = None
    """CPU thread of a CPU-side span, when known."""
    stream: int | None = None
    """Stream of a device-side span, when known (Kineto splits a GPU annotation per
    stream: one range that launched on two streams appears as two spans)."""

    @classmethod
    def from_name(
        cls,
        name: str,
        *,
        start_us: float,
        end_us: float,
        device: int | None,
        tid: int | None = None,
        stream: int | None = None,
    ) -> Label:
        """A label whose ubatch/layer/phase are parsed from ``name``."""
        parts = parse_label_name(name)
        return cls(
            name=name,
            start_us=start_us,
            end_us=end_us,
            device=device,
            ubatch=parts.ubatch,
            layer=parts.layer,
            phase=parts.phase,
            tid=tid,
            stream=stream,
        )


@dataclass(kw_only=True)
class Trace:
    """A normalized trace: what the analyzer and the timeline read."""

    kernels: list[KernelInterval]
    labels: list[Label]
    source: str
    """The file it was read from (or a description)."""
    notes: list[str] = field(default_factory=list)
    """Things a reader noticed (e.g. no GPU kernels), shown in the report."""

    @property
    def devices(self) -> list[int]:
        """Devices with at least one kernel, sorted."""
        return sorted({k.device for k in self.kernels})
