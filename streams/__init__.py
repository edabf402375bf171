"""Compute/comm streams, per-ubatch events, CPU stand-ins, cheap stream switching, and
GEMMs that leave SMs to the comm kernels beside them."""
from streams.current import CurrentStream
from streams.gemm_carveout import carveout_supported, gemm_sm_carveout
from streams.standins import StandInEvent, StandInStream
from streams.stream_set import StreamSet, comm_stream_for, new_comm_stream, resolve_device

__all__ = ["CurrentStream", "StandInEvent", "StandInStream", "StreamSet", "carveout_supported",
           "comm_stream_for", "gemm_sm_carveout", "new_comm_stream", "resolve_device"]
