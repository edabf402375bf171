"""`moe.bench.gpu_clocks` (layer 1: plain CPU; the nvidia-smi call is faked) and the GPU read.

The parser against nvidia-smi's CSV (power-cap bits, "[N/A]" fields, other GPUs'
lines, the "GPU-" prefix), `read_clocks` on CPU tensors and without the tool, and the
whole read with `nvidia-smi` and the device properties stubbed. On CUDA, one real read.
"""
from __future__ import annotations

import subprocess
from types import SimpleNamespace

import pytest
import torch

from moe.bench import gpu_clocks
from moe.bench.gpu_clocks import ClockLog, ClockSample, parse_log_line, parse_smi, read_clocks

UUID = "3e8f5a2c-1111-2222-3333-444455556666"
SMI = (
    "GPU-0000aaaa-1111-2222-3333-444455556666, 1980, 81.20, 0x0000000000000000\n"
    f"GPU-{UUID}, 1470, 692.51, 0x0000000000000004\n"
)


def test_parse_picks_the_gpu_and_reads_the_power_cap() -> None:
    assert parse_smi(SMI, UUID) == ClockSample(1470.0, 692.51, True)
    assert parse_smi(SMI, "GPU-" + UUID) == ClockSample(1470.0, 692.51, True)
    assert parse_smi(SMI, "0000aaaa-1111-2222-3333-444455556666") == ClockSample(
        1980.0, 81.2, False)
    # HW power brake counts as capped; thermal slowdown (0x20) alone does not.
    assert parse_smi(f"GPU-{UUID}, 1200, 500, 0x80", UUID).power_capped
    assert not parse_smi(f"GPU-{UUID}, 1200, 500, 0x20", UUID).power_capped


def test_parse_tolerates_missing_fields_and_rejects_others() -> None:
    sample = parse_smi(f"GPU-{UUID}, 1410, [N/A], [N/A]", UUID)
    assert sample == ClockSample(1410.0, None, False)
    assert parse_smi(f"GPU-{UUID}, [N/A], 100, 0x0", UUID) is None
    assert parse_smi(SMI, "ffffffff-0000-0000-0000-000000000000") is None
    assert parse_smi("", UUID) is None
    assert parse_smi("No devices were found", UUID) is None


def test_read_clocks_is_none_off_the_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    assert read_clocks(torch.device("cpu")) is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpu_clocks.shutil, "which", lambda name: None)
    assert read_clocks(torch.device("cuda", 0)) is None


def _fake_cuda(monkeypatch: pytest.MonkeyPatch, run: object) -> list[list[str]]:
    calls: list[list[str]] = []

    def fake_run(cmd: list[str], **kwargs: object) -> object:
        calls.append(cmd)
        return run(cmd) if callable(run) else run

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda index: SimpleNamespace(uuid=UUID if index == 1 else "other"))
    monkeypatch.setattr(gpu_clocks.shutil, "which", lambda name: "/usr/bin/nvidia-smi")
    monkeypatch.setattr(gpu_clocks.subprocess, "run", fake_run)
    return calls


