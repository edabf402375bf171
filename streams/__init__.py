"""Compute/comm streams, per-ubatch events, CPU stand-ins and cheap stream switching."""
from streams.current import CurrentStream
from streams.standins import StandInEvent, StandInStream
from streams.stream_set import StreamSet, comm_stream_for, new_comm_stream, resolve_device

__all__ = ["CurrentStream", "StandInEvent", "StandInStream", "StreamSet", "comm_stream_for",
           "new_comm_stream", "resolve_device"]
