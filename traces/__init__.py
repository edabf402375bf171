"""traces: greenlet-safe phase ranges, trace readers, the overlap analyzer, timelines."""
from traces.analyze import AnalyzeConfig, DeviceReport, Report, analyze
from traces.classify import DEFAULT_COMM_PATTERNS, ClassifyConfig
from traces.model import KernelInterval, Label, ReadConfig, Trace
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
from traces.readers import read_chrome_trace, read_nsys_sqlite, read_trace

__all__ = ["AnalyzeConfig", "ClassifyConfig", "DEFAULT_COMM_PATTERNS", "DeviceReport",
           "KernelInterval", "Label", "PHASES", "PhaseHandle", "ReadConfig", "Report",
           "Trace", "TraceConfig", "analyze", "configure", "end_phase", "label_range",
           "phase_name", "phase_range", "read_chrome_trace", "read_nsys_sqlite", "read_trace",
           "start_label", "start_phase", "step_name"]
