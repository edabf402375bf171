"""Layer 2 (CPU): the expert forms of `moe.experts.form` -- activations, no gate, interleaved
gate/up, biases, GPT-OSS's clamped SwiGLU, a post-expert norm, a custom gate -- in the
reference experts (against a per-token loop written out here) and the grouped experts
(against the reference, both GEMM paths); what the Triton experts refuse (the Triton
kernels run the forms in tests/moe/test_triton_forms.py); the form's own validation.

Shape legend: N rows, K top-k, E experts, H hidden, I width, J = 2I gated / I not.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moe.experts import make_experts
from moe.experts.bound import BoundExperts
from moe.experts.form import DEFAULT_FORM, ExpertExtras, ExpertForm
from moe.experts.grouped import GroupedExperts
from moe.experts.reference import ReferenceExperts
from moe.experts.triton import TritonExperts

N, K, E, H, I = 12, 2, 4, 16, 8

FORMS = {
    "default": ExpertForm(),
    "gelu_tanh": ExpertForm(activation="gelu_tanh"),
    "relu2_no_gate": ExpertForm(gated=False, activation="relu2"),
    "gelu_no_gate_bias": ExpertForm(gated=False, activation="gelu", bias=True),
    "interleaved": ExpertForm(interleaved=True),
    "gpt_oss": ExpertForm(activation="swiglu_oai", swiglu_alpha=1.702, swiglu_limit=1.5,
                          interleaved=True, bias=True),
    "clamped_silu": ExpertForm(swiglu_limit=0.5),
    "post_norm": ExpertForm(post_norm=True),
    "custom": ExpertForm(activation="custom"),
}


def _norm(y_MH: torch.Tensor) -> torch.Tensor:
    return y_MH * torch.rsqrt(y_MH.pow(2).mean(-1, keepdim=True) + 1e-6) * 0.5


def _custom_gate(h_MJ: torch.Tensor) -> torch.Tensor:
    gate, up = h_MJ.chunk(2, dim=-1)
    return torch.tanh(gate) * up  # an activation dbo has no name for


def _problem(form: ExpertForm, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    j = form.rows_per_width() * I
    x = torch.randn(N, H, generator=gen)
    w13 = torch.randn(E, j, H, generator=gen) / H ** 0.5
    w2 = torch.randn(E, H, I, generator=gen) / I ** 0.5
    ids = torch.randint(0, E, (N, K), generator=gen)
    ids[0, 1] = -1  # a slot of another rank
    weights = torch.rand(N, K, generator=gen)
    extras = ExpertExtras(
        form=form,
        bias13_EJ=torch.randn(E, j, generator=gen) if form.bias else None,
        bias2_EH=torch.randn(E, H, generator=gen) if form.bias else None,
        gate_fn=_custom_gate if form.activation == "custom" else None,
        post_norm=_norm if form.post_norm else None)
    return x, w13, w2, ids, weights, extras


def _expected(x, w13, w2, ids, weights, extras: ExpertExtras) -> torch.Tensor:
    """Token by token, the form written out in full (no shared helper of the kernels)."""
    form = extras.form
    out = torch.zeros(N, H, dtype=torch.float64)
    for n in range(N):
        for k in range(K):
            e = int(ids[n, k])
            if e < 0:
                continue
            h = w13[e].double() @ x[n].double()
            if form.bias:
                h = h + extras.bias13_EJ[e].double()
            if form.activation == "custom":
                act = _custom_gate(h[None])[0]
            elif not form.gated:
                act = {"relu2": lambda v: F.relu(v) ** 2, "gelu": F.gelu}[form.activation](h)
            else:
                gate, up = (h[0::2], h[1::2]) if form.interleaved else (h[:I], h[I:])
                if form.swiglu_limit is not None:
                    gate = gate.clamp(max=form.swiglu_limit)
                    up = up.clamp(-form.swiglu_limit, form.swiglu_limit)
                if form.activation == "swiglu_oai":
                    act = gate * torch.sigmoid(form.swiglu_alpha * gate) * (up + 1)
                else:
                    fn = {"silu": F.silu,
                          "gelu_tanh": lambda v: F.gelu(v, approximate="tanh")}[form.activation]
                    act = fn(gate) * up
            y = w2[e].double() @ act
            if form.bias:
                y = y + extras.bias2_EH[e].double()
            if form.post_norm:
                y = _norm(y[None])[0]
            out[n] += float(weights[n, k]) * y
    return out.float()


@pytest.mark.parametrize("name", FORMS)
def test_reference_experts_compute_each_form(name):
    x, w13, w2, ids, weights, extras = _problem(FORMS[name])
    out = ReferenceExperts().apply(x, w13, w2, ids, weights, extras=extras)
    # float32 kernels against a float64 loop: rounding of sums over H and I terms.
    torch.testing.assert_close(out, _expected(x, w13, w2, ids, weights, extras),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("use_grouped_mm", [None, False])
@pytest.mark.parametrize("name", FORMS)
def test_grouped_experts_equal_the_reference_for_each_form(name, use_grouped_mm):
    x, w13, w2, ids, weights, extras = _problem(FORMS[name], seed=1)
    want = ReferenceExperts().apply(x, w13, w2, ids, weights, extras=extras)
    got = GroupedExperts(use_grouped_mm=use_grouped_mm).apply(x, w13, w2, ids, weights,
                                                              extras=extras)
    # Same float32 maths, GEMMs over other row blocks: rounding only.
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_no_extras_is_the_default_form_bit_for_bit():
    x, w13, w2, ids, weights, extras = _problem(DEFAULT_FORM, seed=2)
    for kernel in (ReferenceExperts(), GroupedExperts()):
        assert torch.equal(kernel.apply(x, w13, w2, ids, weights),
                           kernel.apply(x, w13, w2, ids, weights, extras=extras))


def test_bound_experts_pass_the_layer_extras():
    x, w13, w2, ids, weights, extras = _problem(FORMS["gpt_oss"], seed=3)
    bound = BoundExperts(GroupedExperts(), lambda: extras)
    assert bound.name == "grouped"
    assert torch.equal(bound.apply(x, w13, w2, ids, weights),
                       GroupedExperts().apply(x, w13, w2, ids, weights, extras=extras))
    with pytest.raises(ValueError, match="bound already"):
        bound.apply(x, w13, w2, ids, weights, extras=extras)


def test_triton_refuses_only_a_custom_activation_in_one_line():
    """What the Triton experts compute (tests/moe/test_triton_forms.py runs them)."""
    assert all(TritonExperts.supports(form) is None
               for name, form in FORMS.items() if name != "custom")
    reason = TritonExperts.supports(FORMS["custom"])
    assert reason is not None and "\n" not in reason
    assert "activation='custom'" in reason and "'grouped'" in reason


def test_auto_picks_a_kernel_that_computes_the_form():
    assert make_experts("auto", "cpu", form=FORMS["gpt_oss"]).name == "grouped"


def test_shapes_and_extras_are_checked():
    x, w13, w2, ids, weights, extras = _problem(FORMS["relu2_no_gate"])
    # I rows read as a gated expert's 2I: w2's width disagrees.
    with pytest.raises(ValueError, match=r"w2 has shape \(4, 16, 8\): expected \[E, H, I\] = "
                                         r"\[4, 16, 4\]"):
        ReferenceExperts().apply(x, w13, w2, ids, weights)
    x, w13, w2, ids, weights, extras = _problem(FORMS["gelu_no_gate_bias"])
    bad = ExpertExtras(form=extras.form, bias13_EJ=extras.bias13_EJ[:, :3],
                       bias2_EH=extras.bias2_EH)
    with pytest.raises(ValueError, match=r"bias13 has shape \(4, 3\), expected \(4, 8\)"):
        GroupedExperts().apply(x, w13, w2, ids, weights, extras=bad)
    with pytest.raises(ValueError, match="bias13_EJ must be given"):
        ExpertExtras(form=extras.form)


@pytest.mark.parametrize("kwargs, match", [
    (dict(activation="tanh"), "ExpertForm.activation='tanh'"),
    (dict(gated=False, interleaved=True), "needs a gated expert"),
    (dict(activation="swiglu_oai"), "swiglu_alpha=None goes with activation 'swiglu_oai'"),
    (dict(swiglu_alpha=1.0), "goes with activation 'swiglu_oai'"),
    (dict(swiglu_limit=float("inf")), "must be a finite number > 0"),
    (dict(activation="custom", swiglu_limit=1.0), "'custom' activation"),
    (dict(bias=1), "ExpertForm.bias=1: must be True or False"),
])
def test_form_validation_names_the_field(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        ExpertForm(**kwargs)


@pytest.mark.gpu
@pytest.mark.parametrize("name", FORMS)
def test_grouped_experts_on_cuda_in_bfloat16_follow_the_reference(name):
    """The grouped_mm path (CUDA, bfloat16, aligned sizes) with each form, against the
    float32 reference of the same bfloat16 weights."""
    x, w13, w2, ids, weights, extras = _problem(FORMS[name], seed=5)
    cuda = dict(device="cuda")
    x, w13, w2 = (t.to(dtype=torch.bfloat16, **cuda) for t in (x, w13, w2))
    ids, weights = ids.to(**cuda), weights.to(**cuda)
    extras = ExpertExtras(
        form=extras.form, gate_fn=extras.gate_fn, post_norm=extras.post_norm,
        bias13_EJ=None if extras.bias13_EJ is None else extras.bias13_EJ.to(**cuda),
        bias2_EH=None if extras.bias2_EH is None else extras.bias2_EH.to(**cuda))
    kernel = GroupedExperts()
    got = kernel.apply(x, w13, w2, ids, weights, extras=extras)
    want = ReferenceExperts().apply(x.float(), w13.float(), w2.float(), ids, weights,
                                    extras=extras)
    assert kernel.last_path == "grouped_mm"
    # bfloat16 GEMM inputs and activation (8 bits of mantissa): a few 1e-2 of the scale.
    scale = want.abs().max().item()
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2 * scale)
