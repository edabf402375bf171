"""CPU stand-ins for CUDA streams and events.

Without CUDA the scheduler runs unchanged on these: `record`/`wait` do nothing to the
work (CPU ops run in program order), but each one can be appended to a shared log, so
tests can check the bookkeeping (which stream is current after a switch, that an event
is recorded before a yield, that the sync variants record and then wait).
"""
from __future__ import annotations

from typing import Optional

OpLog = list[tuple[str, ...]]


def _noop(_: object) -> None:
    pass


class StandInStream:
    """Stands in for `torch.cuda.Stream`: a name, and a log for `wait_event`."""

    def __init__(self, name: str, log: Optional[OpLog] = None) -> None:
        self.name = name
        self.log = log
        if log is None:
            # Called on every hand-off: without a log, a plain function (no bound method
            # to build, no test of the log) is the cheapest thing that can be called.
            self.wait_event = _noop  # type: ignore[method-assign]

    def wait_event(self, event: "StandInEvent") -> None:
        if self.log is not None:
            self.log.append(("wait", self.name, event.name))

    def synchronize(self) -> None:
        pass

    def __repr__(self) -> str:
        return f"StandInStream({self.name!r})"


class StandInEvent:
    """Stands in for `torch.cuda.Event`: `record(stream)` logs, when there is a log."""

    def __init__(self, name: str, log: Optional[OpLog] = None) -> None:
        self.name = name
        self.log = log
        if log is None:
            self.record = _noop  # type: ignore[method-assign]  # see StandInStream

    def record(self, stream: StandInStream) -> None:
        if self.log is not None:
            self.log.append(("record", self.name, stream.name))

    def wait(self, stream: StandInStream) -> None:
        stream.wait_event(self)

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def __repr__(self) -> str:
        return f"StandInEvent({self.name!r})"
