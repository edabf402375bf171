"""traces: greenlet-safe phase ranges (this package's own names), and the trace tools.

Two layers live here. The phase ranges (`traces.ranges`, re-exported below) sit at the
bottom, beside `streams`: the dbo runtime core opens them, so importing `traces` must not
pull in anything above. The readers, the overlap analyzer, the timelines and `capture`
are tools: import them from their modules (`traces.analyze.analyze`,
`traces.readers.read_trace`, `traces.model.Trace`, `traces.capture.capture`, ...).
"""
from traces.ranges import (
    PHASES,
    PhaseHandle,
    TraceConfig,
    configure,
    end_phase,
    label_range,
    phase_name,
    phase_range,
    start_label,
    start_phase,
    step_name,
)

__all__ = ["PHASES", "PhaseHandle", "TraceConfig", "configure", "end_phase", "label_range",
           "phase_name", "phase_range", "start_label", "start_phase", "step_name"]
