"""Layer 1 (CPU): expert kernels (`moe.experts`), the dense reference (`moe.reference`), shared experts.

Shape legend: N rows, K top-k, E local experts, H hidden, I intermediate.

Every kernel is checked against `naive_experts`, a per-token, per-k loop written here.
Tolerances: float32 paths agree to ~1e-5 (only summation order differs). In bfloat16
the `grouped` kernel runs its GEMMs in bfloat16 (fp32 accumulation inside the GEMM, but
the gate/up output, the activation and the expert output are each rounded to bf16, 8
mantissa bits, ~0.4% relative each), so we allow 3% of the output scale; the `reference`
kernel upcasts to float32 and rounds only the final sum, so it gets one bf16 ulp (1%).
"""
from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from moe.config import MoEConfig
from moe.experts import EXPERTS, experts_class, make_experts
from moe.experts.base import Experts
from moe.experts.grouped import GroupedExperts, grouped_mm_unsupported_reason
from moe.experts import grouped as grouped_module
from moe.experts.reference import ReferenceExperts
from moe.reference import init_moe_weights, reference_moe
from moe.router import route
from moe.shared import SharedExperts
from moe.workspace import Workspace


def naive_experts(x_NH, w13_EIH, w2_EHI, ids_NK, weights_NK) -> torch.Tensor:
    inter = w2_EHI.shape[2]
    out = torch.zeros(x_NH.shape, dtype=torch.float64)
    for n in range(x_NH.shape[0]):
        for k in range(ids_NK.shape[1]):
            e = int(ids_NK[n, k])
            if e < 0:
                continue
            h = w13_EIH[e].double() @ x_NH[n].double()
            act = F.silu(h[:inter]) * h[inter:]
            out[n] += float(weights_NK[n, k]) * (w2_EHI[e].double() @ act)
    return out


def make_inputs(num_rows: int, top_k: int, num_experts: int, hidden: int, inter: int,
                dtype: torch.dtype = torch.float32, drop: float = 0.0, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_rows, hidden, generator=gen).to(dtype)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden**0.5).to(dtype)
    w2 = (torch.randn(num_experts, hidden, inter, generator=gen) / inter**0.5).to(dtype)
    # Distinct ids per row when possible (as top-k gives), repeats otherwise.
    scores = torch.rand(num_rows, max(num_experts, top_k), generator=gen)
    ids = scores.argsort(dim=1)[:, :top_k] % num_experts
    ids = torch.where(torch.rand(num_rows, top_k, generator=gen) < drop, -1, ids)
    weights = torch.rand(num_rows, top_k, generator=gen)
    return x, w13, w2, ids.long(), weights.float()


KERNELS = {
    "reference": ReferenceExperts,
    "grouped": GroupedExperts,
    "grouped_loop": lambda: GroupedExperts(use_grouped_mm=False),
}


def check(kernel: Experts, x, w13, w2, ids, weights, workspace: Workspace | None = None):
    out = kernel.apply(x, w13, w2, ids, weights, workspace=workspace)
    want = naive_experts(x, w13, w2, ids, weights)
    assert out.shape == x.shape and out.dtype == x.dtype
    if x.dtype == torch.float32:
        torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=1e-5)
    else:
        rel = 1e-2 if isinstance(kernel, ReferenceExperts) else 3e-2
        scale = max(float(want.abs().max()), 1.0) if want.numel() else 1.0
        torch.testing.assert_close(out.double(), want, atol=rel * scale, rtol=rel)
    return out


CASES = [
    # N, K, E, H, I
    (0, 2, 4, 16, 8),
    (1, 1, 1, 16, 8),
    (1, 8, 64, 16, 8),
    (7, 1, 3, 32, 16),
    (33, 8, 8, 16, 8),
    (20, 2, 64, 16, 8),  # most experts get no rows
    (17, 4, 5, 13, 7),  # odd sizes: grouped falls back to the loop
    (9, 3, 2, 24, 12),  # K > E: rows repeat an expert
]


