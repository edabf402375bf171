"""Layer 1 (CPU, one process; the Triton experts' part under TRITON_INTERPRET=1): who
says the experts share the SMs with other streams' kernels, and what the fused-MoE host
does with it. The modular kernel tells its experts in a DBO step and inside
`sharing_sms(model)` (the bench's ceiling probe), never otherwise; the Triton experts
hand it to `fused_moe`; its rules then take no persistent GEMM, whatever the policy
says (`moe.kernels.fused_moe.rules.choose_paths`)."""
from __future__ import annotations

import dataclasses
import types

import pytest
import torch
from torch import nn

import moe.layer
from dbo import DBOConfig, DBORunner
from moe import MoEConfig, MoELayer, init_moe_weights
from moe.experts.reference import ReferenceExperts
from moe.experts.triton import TritonExperts
from moe.kernels.fused_moe.rules import choose_paths
from moe.kernels.policy import KernelPolicy
from moe.modular_kernel import sharing_sms

SPLIT = DBOConfig(split="tokens", min_decode_tokens=0, min_prefill_tokens=0)


class SpyExperts(ReferenceExperts):
    """The reference experts, logging the `sms_shared` of each call."""

    def __init__(self) -> None:
        self.seen: list[bool] = []

    def apply(self, *args, sms_shared: bool = False, **kwargs):
        self.seen.append(sms_shared)
        return super().apply(*args, **kwargs)


@pytest.mark.filterwarnings("ignore::dbo.runner.NoYieldWarning")  # backend local: no yields
def test_the_layer_tells_its_experts_in_a_dbo_step_and_where_marked(
        monkeypatch: pytest.MonkeyPatch) -> None:
    spy = SpyExperts()
    monkeypatch.setattr(moe.layer, "make_experts", lambda *args, **kwargs: spy)
    cfg = MoEConfig(num_experts=4, top_k=2, hidden_size=16, intermediate_size=16)
    layer = MoELayer(cfg)
    layer.load_weights(init_moe_weights(cfg, seed=0))
    model = nn.Sequential(nn.Identity(), layer)
    x = torch.randn(14, 16)
    with torch.no_grad():
        plain = layer(x)
        with sharing_sms(model):
            marked = layer(x)
        after = layer(x)
        DBORunner(layer, SPLIT)(x)  # two ubatches, one experts call each
    assert spy.seen == [False, True, False, True, True]
    assert layer.sms_shared is False  # the mark is taken off again
    # The reference experts ignore the flag: the same result either way.
    assert torch.equal(plain, marked) and torch.equal(plain, after)


@pytest.mark.triton
def test_the_triton_experts_hand_it_to_fused_moe(monkeypatch: pytest.MonkeyPatch) -> None:
    ok, reason = TritonExperts.is_available(torch.device("cpu"))
    if not ok:
        pytest.skip(reason)
    import moe.kernels.fused_moe.host as fm

    seen = []
    monkeypatch.setattr(fm, "fused_moe", lambda x, *a, **kw: seen.append(
        (kw["policy"].persistent, kw["sms_shared"])) or x)
    gen = torch.Generator().manual_seed(0)
    x, w13, w2 = (torch.randn(*shape, generator=gen) for shape in ((4, 16), (2, 16, 16),
                                                                     (2, 16, 8)))
    ids = torch.tensor([[0], [1], [-1], [0]])
    weights = torch.ones(4, 1)
    experts = TritonExperts(policy=KernelPolicy(persistent=True))
    experts.apply(x, w13, w2, ids, weights)
    experts.apply(x, w13, w2, ids, weights, sms_shared=True)
    assert seen == [(True, False), (True, True)]


def _paths(policy: KernelPolicy, x, *, sms_shared: bool, tma_reason: str | None = None,
           num_routed: int = 8, inter: int = 8):
    return choose_paths(policy, x, num_experts=2, inter=inter, num_routed=num_routed,
                        block_m=None, tma_reason=tma_reason, sms_shared=sms_shared)


def test_shared_sms_take_no_persistent_gemm_whatever_the_policy() -> None:
    # The rules' own choice (policy None) on a deep, full GEMM pair of a GPU (a stand-in
    # for x: the rules read its shape, device and size only): persistent unless shared.
    gpu_x = types.SimpleNamespace(shape=(1024, 8192), device=torch.device("cuda"),
                                  numel=lambda: 1024 * 8192, element_size=lambda: 2)
    own = _paths(KernelPolicy(), gpu_x, sms_shared=False, num_routed=2048, inter=2048)
    shared = _paths(KernelPolicy(), gpu_x, sms_shared=True, num_routed=2048, inter=2048)
    assert own.persistent1 and own.persistent2
    assert not shared.persistent1 and not shared.persistent2
    assert dataclasses.replace(shared, persistent1=True, persistent2=True) == own
    # A policy that asks for it is overruled too, and then asks nothing of TMA.
    x = torch.zeros(4, 16, dtype=torch.float16)
    asked = _paths(KernelPolicy(persistent=True), x, sms_shared=False)
    assert asked.persistent1 and asked.persistent2
    shared = _paths(KernelPolicy(persistent=True), x, sms_shared=True)
    assert not shared.persistent1 and not shared.persistent2
    with pytest.raises(ValueError, match=r"persistent=True.*16-bit"):
        _paths(KernelPolicy(persistent=True), x, sms_shared=False, tma_reason="16-bit data")
    assert not _paths(KernelPolicy(persistent=True), x, sms_shared=True,
                      tma_reason="16-bit data").persistent1
