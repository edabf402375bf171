"""The SM clock, power draw and power-cap state of a CUDA device, as the driver reports them.

Why benchmarks print this: an H200 running expert GEMMs back to back reaches its 700 W
cap within about a second; from then on its SM clock sits at 1300-1600 MHz instead of
1980 (BENCHMARKS.md section 2). A timing taken in a short burst and one taken
under sustained load can differ by that much, and so can two paths timed one after the
other. Printing the clock beside each time tells them apart.

Read with one `nvidia-smi` query (tens of ms; call it while the GPU is busy, not in a
timed region). `read_clocks` returns None where that cannot work (a CPU device, no
`nvidia-smi`, a GPU it does not list): callers print "-".

`ClockLog` samples in the background instead (`nvidia-smi -lms`), for code whose timed
steps leave no moment to ask: name stretches of time with `span(key)`, then `stop()`
and read each key's median clock with `summary(key)`.
"""
from __future__ import annotations

import contextlib
import shutil
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime
from typing import IO, Hashable, Iterable, Iterator, Optional

import torch

__all__ = ["ClockLog", "ClockSample", "parse_smi", "read_clocks", "summarize"]

# Bits of NVML's clocks-event (throttle) reasons that mean "held back by power".
_SW_POWER_CAP = 0x4
_HW_POWER_BRAKE = 0x80
_QUERY = "uuid,clocks.sm,power.draw,clocks_throttle_reasons.active"


@dataclass(frozen=True)
class ClockSample:
    """One reading of one GPU."""

    sm_mhz: float
    power_w: float | None  # None where the board does not report it
    power_capped: bool  # the driver is lowering clocks to stay under the power limit


def parse_smi(text: str, uuid: str) -> ClockSample | None:
    """The sample of the GPU `uuid` (with or without the "GPU-" prefix) from the CSV
    lines of `nvidia-smi --query-gpu=<_QUERY> --format=csv,noheader,nounits`; None if
    it is not listed or its clock is not a number."""
    want = uuid.removeprefix("GPU-")
    for line in text.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) != 4 or fields[0].removeprefix("GPU-") != want:
            continue
        try:
            sm_mhz = float(fields[1])
        except ValueError:
            return None
        try:
            power_w: float | None = float(fields[2])
        except ValueError:  # "[N/A]"
            power_w = None
        try:
            reasons = int(fields[3], 16)
        except ValueError:
            reasons = 0
        return ClockSample(sm_mhz, power_w, bool(reasons & (_SW_POWER_CAP | _HW_POWER_BRAKE)))
    return None


def summarize(samples: Iterable[ClockSample]) -> Optional[dict[str, object]]:
    """{"sm_mhz": median clock, "capped": "k/n" power-capped of n} over `samples`, or None
    when there are none."""
    samples = list(samples)
    if not samples:
        return None
    return {"sm_mhz": statistics.median(s.sm_mhz for s in samples),
            "capped": f"{sum(s.power_capped for s in samples)}/{len(samples)}"}


def _tool_and_uuid(device: torch.device) -> tuple[str, str] | None:
    """(nvidia-smi's path, the device's UUID), or None where the clock cannot be read."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    uuid = str(getattr(torch.cuda.get_device_properties(index), "uuid", ""))
    return (smi, uuid) if uuid else None


def read_clocks(device: torch.device, *, timeout_s: float = 5.0) -> ClockSample | None:
    """The current sample of `device` (matched by UUID, so CUDA_VISIBLE_DEVICES does not
    matter), or None where it cannot be read."""
    found = _tool_and_uuid(device)
    if found is None:
        return None
    smi, uuid = found
    try:
        done = subprocess.run(
            [smi, f"--query-gpu={_QUERY}", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=timeout_s, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return parse_smi(done.stdout, uuid) if done.returncode == 0 else None


def parse_log_line(line: str, uuid: str) -> tuple[float, ClockSample] | None:
    """(wall time in s since the epoch, sample) from one line of `nvidia-smi
    --query-gpu=timestamp,<_QUERY> --format=csv,noheader,nounits -lms N`, or None."""
    stamp, _, rest = line.partition(",")
    try:
        when = datetime.strptime(stamp.strip(), "%Y/%m/%d %H:%M:%S.%f").timestamp()
    except ValueError:
        return None
    sample = parse_smi(rest, uuid)
    return None if sample is None else (when, sample)


class ClockLog:
    """One GPU's clock, sampled every `interval_ms` by an `nvidia-smi -lms` process from
    `start` to `stop`, and named stretches of time (`span`) to summarize.

    nvidia-smi stamps each line with the wall clock (local time, as `time.time()` reads it),
    so samples are matched to spans by time. It writes to a temporary file (a pipe would
    fill and stall it on a long run), read once, at `stop`.
    """

    def __init__(self, process: subprocess.Popen, output: IO[str], uuid: str) -> None:
        self._process = process
        self._output = output
        self._uuid = uuid
        self._spans: list[tuple[Hashable, float, float]] = []
        self._samples: Optional[list[tuple[float, ClockSample]]] = None

    @classmethod
    def start(cls, device: torch.device, *, interval_ms: int = 100) -> Optional["ClockLog"]:
        """A running log of `device`, or None where the clock cannot be read."""
        found = _tool_and_uuid(device)
        if found is None:
            return None
        smi, uuid = found
        output = tempfile.TemporaryFile("w+")
        try:
            process = subprocess.Popen(
                [smi, f"--query-gpu=timestamp,{_QUERY}", "--format=csv,noheader,nounits",
                 "-lms", str(interval_ms)],
                stdout=output, stderr=subprocess.DEVNULL, text=True)
        except OSError:
            output.close()
            return None
        return cls(process, output, uuid)

    @contextlib.contextmanager
    def span(self, key: Hashable) -> Iterator[None]:
        """Name the time spent inside the block `key` (a key may have many spans)."""
        begin = time.time()
        try:
            yield
        finally:
            self._spans.append((key, begin, time.time()))

    def stop(self, *, timeout_s: float = 5.0) -> None:
        """End the sampling and read what it wrote (idempotent)."""
        if self._samples is not None:
            return
        self._process.terminate()
        try:
            self._process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self._output.seek(0)
        parsed = (parse_log_line(line, self._uuid) for line in self._output.read().splitlines())
        self._output.close()
        self._samples = [p for p in parsed if p is not None]

    def summary(self, key: Hashable) -> Optional[dict[str, object]]:
        """{"sm_mhz": median clock, "capped": "k/n"} over the samples inside `key`'s spans
        (after `stop`), or None when none fell inside."""
        if self._samples is None:
            raise RuntimeError("ClockLog.summary: call stop() first")
        spans = [(a, b) for k, a, b in self._spans if k == key]
        return summarize(s for t, s in self._samples if any(a <= t <= b for a, b in spans))