@pytest.mark.parametrize("kernel_name", list(KERNELS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("num_rows", "top_k", "num_experts", "hidden", "inter"), CASES)
def test_kernel_matches_naive(kernel_name, dtype, num_rows, top_k, num_experts, hidden,
                              inter) -> None:
    kernel = KERNELS[kernel_name]()
    inputs = make_inputs(num_rows, top_k, num_experts, hidden, inter, dtype, drop=0.2)
    check(kernel, *inputs, workspace=Workspace())
    check(kernel, *inputs)


@pytest.mark.parametrize("kernel_name", list(KERNELS))
def test_dropped_slots_contribute_nothing(kernel_name: str) -> None:
    kernel = KERNELS[kernel_name]()
    x, w13, w2, ids, weights = make_inputs(6, 3, 4, 16, 8)
    ids[0] = -1  # a row with no local expert
    ids[1, 1] = -1
    weights = torch.where(ids < 0, float("nan"), weights)  # must be ignored, not multiplied
    out = check(kernel, x, w13, w2, ids, torch.nan_to_num(weights))
    out_nan = kernel.apply(x, w13, w2, ids, weights)
    assert torch.equal(out_nan, out)
    assert torch.equal(out[0], torch.zeros(16))


@pytest.mark.parametrize("kernel_name", list(KERNELS))
def test_all_rows_to_one_expert(kernel_name: str) -> None:
    x, w13, w2, _, weights = make_inputs(12, 2, 4, 16, 8)
    ids = torch.tensor([[2, 2]] * 12)
    check(KERNELS[kernel_name](), x, w13, w2, ids, weights)
    check(KERNELS[kernel_name](), x, w13, w2, torch.full((12, 2), -1), weights)


def test_grouped_paths() -> None:
    aligned = make_inputs(10, 2, 4, 16, 8)
    odd = make_inputs(10, 2, 4, 13, 7)
    kernel = GroupedExperts()
    kernel.apply(*aligned)
    assert kernel.last_path == "grouped_mm"  # this torch build runs grouped_mm on CPU
    kernel.apply(*odd)
    assert kernel.last_path == "loop"
    assert "multiples of 4" in grouped_mm_unsupported_reason(odd[0], odd[1], odd[2])
    with pytest.raises(RuntimeError, match="multiples"):
        GroupedExperts(use_grouped_mm=True).apply(*odd)
    strided = aligned[1].transpose(1, 2).contiguous().transpose(1, 2)
    assert "contiguous" in grouped_mm_unsupported_reason(aligned[0], strided, aligned[2])
    forced = GroupedExperts(use_grouped_mm=False)
    forced.apply(*aligned)
    assert forced.last_path == "loop"


def test_grouped_falls_back_when_grouped_mm_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """A build whose grouped_mm raises (e.g. CUDA before sm90 in torch 2.8) uses the loop."""

    def broken(*args, **kwargs):
        raise RuntimeError("grouped gemm is only supported on SM90")

    inputs = make_inputs(10, 2, 4, 16, 8)
    want = ReferenceExperts().apply(*inputs)
    monkeypatch.setattr(grouped_module, "_probe_results", {})
    monkeypatch.setattr(grouped_module, "_grouped_mm_fn", lambda: broken)
    assert "SM90" in grouped_mm_unsupported_reason(*inputs[:3])  # the probe caught it
    kernel = GroupedExperts()
    torch.testing.assert_close(kernel.apply(*inputs), want, atol=2e-5, rtol=1e-5)
    assert kernel.last_path == "loop"
    # A failure the probe did not see (passes the probe, raises on the real call).
    monkeypatch.setattr(grouped_module, "_probe_results", {})
    monkeypatch.setattr(grouped_module, "_probe", lambda device, dtype: None)
    torch.testing.assert_close(kernel.apply(*inputs), want, atol=2e-5, rtol=1e-5)
    assert kernel.last_path == "loop"
    with pytest.raises(RuntimeError, match="SM90"):
        GroupedExperts(use_grouped_mm=True).apply(*inputs)


def test_grouped_fallback_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    grouped_module._logged_reasons.clear()
    odd = make_inputs(5, 2, 4, 13, 7)
    with caplog.at_level(logging.WARNING, logger="moe.experts.grouped"):
        for _ in range(3):
            GroupedExperts().apply(*odd)
    messages = [r.getMessage() for r in caplog.records if "mm loop" in r.getMessage()]
    assert len(messages) == 1 and "H=13" in messages[0]


@pytest.mark.parametrize("kernel_name", ["grouped", "grouped_loop"])
def test_workspace_reused_and_outputs_not_aliased(kernel_name: str) -> None:
    kernel = KERNELS[kernel_name]()
    ws = Workspace()
    big = make_inputs(32, 4, 8, 16, 8, seed=1)
    small = make_inputs(5, 4, 8, 16, 8, seed=2)
    out_big = kernel.apply(*big, workspace=ws)
    allocations, nbytes = ws.num_allocations, ws.nbytes
    assert allocations > 0
    kept = out_big.clone()
    for inputs in (small, big, small):
        kernel.apply(*inputs, workspace=ws)
    assert (ws.num_allocations, ws.nbytes) == (allocations, nbytes)  # no growth after warmup
    assert torch.equal(out_big, kept)  # results never live in workspace memory
    again = kernel.apply(*big, workspace=ws)
    assert torch.equal(again, out_big)  # deterministic


def test_input_contract_errors() -> None:
    x, w13, w2, ids, weights = make_inputs(4, 2, 3, 16, 8)
    kernel = GroupedExperts()
    with pytest.raises(TypeError, match="int64"):
        kernel.apply(x, w13, w2, ids.int(), weights)
    with pytest.raises(TypeError, match="float32"):
        kernel.apply(x, w13, w2, ids, weights.half())
    with pytest.raises(TypeError, match="one dtype"):
        kernel.apply(x.bfloat16(), w13, w2, ids, weights)
    with pytest.raises(ValueError, match="w2 has shape"):
        kernel.apply(x, w13, w2[:, :, :4], ids, weights)
    with pytest.raises(ValueError, match="w13 has shape"):
        kernel.apply(x, w13[:, :, :5], w2, ids, weights)
    with pytest.raises(ValueError, match="topk_weights shape"):
        kernel.apply(x, w13, w2, ids, weights[:, :1])
    with pytest.raises(ValueError, match="topk_ids has shape"):
        kernel.apply(x, w13, w2, ids[:3], weights[:3])
    with pytest.raises(ValueError, match="local ids"):
        ReferenceExperts().apply(x, w13, w2, ids + 3, weights)


@settings(max_examples=25, deadline=None)
@given(
    num_rows=st.integers(0, 24),
    top_k=st.integers(1, 8),
    num_experts=st.integers(1, 64),
    hidden=st.sampled_from([4, 8, 12, 16, 5]),
    inter=st.sampled_from([4, 8, 3]),
    drop=st.sampled_from([0.0, 0.3, 1.0]),
    seed=st.integers(0, 1000),
)
def test_grouped_matches_reference_random(num_rows, top_k, num_experts, hidden, inter, drop,
                                          seed) -> None:
    inputs = make_inputs(num_rows, top_k, num_experts, hidden, inter, drop=drop, seed=seed)
    want = ReferenceExperts().apply(*inputs)
    for kernel in (GroupedExperts(), GroupedExperts(use_grouped_mm=False)):
        torch.testing.assert_close(kernel.apply(*inputs, workspace=Workspace()), want,
                                   atol=2e-5, rtol=1e-5)


# --- registry ---------------------------------------------------------------------------


def test_registry() -> None:
    assert set(EXPERTS) == {"reference", "grouped", "triton"}
    assert experts_class("reference") is ReferenceExperts
    assert experts_class("grouped") is GroupedExperts
    assert isinstance(make_experts("auto", "cpu"), GroupedExperts)  # triton is CUDA-only
    assert isinstance(make_experts("reference", torch.device("cpu")), ReferenceExperts)
    with pytest.raises(ValueError, match="auto, grouped, reference, triton"):
        make_experts("cutlass", "cpu")
    with pytest.raises(ValueError, match="meta"):
        make_experts("grouped", "meta")


class _NeverAvailable(ReferenceExperts):
    name = "never"

    @classmethod
    def is_available(cls, device: torch.device) -> tuple[bool, str]:
        return False, "needs a flux capacitor (pip install flux)"


def test_registry_unavailable_and_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(EXPERTS, "never", f"{__name__}:_NeverAvailable")
    monkeypatch.setitem(EXPERTS, "missing", "moe.experts.no_such_module:Missing")
    with pytest.raises(ValueError, match="'never' is not available on cpu: needs a flux"):
        make_experts("never", "cpu")
    with pytest.raises(ValueError, match="cannot import moe.experts.no_such_module"):
        make_experts("missing", "cpu")


# --- dense reference, weights, shared experts --------------------------------------------


def _layer_via_kernel(x, weights, config, shared=None):
    """Router + ReferenceExperts: the path a MoE layer takes, for comparison."""
    logits = F.linear(x, weights["router_weight"])
    w, ids = route(logits, config, correction_bias_E=weights.get("e_score_correction_bias"))
    if config.apply_router_weight_on_input:
        x, w = (x.float() * w).to(x.dtype), torch.ones_like(w)
    out = ReferenceExperts().apply(x, weights["w13"], weights["w2"], ids, w)
    return out if shared is None else out + shared(x)


@pytest.mark.parametrize(
    "overrides",
    [
        dict(),
        dict(scoring="sigmoid", use_correction_bias=True, n_group=4, topk_group=2,
             routed_scaling_factor=2.5, renormalize=True),
        dict(top_k=1, apply_router_weight_on_input=True, scoring="sigmoid", renormalize=False),
    ],
    ids=["softmax", "deepseek", "weight_on_input"],
)
def test_reference_moe(overrides: dict) -> None:
    config = MoEConfig(**{**dict(num_experts=8, top_k=2, hidden_size=16, intermediate_size=8),
                          **overrides})
    weights = init_moe_weights(config, seed=3)
    x = torch.randn(11, 16, generator=torch.Generator().manual_seed(4))
    out = reference_moe(x, router_weight_EH=weights["router_weight"], w13_EIH=weights["w13"],
                        w2_EHI=weights["w2"], config=config,
                        correction_bias_E=weights.get("e_score_correction_bias"))
    torch.testing.assert_close(out, _layer_via_kernel(x, weights, config), atol=2e-5, rtol=1e-5)
    assert 0.05 < out.std().item() < 5.0  # init keeps activations O(1)


def test_reference_moe_with_shared_experts_and_errors() -> None:
    config = MoEConfig(num_experts=4, top_k=2, hidden_size=16, intermediate_size=8,
                       num_shared_experts=2)
    weights = init_moe_weights(config, seed=0)
    shared = SharedExperts.from_config(config, seed=1)
    assert shared.gate_up.weight.shape == (32, 16) and shared.down.weight.shape == (16, 16)
    x = torch.randn(5, 16)
    kwargs = dict(router_weight_EH=weights["router_weight"], w13_EIH=weights["w13"],
                  w2_EHI=weights["w2"], config=config)
    with_shared = reference_moe(x, **kwargs, shared_experts=shared)
    without = reference_moe(x, **kwargs)
    with torch.no_grad():
        torch.testing.assert_close(with_shared - without, shared(x), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="w13_EIH has shape"):
        reference_moe(x, **{**kwargs, "w13_EIH": weights["w13"][:2]})
    with pytest.raises(ValueError, match="num_shared_experts=0"):
        SharedExperts.from_config(MoEConfig(num_experts=4, top_k=2, hidden_size=16,
                                            intermediate_size=8), seed=0)


def test_init_moe_weights() -> None:
    config = MoEConfig(num_experts=8, top_k=2, hidden_size=16, intermediate_size=8,
                       scoring="sigmoid", use_correction_bias=True, dtype=torch.bfloat16)
    full = init_moe_weights(config, seed=7)
    assert full["router_weight"].shape == (8, 16) and full["w13"].shape == (8, 16, 16)
    assert full["w2"].shape == (8, 16, 8) and full["e_score_correction_bias"].shape == (8,)
    assert full["w13"].dtype == torch.bfloat16
    assert full["e_score_correction_bias"].dtype == torch.float32
    again = init_moe_weights(config, seed=7)
    assert all(torch.equal(full[k], again[k]) for k in full)
    other = init_moe_weights(config, seed=8)
    assert not torch.equal(full["w13"], other["w13"])
    # An EP rank's slice equals the same slice of the full set.
    rank1 = init_moe_weights(config, seed=7, num_local_experts=4, first_expert=4)
    assert torch.equal(rank1["w13"], full["w13"][4:]) and torch.equal(rank1["w2"], full["w2"][4:])
    assert torch.equal(rank1["router_weight"], full["router_weight"])
    with pytest.raises(ValueError, match="do not fit"):
        init_moe_weights(config, seed=7, num_local_experts=4, first_expert=6)


def test_shared_experts_forward_bf16() -> None:
    shared = SharedExperts(hidden_size=16, intermediate_size=8, dtype=torch.bfloat16)
    out = shared(torch.randn(3, 16, dtype=torch.bfloat16))
    assert out.shape == (3, 16) and out.dtype == torch.bfloat16
