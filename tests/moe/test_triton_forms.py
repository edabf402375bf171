"""Layer 3 (the Triton interpreter on CPU; GPU-marked on CUDA): the Triton experts compute
every expert form of `moe.experts.form` but a "custom" activation -- the named
activations gated and not, interleaved gate/up, biases in both GEMM epilogues, GPT-OSS's
clamped SwiGLU, a post-expert norm -- against the reference experts, on the pointer,
TMA and persistent load paths; a local expert with no rows, no rows at all and every
slot on another rank; the one-line refusal of a custom activation before anything runs.

Shape legend: N rows, K top-k, E experts, H hidden, I width, J = 2I gated / I not.
Tiny shapes: every Triton program runs in Python here (about 0.2 s a call).
"""
from __future__ import annotations

import pytest
import torch

from moe.experts import make_experts
from moe.experts.form import DEFAULT_FORM, ExpertExtras, ExpertForm
from moe.experts.reference import ReferenceExperts
from moe.experts.triton import TritonExperts
from moe.kernels.policy import KernelPolicy
from tests.moe.triton_problems import bf16_dot_in_interpreter  # noqa: F401 (fixture)

pytestmark = pytest.mark.triton

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
N, K, E, H, I = 12, 2, 4, 16, 8

FORMS = {
    "gelu_bias": ExpertForm(activation="gelu", bias=True),
    "gelu_tanh_interleaved": ExpertForm(activation="gelu_tanh", interleaved=True),
    "relu_clamped": ExpertForm(activation="relu", swiglu_limit=0.5),
    "relu2_no_gate": ExpertForm(gated=False, activation="relu2"),
    "sigmoid_no_gate_bias": ExpertForm(gated=False, activation="sigmoid", bias=True),
    "silu_no_gate_post_norm": ExpertForm(gated=False, post_norm=True),
    "gpt_oss": ExpertForm(activation="swiglu_oai", swiglu_alpha=1.702, swiglu_limit=0.8,
                          interleaved=True, bias=True),
    "post_norm_bias": ExpertForm(post_norm=True, bias=True),
}

# Against the float32 reference. fp32: the same float32 maths (tl.erf / tl.sigmoid for
# torch's erf / sigmoid, gelu_tanh as x * sigmoid(2u)), sums over H and I in other
# orders: a few 1e-7 at outputs of O(1) (measured <= 5e-7), so 1e-5 leaves room yet
# catches any wrong term (a missed bias or clamp moves outputs by O(0.1)). fp16 / bf16:
# the kernel rounds the activation and each output row to the dtype (2^-11 / 2^-8
# relative) where the reference stays in fp32, as `triton_problems.TOLERANCES` says.
TOLERANCES = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=1e-2, rtol=1e-2),
    torch.bfloat16: dict(atol=4e-2, rtol=4e-2),
}


@pytest.fixture(autouse=True)
def _needs_triton() -> None:
    ok, reason = TritonExperts.is_available(DEVICE)
    if not ok:
        pytest.skip(reason)


def _norm(y_MH: torch.Tensor) -> torch.Tensor:
    return y_MH * torch.rsqrt(y_MH.pow(2).mean(-1, keepdim=True) + 1e-6) * 0.5


def _problem(form: ExpertForm, *, num_rows: int = N, dtype: torch.dtype = torch.float32,
             seed: int = 0):
    """x, w13, w2, ids, weights, extras; expert E - 1 gets no rows, slot (0, 1) is another
    rank's (-1)."""
    gen = torch.Generator().manual_seed(seed)
    j = form.rows_per_width() * I
    x = torch.randn(num_rows, H, generator=gen)
    w13 = torch.randn(E, j, H, generator=gen) / H ** 0.5
    w2 = torch.randn(E, H, I, generator=gen) / I ** 0.5
    ids = torch.randint(0, E - 1, (num_rows, K), generator=gen)
    if num_rows:
        ids[0, 1] = -1
    weights = torch.rand(num_rows, K, generator=gen)
    cast = dict(device=DEVICE, dtype=dtype)
    extras = ExpertExtras(
        form=form,
        bias13_EJ=torch.randn(E, j, generator=gen).to(DEVICE) if form.bias else None,
        bias2_EH=torch.randn(E, H, generator=gen).to(**cast) if form.bias else None,
        post_norm=_norm if form.post_norm else None)
    return (x.to(**cast), w13.to(**cast), w2.to(**cast), ids.to(DEVICE), weights.to(DEVICE),
            extras)


@pytest.mark.parametrize("name", FORMS)
def test_each_form_matches_the_reference_in_fp32(name):
    x, w13, w2, ids, weights, extras = _problem(FORMS[name])
    assert not (ids == E - 1).any()  # a local expert with no rows
    out = TritonExperts().apply(x, w13, w2, ids, weights, extras=extras)
    want = ReferenceExperts().apply(x, w13, w2, ids, weights, extras=extras)
    assert out.shape == x.shape and out.dtype == x.dtype
    torch.testing.assert_close(out, want, **TOLERANCES[torch.float32])


