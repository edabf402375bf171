"""Tests of the streams: stream sets, stand-ins, the GEMM carveout (the lowest layer)."""
