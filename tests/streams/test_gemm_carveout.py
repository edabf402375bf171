"""Layer 1 (CPU; one GPU-marked test): the GEMM SM carveout (`streams.gemm_carveout`),
its DBOConfig field, the runner's use of it around a split step and the bench's switch. torch's two process-wide settings are
replaced by fakes here, so that the CPU build (which has no cuBLASLt) can check what is
set and what is restored; on a GPU the real settings take the same path."""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import pytest
import torch

from dbo.cli.bench.config import BenchConfig
from dbo.cli.bench.launch import build_parser, config_from_args
from dbo.config import DBOConfig
from dbo.runner import DBORunner
from dbo.yield_points import dbo_enabled, dbo_yield
from streams.gemm_carveout import carveout_supported, gemm_sm_carveout

CUDA = torch.device("cuda", 0)  # a device object only: nothing runs on it


class FakeTorchSettings:
    """Stands in for preferred_blas_library and the SM carveout getter/setter."""

    def __init__(self) -> None:
        self.backend: Any = "cublas"
        self.carveout: Optional[int] = None
        self.calls = 0

    def preferred_blas_library(self, backend: Any = None) -> Any:
        if backend is not None:
            self.calls += 1
            self.backend = backend
        return self.backend

    def set_carveout(self, value: Optional[int]) -> None:
        self.calls += 1
        self.carveout = value

    def get_carveout(self) -> Optional[int]:
        return self.carveout

    @property
    def state(self) -> tuple[Any, Optional[int]]:
        return self.backend, self.carveout


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeTorchSettings:
    settings = FakeTorchSettings()
    monkeypatch.setattr(torch.backends.cuda, "preferred_blas_library",
                        settings.preferred_blas_library)
    monkeypatch.setattr(torch._C, "_set_sm_carveout_experimental", settings.set_carveout,
                        raising=False)
    monkeypatch.setattr(torch._C, "_get_sm_carveout_experimental", settings.get_carveout,
                        raising=False)
    monkeypatch.setattr(torch.version, "hip", None)
    return settings


def test_sets_cublaslt_and_the_carveout_then_restores(fake: FakeTorchSettings) -> None:
    with gemm_sm_carveout(4, CUDA):
        assert fake.state == ("cublaslt", 4)
    assert fake.state == ("cublas", None)


def test_restores_when_the_block_raises(fake: FakeTorchSettings) -> None:
    with pytest.raises(RuntimeError, match="boom"):
        with gemm_sm_carveout(8, CUDA):
            raise RuntimeError("boom")
    assert fake.state == ("cublas", None)


def test_nested_blocks_restore_the_outer_setting(fake: FakeTorchSettings) -> None:
    with gemm_sm_carveout(4, CUDA):
        with gemm_sm_carveout(16, CUDA):
            assert fake.state == ("cublaslt", 16)
        assert fake.state == ("cublaslt", 4)
    assert fake.state == ("cublas", None)


@pytest.mark.parametrize("num_sms", [None, 0])
def test_none_or_zero_changes_nothing(fake: FakeTorchSettings, num_sms: Optional[int]) -> None:
    with gemm_sm_carveout(num_sms, CUDA):
        assert fake.state == ("cublas", None)
    assert fake.calls == 0


def test_cpu_changes_nothing(fake: FakeTorchSettings) -> None:
    assert not carveout_supported(torch.device("cpu"))
    with gemm_sm_carveout(4, torch.device("cpu")):
        assert fake.state == ("cublas", None)
    assert fake.calls == 0


def test_rocm_and_torch_without_the_setting_change_nothing(
        fake: FakeTorchSettings, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.version, "hip", "6.2")
    assert not carveout_supported(CUDA)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.delattr(torch._C, "_set_sm_carveout_experimental")
    assert not carveout_supported(CUDA)
    with gemm_sm_carveout(4, CUDA):
        pass
    assert fake.calls == 0