def test_read_clocks_matches_the_device_by_uuid(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _fake_cuda(monkeypatch, SimpleNamespace(returncode=0, stdout=SMI))
    assert read_clocks(torch.device("cuda")) == ClockSample(1470.0, 692.51, True)
    assert calls[0][0] == "/usr/bin/nvidia-smi" and "clocks.sm" in calls[0][1]
    assert read_clocks(torch.device("cuda", 0)) is None  # index 0's uuid is not listed


@pytest.mark.parametrize("outcome", ["exit 9", "timeout", "oserror"])
def test_read_clocks_survives_a_failing_tool(monkeypatch: pytest.MonkeyPatch,
                                             outcome: str) -> None:
    def run(cmd: list[str]) -> object:
        if outcome == "timeout":
            raise subprocess.TimeoutExpired(cmd, 5.0)
        if outcome == "oserror":
            raise PermissionError("nvidia-smi")
        return SimpleNamespace(returncode=9, stdout=SMI)

    _fake_cuda(monkeypatch, run)
    assert read_clocks(torch.device("cuda", 1)) is None


def _stamp(t: float) -> str:
    from datetime import datetime

    return datetime.fromtimestamp(t).strftime("%Y/%m/%d %H:%M:%S.%f")[:-3]


def test_log_line_parsing() -> None:
    when, sample = parse_log_line(f"{_stamp(1000.25)}, GPU-{UUID}, 1455, 650.1, 0x4", UUID)
    assert when == pytest.approx(1000.25, abs=1e-3) and sample == ClockSample(1455, 650.1, True)
    assert parse_log_line(f"garbage, GPU-{UUID}, 1455, 650.1, 0x4", UUID) is None
    assert parse_log_line(f"{_stamp(1.0)}, GPU-ffff, 1455, 650.1, 0x4", UUID) is None


class _FakeLoop:
    """An `nvidia-smi -lms` process: writes its canned lines to stdout when stopped."""

    def __init__(self, lines: list[str], cmd: list[str], stdout: object, **kwargs: object) -> None:
        self.cmd, self.stdout, self.lines = cmd, stdout, lines
        self.terminated = False

    def terminate(self) -> None:
        self.terminated = True
        self.stdout.write("".join(line + "\n" for line in self.lines))  # type: ignore[attr-defined]
        self.stdout.flush()  # type: ignore[attr-defined]

    def wait(self, timeout: float | None = None) -> int:
        return 0


def test_clock_log_summarizes_each_key_over_its_spans(monkeypatch: pytest.MonkeyPatch) -> None:
    assert ClockLog.start(torch.device("cpu")) is None
    _fake_cuda(monkeypatch, SimpleNamespace(returncode=0, stdout=""))
    other = "GPU-0000aaaa-1111-2222-3333-444455556666"
    lines = [f"{_stamp(100.5)}, GPU-{UUID}, 1500, 690, 0x4",   # in a (1st span)
             f"{_stamp(100.6)}, {other}, 1980, 80, 0x0",        # another GPU: ignored
             f"{_stamp(101.5)}, GPU-{UUID}, 1900, 300, 0x0",    # in b
             f"{_stamp(102.5)}, GPU-{UUID}, 1000, 700, 0x4",    # between spans
             f"{_stamp(103.2)}, GPU-{UUID}, 1400, 695, 0x4",    # in a (2nd span)
             f"{_stamp(103.8)}, GPU-{UUID}, 1300, 699, 0x0",    # in a (2nd span)
             "not a line"]
    made: list[_FakeLoop] = []

    def popen(cmd: list[str], **kwargs: object) -> _FakeLoop:
        made.append(_FakeLoop(lines, cmd, **kwargs))
        return made[-1]

    monkeypatch.setattr(gpu_clocks.subprocess, "Popen", popen)
    log = ClockLog.start(torch.device("cuda", 1), interval_ms=50)
    assert log is not None and made[0].cmd[-2:] == ["-lms", "50"]
    clock = iter([100.0, 101.0, 101.0, 102.0, 103.0, 104.0])
    monkeypatch.setattr(gpu_clocks.time, "time", lambda: next(clock))
    for key in ("a", "b", "a"):
        with log.span(key):
            pass
    with pytest.raises(RuntimeError, match="stop"):
        log.summary("a")
    log.stop()
    log.stop()  # idempotent
    assert made[0].terminated
    assert log.summary("a") == {"sm_mhz": 1400, "capped": "2/3"}
    assert log.summary("b") == {"sm_mhz": 1900, "capped": "0/1"}
    assert log.summary("never") is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_clock_log() -> None:
    import time

    log = ClockLog.start(torch.device("cuda"), interval_ms=50)
    assert log is not None
    x = torch.randn(4096, 4096, device="cuda")
    with log.span("load"):
        end = time.time() + 0.5
        while time.time() < end:
            x @ x
        torch.cuda.synchronize()
    log.stop()
    summary = log.summary("load")
    assert summary is not None and 100 < summary["sm_mhz"] < 5000


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_read_clocks() -> None:
    sample = read_clocks(torch.device("cuda"))
    assert sample is not None, "nvidia-smi did not list this GPU's uuid"
    assert 100 < sample.sm_mhz < 5000
