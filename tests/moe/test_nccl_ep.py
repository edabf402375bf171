"""Layer 1 (CPU): backend `nccl_ep`'s refusals and options, without NCCL EP. What it needs
is checked before anything is built, in the order a user can act on: nccl-extensions
installed, a CUDA device, an NCCL >= 2.29 loaded. The backend itself runs on GPUs only
(tests/moe/test_nccl_ep_gpu.py)."""
from __future__ import annotations

import sys
import types

import pytest
import torch

from moe.backends import NCCLEPOptions, backend_class
from moe.backends.nccl_ep_support import check_nccl_ep_rows, nccl_ep_installed, require_nccl_ep
from moe.config import MoEConfig


def _one_line(exc: pytest.ExceptionInfo) -> str:
    message = str(exc.value)
    assert "\n" not in message, message
    return message


def test_importing_the_backend_imports_no_nccl_package():
    import moe.backends.nccl_ep  # noqa: F401
    assert "nccl.ep" not in sys.modules and "nccl.core" not in sys.modules


def test_without_nccl_extensions_it_says_how_to_get_them():
    with pytest.raises(ImportError) as exc:
        require_nccl_ep(installed=lambda: False)
    message = _one_line(exc)
    assert "backend 'nccl_ep' needs NCCL EP (nccl.ep), which is not installed" in message
    assert "pip install nccl-extensions" in message and "'a2a_ll'" in message


def test_the_layer_refuses_before_building_anything():
    if nccl_ep_installed() and torch.cuda.is_available():
        pytest.skip("NCCL EP and a GPU are here: the GPU tests build the layer")
    cfg = MoEConfig(num_experts=4, top_k=2, hidden_size=16, intermediate_size=8,
                    dtype=torch.bfloat16, max_tokens_per_rank=8, backend="nccl_ep")
    with pytest.raises((ImportError, ValueError)) as exc:
        backend_class("nccl_ep", 2).check_runs(2, cfg)
    assert "backend 'nccl_ep'" in _one_line(exc)


def test_no_cuda_is_named_after_the_install():
    with pytest.raises(ValueError) as exc:
        require_nccl_ep(installed=lambda: True, cuda_available=lambda: False)
    assert "has no CUDA device" in _one_line(exc)


@pytest.mark.parametrize("version,found", [((2, 28, 9), "NCCL 2.28.9"), (None, "no NCCL")])
def test_an_old_nccl_is_named_with_its_version(version, found):
    with pytest.raises(ImportError) as exc:
        require_nccl_ep(installed=lambda: True, cuda_available=lambda: True,
                        nccl_version=lambda: version)
    message = _one_line(exc)
    assert "needs NCCL >= 2.29" in message and f"this process runs {found}" in message


def test_a_new_enough_nccl_returns_the_module():
    module = types.ModuleType("nccl.ep")
    assert require_nccl_ep(installed=lambda: True, cuda_available=lambda: True,
                           nccl_version=lambda: (2, 30, 7), find=lambda: module) is module
    with pytest.raises(ImportError, match="nccl.ep could not be imported"):
        require_nccl_ep(installed=lambda: True, cuda_available=lambda: True,
                        nccl_version=lambda: (2, 29, 0), find=lambda: None)


def test_rows_must_be_bf16_and_a_multiple_of_16_bytes_or_256_values_for_ll():
    check_nccl_ep_rows(7168, torch.bfloat16, "ll")
    check_nccl_ep_rows(136, torch.bfloat16, "ht")
    with pytest.raises(ValueError, match="moves torch.bfloat16 tokens only"):
        check_nccl_ep_rows(256, torch.float32, "ll")
    with pytest.raises(ValueError, match="hidden_size=12 bf16 values are 24 bytes"):
        check_nccl_ep_rows(12, torch.bfloat16, "ht")
    with pytest.raises(ValueError, match="multiple of 512 bf16 values, but hidden_size=256"):
        check_nccl_ep_rows(256, torch.bfloat16, "ll")


def test_options_are_checked_and_agreed():
    assert NCCLEPOptions().mode == "ll" and NCCLEPOptions(mode="ht", num_sms=24).num_sms == 24
    with pytest.raises(ValueError, match="'fast' is not an nccl_ep mode"):
        NCCLEPOptions(mode="fast")
    for bad in (-1, True, 2.0):
        with pytest.raises(ValueError, match="NCCLEPOptions.num_sms"):
            NCCLEPOptions(num_sms=bad)
    cfg = MoEConfig(num_experts=4, top_k=2, hidden_size=16, intermediate_size=8,
                    max_tokens_per_rank=8, backend="nccl_ep",
                    backend_options=NCCLEPOptions(mode="ht", num_sms=8))
    fields = backend_class("nccl_ep", 2).agreement_fields(cfg)
    assert fields == {"nccl_ep_mode": "ht", "nccl_ep_num_sms": 8}


class _FakeEP:
    """Stand-in for `nccl.ep`: descriptors and bundles that record what they were made of."""

    class Tensor:
        def __init__(self, t: torch.Tensor) -> None:
            self.key = (t.data_ptr(), tuple(t.shape), t.dtype)

    class DispatchInputs:
        def __init__(self, **fields) -> None:
            self.fields = fields

    DispatchConfig = DispatchInputs


def test_descriptors_are_reused_for_the_same_address_shape_and_dtype():
    from moe.backends.nccl_ep_support import Descriptors
    d = Descriptors(_FakeEP(), size=2)
    a, b = torch.zeros(4, 3), torch.zeros(4, 3)
    assert d.of(a) is d.of(a) and d.of(a) is not d.of(b)
    assert d.of(a[:2]) is not d.of(a)  # same address, another shape
    bundle, held = d.bundle("DispatchInputs", tokens=a, topk_weights=b)
    assert d.bundle("DispatchInputs", topk_weights=b, tokens=a)[0] is bundle
    assert [h.key for h in held] == [d.of(a).key, d.of(b).key]  # what the caller holds
    assert bundle.fields["tokens"].key == (a.data_ptr(), (4, 3), torch.float32)
    config, none = d.bundle("DispatchConfig", send_only=1)
    assert none == (1,) and d.bundle("DispatchConfig", send_only=0)[0] is not config
    first = d.of(a)
    d.of(b), d.of(torch.zeros(1))  # the oldest of size=2 goes
    assert d.of(a) is not first