@pytest.mark.parametrize("bad", [-1, True, 2.5, "4"])
def test_bad_counts_are_rejected(fake: FakeTorchSettings, bad: Any) -> None:
    with pytest.raises(ValueError, match="num_sms"):
        with gemm_sm_carveout(bad, torch.device("cpu")):
            pass
    with pytest.raises(ValueError, match="gemm_sm_carveout"):
        DBOConfig(gemm_sm_carveout=bad)


def test_dbo_config_default_and_off() -> None:
    assert DBOConfig().gemm_sm_carveout == 4
    assert DBOConfig(gemm_sm_carveout=None).gemm_sm_carveout is None
    assert DBOConfig(gemm_sm_carveout=0).gemm_sm_carveout == 0


class Recorder(torch.nn.Module):
    """Notes, in every forward call, the carveout in force (via the patched context)."""

    def __init__(self, active: list) -> None:
        super().__init__()
        self.active = active
        self.seen: list[tuple[bool, Any]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append((dbo_enabled(), self.active[-1] if self.active else None))
        dbo_yield()
        return x * 2


def test_runner_holds_the_carveout_around_a_split_step_only(
        monkeypatch: pytest.MonkeyPatch) -> None:
    active: list = []

    @contextlib.contextmanager
    def recording(num_sms: Optional[int], device: torch.device) -> Iterator[None]:
        active.append((num_sms, device.type))
        try:
            yield
        finally:
            active.pop()

    monkeypatch.setattr("dbo.runner.gemm_sm_carveout", recording)
    model = Recorder(active)
    config = DBOConfig(min_decode_tokens=4, gemm_sm_carveout=6)
    runner = DBORunner(model, config)
    x = torch.arange(8.0).unsqueeze(1)
    assert torch.equal(runner(x), x * 2)
    assert model.seen == [(True, (6, "cpu"))] * 2  # both ubatches, inside the block
    assert active == []
    model.seen.clear()
    runner(x[:2])  # below min_decode_tokens: unsplit, no carveout
    assert model.seen == [(False, None)]


def test_bench_switch_reaches_the_dbo_config() -> None:
    from dbo.cli.bench.workload import WorkloadFactory

    for argv, value in (([], BenchConfig.gemm_sm_carveout), (["--gemm-sm-carveout", "0"], 0),
                        (["--gemm-sm-carveout", "8"], 8)):
        cfg = config_from_args(build_parser().parse_args(["--device", "cpu", *argv]), {})
        assert cfg.gemm_sm_carveout == value and cfg.summary()["gemm_sm_carveout"] == value
        factory = WorkloadFactory(cfg, group=None, device=torch.device("cpu"))
        assert factory.dbo_config.gemm_sm_carveout == value
    assert BenchConfig.gemm_sm_carveout == DBOConfig().gemm_sm_carveout
    with pytest.raises(ValueError, match="gemm_sm_carveout=-1"):
        BenchConfig(gemm_sm_carveout=-1)



@pytest.mark.gpu
def test_real_settings_on_a_gpu() -> None:
    """torch's own settings: set inside, restored after; a matmul inside agrees with one
    outside (another kernel, so not bitwise)."""
    device = torch.device("cuda", torch.cuda.current_device())
    if not carveout_supported(device):
        pytest.skip("this torch has no SM carveout setting (or runs on ROCm)")
    before = (torch.backends.cuda.preferred_blas_library(),
              torch._C._get_sm_carveout_experimental())
    a = torch.randn(2048, 1024, device=device, dtype=torch.bfloat16)
    b = torch.randn(1024, 4096, device=device, dtype=torch.bfloat16)
    outside = a @ b
    with gemm_sm_carveout(4, device):
        assert torch._C._get_sm_carveout_experimental() == 4
        assert "Cublaslt" in str(torch.backends.cuda.preferred_blas_library())
        inside = a @ b
    after = (torch.backends.cuda.preferred_blas_library(),
             torch._C._get_sm_carveout_experimental())
    assert after == before
    torch.testing.assert_close(inside.float(), outside.float(), rtol=2e-2, atol=1e-1)