def test_the_clamp_and_biases_change_the_result():
    """The forms above differ from the default by more than the tolerance, so a kernel
    that ignored a flag would fail them (checked on the reference: no kernel runs)."""
    for name in ("gpt_oss", "relu_clamped"):
        x, w13, w2, ids, weights, extras = _problem(FORMS[name])
        unclamped = ExpertExtras(form=ExpertForm(**{
            **{f: getattr(extras.form, f) for f in ("gated", "activation", "swiglu_alpha",
                                                     "interleaved", "bias")},
            "swiglu_limit": None}), bias13_EJ=extras.bias13_EJ, bias2_EH=extras.bias2_EH)
        ref = ReferenceExperts()
        gap = (ref.apply(x, w13, w2, ids, weights, extras=extras)
               - ref.apply(x, w13, w2, ids, weights, extras=unclamped)).abs().max()
        assert gap > 0.1, name


@pytest.mark.parametrize("name", ["gpt_oss", "post_norm_bias", "relu2_no_gate"])
def test_load_paths_agree_in_fp16(name):
    """TMA loads (interleaved: a [BLOCK_N, 2, BLOCK_K] box), the sorted x and the
    persistent GEMMs, emulated by the interpreter on CPU: the reference's result, and the
    pointer loads' bits (the same tiles, the same k order)."""
    from moe.kernels.fused_moe.host import fused_moe

    x, w13, w2, ids, weights, extras = _problem(FORMS[name], dtype=torch.float16, seed=1)
    want = ReferenceExperts().apply(x, w13, w2, ids, weights, extras=extras)
    plain = fused_moe(x, w13, w2, ids, weights, block_m=32, extras=extras,
                      policy=KernelPolicy(tma=False, persistent=False))
    torch.testing.assert_close(plain.float(), want.float(), **TOLERANCES[torch.float16])
    for policy in (KernelPolicy(tma=True, sorted_x=True, persistent=False),
                   KernelPolicy(tma=True, persistent=True)):
        out = fused_moe(x, w13, w2, ids, weights, block_m=32, extras=extras, policy=policy)
        assert torch.equal(out, plain), policy


@pytest.mark.usefixtures("bf16_dot_in_interpreter")
def test_gpt_oss_in_bf16_with_float32_biases():
    x, w13, w2, ids, weights, extras = _problem(FORMS["gpt_oss"], dtype=torch.bfloat16,
                                                 seed=2)
    assert extras.bias13_EJ.dtype == torch.float32 and extras.bias2_EH.dtype == torch.bfloat16
    out = TritonExperts().apply(x, w13, w2, ids, weights, extras=extras)
    want = ReferenceExperts().apply(x, w13, w2, ids, weights, extras=extras)
    torch.testing.assert_close(out.float(), want.float(), **TOLERANCES[torch.bfloat16])


@pytest.mark.parametrize("name", ["gpt_oss", "post_norm_bias"])
def test_no_rows_and_rows_all_elsewhere_give_zeros(name):
    x, w13, w2, ids, weights, extras = _problem(FORMS[name], num_rows=0)
    out = TritonExperts().apply(x, w13, w2, ids, weights, extras=extras)
    assert out.shape == (0, H)
    # Every slot on another rank: no expert row runs; no bias or norm leaks into the sum.
    x, w13, w2, ids, weights, extras = _problem(FORMS[name], num_rows=3)
    out = TritonExperts().apply(x, w13, w2, ids.fill_(-1), weights, extras=extras)
    assert torch.equal(out, torch.zeros_like(x))


def test_the_default_form_as_extras_is_the_plain_kernel_bit_for_bit():
    x, w13, w2, ids, weights, extras = _problem(DEFAULT_FORM, seed=3)
    kernel = TritonExperts()
    assert torch.equal(kernel.apply(x, w13, w2, ids, weights),
                       kernel.apply(x, w13, w2, ids, weights, extras=extras))


def test_a_custom_activation_is_refused_in_one_line_before_anything_runs(monkeypatch):
    import moe.kernels.fused_moe.host as fm

    custom = ExpertForm(activation="custom")
    reason = TritonExperts.supports(custom)
    assert reason is not None and "\n" not in reason
    assert "activation='custom'" in reason and "'grouped' or 'reference'" in reason
    assert all(TritonExperts.supports(form) is None for form in FORMS.values())
    assert make_experts("triton", DEVICE, form=FORMS["gpt_oss"]).name == "triton"
    with pytest.raises(ValueError, match=r"experts kernel 'triton': the triton experts "
                                         r"compute the named activations"):
        make_experts("triton", DEVICE, form=custom)

    def no_launch(*args, **kwargs):
        raise AssertionError("the routing ran before the refusal")

    monkeypatch.setattr(fm, "align_routing_triton", no_launch)
    x, w13, w2, ids, weights, _ = _problem(DEFAULT_FORM)
    extras = ExpertExtras(form=custom, gate_fn=lambda h: h[:, :I])
    for run in (TritonExperts().apply, fm.fused_moe):
        with pytest.raises(ValueError, match="activation='custom'"):
            run(x, w13, w2, ids, weights, extras=extras)


def test_a_form_under_torch_compile_runs_its_own_kernels_eagerly():
    # A compiled caller must not take the opaque op of the default form: the form's biases
    # and activation would be dropped. The form's kernels run eagerly (a graph break).
    torch._dynamo.reset()
    x, w13, w2, ids, weights, extras = _problem(FORMS["gpt_oss"])
    experts = TritonExperts()

    def step(x):
        return experts.apply(x * 1.0, w13, w2, ids, weights, extras=extras)

    out = torch.compile(step, backend="eager")(x)
    want = ReferenceExperts().apply(x, w13, w2, ids, weights, extras=extras)
    torch.testing.assert_close(out, want, **TOLERANCES[torch.float32])
