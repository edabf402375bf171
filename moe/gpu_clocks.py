"""The SM clock, power draw and power-cap state of a CUDA device, as the driver reports them.

Why benchmarks print this: an H200 running expert GEMMs back to back reaches its 700 W
cap within about a second; from then on its SM clock sits at 1300-1600 MHz instead of
1980 (BENCHMARKS.md section 2, session 10). A timing taken in a short burst and one taken
under sustained load can differ by that much, and so can two paths timed one after the
other. Printing the clock beside each time tells them apart.

Read with one `nvidia-smi` query (tens of ms; call it while the GPU is busy, not in a
timed region). `read_clocks` returns None where that cannot work (a CPU device, no
`nvidia-smi`, a GPU it does not list): callers print "-".
"""
from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass

import torch

__all__ = ["ClockSample", "parse_smi", "read_clocks"]

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


def read_clocks(device: torch.device, *, timeout_s: float = 5.0) -> ClockSample | None:
    """The current sample of `device` (matched by UUID, so CUDA_VISIBLE_DEVICES does not
    matter), or None where it cannot be read."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    uuid = str(getattr(torch.cuda.get_device_properties(index), "uuid", ""))
    if not uuid:
        return None
    try:
        done = subprocess.run(
            [smi, f"--query-gpu={_QUERY}", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=timeout_s, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return parse_smi(done.stdout, uuid) if done.returncode == 0 else None
