"""Tests of the traces: the phase ranges and the trace readers, analyzer and timelines."""
