"""Layer 1 (CPU): backend `symm_mem` and DeepEP's low-latency buffers never share a
process (`moe.backends.nvshmem_owner`). Once `symm_mem` has made its symmetric buffers
(torch symmetric memory starts NVSHMEM), a DeepEP low-latency buffer (`deepep_ll`'s
shared buffer, the raw `deepep_raw_ll` yardstick of `dbo bench-comm`) raises
RuntimeError naming both and the fix instead of making one (DeepEP's first low-latency
kernel would abort the process); the reverse order raises likewise; DeepEP's normal
buffers are unaffected. The command lines that would run both refuse before any rank
starts: tests/tools/test_bench.py, test_bench_comm.py, test_bench_hf.py.

Stand-ins: torch's symmetric-memory calls make plain CPU tensors, and a `deep_ep` module
whose `Buffer` records what it was asked to make.
"""
from __future__ import annotations

import contextlib
import sys
import types
from typing import Any

import pytest
import torch

import moe.backends.deepep_support as deepep_support
import moe.backends.nvshmem_owner as nvshmem_owner
from moe.backends.deepep_support import shared_buffer
from moe.backends.nvshmem_owner import check_one_process, nvshmem_users, symm_mem_started_nvshmem
from moe.backends.symm_mem_support import SymmBuffers
from moe.bench.comm_engines import Shapes
from moe.bench.comm_raw import DeepEPRawSource

CPU = torch.device("cpu")


class FakeGroup:
    """Stands for a process group where only its identity matters (held weakly)."""

    def size(self) -> int:
        return 2


class FakeBuffer:
    """`deep_ep.Buffer`: records the keyword arguments of every buffer made."""

    made: list[dict[str, Any]] = []

    def __init__(self, group: Any, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0,
                 **kwargs: Any) -> None:
        FakeBuffer.made.append(dict(kwargs, num_rdma_bytes=num_rdma_bytes))

    def destroy(self) -> None:
        pass


@pytest.fixture
def fresh_process(monkeypatch: pytest.MonkeyPatch) -> types.SimpleNamespace:
    """A process that has made no symmetric memory and no DeepEP buffer, with stand-ins
    for torch's symmetric memory (CPU tensors) and for `deep_ep`: `deep_ep` (the stand-in
    module) and `symm_made` (the shapes of the symmetric tensors made)."""
    import torch.distributed._symmetric_memory as symm

    monkeypatch.setattr(nvshmem_owner, "_CLAIMS", [])
    monkeypatch.setattr(deepep_support, "_ENTRIES", [])
    made: list[tuple[int, ...]] = []
    monkeypatch.setattr(symm, "empty", lambda shape, dtype, device: (
        made.append(tuple(shape)) or torch.zeros(shape, dtype=dtype)))
    monkeypatch.setattr(symm, "rendezvous", lambda tensor, group_name: None)
    monkeypatch.setattr(symm, "get_backend", lambda device: "NVSHMEM")
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    # The stand-ins play a GPU process: DeepEP's own check for a CUDA device passes.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    fake = types.ModuleType("deep_ep")
    fake.__spec__ = types.SimpleNamespace(name="deep_ep")  # type: ignore[assignment]
    fake.Buffer = FakeBuffer  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "deep_ep", fake)
    FakeBuffer.made = []
    return types.SimpleNamespace(deep_ep=fake, symm_made=made)


def allocate_symm_mem() -> SymmBuffers:
    """`symm_mem`'s first set of symmetric buffers (what its first dispatch makes)."""
    return SymmBuffers.allocate(rows=4, row_bytes=32, hidden=8, dtype=torch.float32,
                                world_size=2, group_name="0", device=CPU)


def ll_buffer(deep_ep: types.ModuleType, group: FakeGroup) -> Any:
    return shared_buffer(deep_ep, group, "ll", num_rdma_bytes=1 << 20, num_qps_per_rank=4)


def test_deepep_ll_after_symm_mem_raises_naming_both_and_the_fix(fresh_process):
    assert not symm_mem_started_nvshmem()
    allocate_symm_mem()
    assert symm_mem_started_nvshmem() and fresh_process.symm_made
    group = FakeGroup()
    with pytest.raises(RuntimeError) as exc:
        ll_buffer(fresh_process.deep_ep, group)
    message = str(exc.value)
    assert "\n" not in message
    assert message.startswith("backend 'deepep_ll' would make a DeepEP low-latency buffer in "
                              "a process where backend 'symm_mem' has started NVSHMEM")
    assert "run symm_mem and deepep_ll in separate processes" in message
    assert FakeBuffer.made == []
    # DeepEP's normal buffers set no NVSHMEM IBGDA settings: still made.
    shared_buffer(fresh_process.deep_ep, group, "ht", num_nvl_bytes=1024)
    assert [b["low_latency_mode"] for b in FakeBuffer.made] == [False]


def test_raw_low_latency_yardstick_after_symm_mem_raises(fresh_process):
    allocate_symm_mem()
    shapes = Shapes(hidden=2048, top_k=2, num_experts=8, dtype=torch.bfloat16)
    group: Any = FakeGroup()
    raw = DeepEPRawSource("deepep_raw_ll", shapes, group, tokens=(16,))
    with pytest.raises(RuntimeError, match="backend 'deepep_raw_ll' would make a DeepEP "
                                           "low-latency buffer .* run symm_mem and "
                                           "deepep_raw_ll in separate processes"):
        raw._buffer()
    assert FakeBuffer.made == [] and raw.buffer is None


def test_symm_mem_after_a_deepep_low_latency_buffer_raises(fresh_process):
    group = FakeGroup()
    ll_buffer(fresh_process.deep_ep, group)
    assert [b["low_latency_mode"] for b in FakeBuffer.made] == [True]
    assert nvshmem_users() == ("deepep_ll",)
    with pytest.raises(RuntimeError) as exc:
        allocate_symm_mem()
    message = str(exc.value)
    assert "\n" not in message
    assert message.startswith("backend 'symm_mem' would start NVSHMEM (torch symmetric "
                              "memory) in a process where backend 'deepep_ll' has made a "
                              "DeepEP low-latency buffer")
    assert "run deepep_ll and symm_mem in separate processes" in message
    assert nvshmem_users() == ("deepep_ll",) and fresh_process.symm_made == []


@pytest.mark.parametrize("backends, runs", [
    (("a2a_ll", "symm_mem", "deepep_ll"), "--backends a2a_ll,symm_mem, then --backends deepep_ll"),
    (("symm_mem", "deepep_raw_ht", "deepep_raw_ll", "deepep_ht", "deepep_ll", "a2a_ll"),
     "--backends symm_mem,deepep_raw_ht,deepep_ht,a2a_ll, then --backends "
     "deepep_raw_ll,deepep_ll"),
])
def test_a_backend_list_with_both_is_refused_with_the_two_runs(backends, runs):
    with pytest.raises(ValueError) as exc:
        check_one_process(backends)
    assert "\n" not in str(exc.value) and str(exc.value).endswith(runs)
    assert "symm_mem cannot run in one process with" in str(exc.value)


@pytest.mark.parametrize("backends", [
    ("symm_mem", "a2a_ll", "deepep_ht", "deepep_raw_ht"), ("deepep_ll", "deepep_raw_ll"), ()])
def test_a_backend_list_without_both_is_accepted(backends):
    check_one_process(backends)
