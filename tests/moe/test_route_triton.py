"""Layer 3 (Triton interpreter on CPU): the Triton routing kernel (`moe.kernels.route_triton`, interpreted on CPU) against
the torch ops of `moe.router.route` (the reference), over every routing variant.

Shape legend: T tokens, E experts, K top-k.

Logits are drawn so that no two choices of a token are equal: ids must then match
exactly. Weights match to a few float32 ulp (RTOL): the two paths sum the softmax
denominator and the renormalisation total in different orders, and on CPU the
interpreter's numpy exp is not torch's.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from moe import router
from moe.config import MoEConfig
from moe.kernels.policy import KernelPolicy

pytest.importorskip("triton")
pytestmark = pytest.mark.triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
RTOL = 1e-6  # ~8 float32 ulp (3 measured on CPU)
ATOL = 1e-12  # weights far below the largest one (softmax tails)


def make_config(num_experts: int, top_k: int, **routing) -> MoEConfig:
    return MoEConfig(num_experts=num_experts, top_k=top_k, hidden_size=8, intermediate_size=8,
                     **routing)


def make_logits(num_tokens: int, num_experts: int, dtype: torch.dtype,
                seed: int = 0) -> torch.Tensor:
    """Logits with distinct values in each row, exactly representable in ``dtype``."""
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.float32:
        logits_TE = 2.0 * torch.randn(num_tokens, num_experts, generator=gen)
    else:
        # bf16/fp16 randn repeats values; a shuffled grid of multiples of 1/16 does not.
        grid_E = (torch.arange(num_experts) - num_experts // 2) / 16.0
        perms_TE = torch.argsort(torch.rand(num_tokens, num_experts, generator=gen), dim=1)
        logits_TE = grid_E[perms_TE]
    return logits_TE.to(dtype).to(DEVICE)


def make_bias(num_experts: int, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (0.3 * torch.randn(num_experts, generator=gen)).to(DEVICE)


def route_with(implementation: str, monkeypatch: pytest.MonkeyPatch, logits_TE: torch.Tensor,
               config: MoEConfig, bias_E: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    config = dataclasses.replace(config, kernels=KernelPolicy(implementation=implementation))
    return router.route(logits_TE, config, correction_bias_E=bias_E)


def check_matches_torch(monkeypatch: pytest.MonkeyPatch, logits_TE: torch.Tensor,
                        config: MoEConfig, bias_E: torch.Tensor | None = None) -> None:
    want_w, want_ids = route_with("torch", monkeypatch, logits_TE, config, bias_E)
    got_w, got_ids = route_with("triton", monkeypatch, logits_TE, config, bias_E)
    expected = (logits_TE.shape[0], config.top_k)
    assert got_w.shape == got_ids.shape == expected
    assert got_w.dtype == torch.float32 and got_ids.dtype == torch.int64
    assert got_w.is_contiguous() and got_ids.is_contiguous()
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_w, want_w, rtol=RTOL, atol=ATOL)


# (E, K, routing): softmax/sigmoid x bias x groups, K in {1, 2, 8}, E not a power of two.
CASES = [
    (16, 1, dict(scoring="softmax")),
    (16, 2, dict(scoring="softmax", n_group=4, topk_group=2, renormalize=False,
                 routed_scaling_factor=2.5)),
    (16, 8, dict(scoring="sigmoid", use_correction_bias=True, n_group=4, topk_group=2,
                 routed_scaling_factor=2.5)),
    (16, 2, dict(scoring="sigmoid", use_correction_bias=True, n_group=8, topk_group=1)),
    (16, 2, dict(scoring="sigmoid", n_group=4, topk_group=4)),  # keeps every group
    (64, 8, dict(scoring="sigmoid", use_correction_bias=True, n_group=8, topk_group=4,
                 routed_scaling_factor=2.5)),  # DeepSeek-V3, scaled down
    (64, 2, dict(scoring="softmax", n_group=8, topk_group=4)),
    (64, 8, dict(scoring="softmax", use_correction_bias=True, n_group=8, topk_group=4,
                 renormalize=False)),
    (24, 8, dict(scoring="sigmoid", renormalize=False, routed_scaling_factor=0.5)),
    (60, 2, dict(scoring="softmax", use_correction_bias=True)),
    (60, 1, dict(scoring="sigmoid", use_correction_bias=True, renormalize=False,
                 routed_scaling_factor=2.5)),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("num_experts", "top_k", "routing"), CASES)
def test_triton_matches_torch(monkeypatch, num_experts, top_k, routing, dtype):
    config = make_config(num_experts, top_k, **routing)
    bias_E = make_bias(num_experts) if config.use_correction_bias else None
    # 37 tokens: the last program's block of 16 is part empty.
    check_matches_torch(monkeypatch, make_logits(37, num_experts, dtype), config, bias_E)


@pytest.mark.parametrize(("num_tokens", "block_t"), [(1, 16), (17, 16), (5, 1)])
def test_one_token_and_partial_blocks(monkeypatch, num_tokens, block_t):
    from moe.kernels import route_triton

    # The GPU takes one token per program; the interpreter 16 unless told otherwise.
    monkeypatch.setattr(route_triton, "_INTERPRETED_BLOCK_T", block_t)
    config = make_config(64, 8, scoring="sigmoid", use_correction_bias=True, n_group=8,
                         topk_group=4)
    check_matches_torch(monkeypatch, make_logits(num_tokens, 64, torch.float32, seed=3),
                        config, make_bias(64))


@pytest.mark.parametrize("layout", ["row_stride", "transposed"])
def test_non_contiguous_logits(monkeypatch, layout):
    config = make_config(24, 2, scoring="softmax")
    if layout == "row_stride":  # e.g. the router's columns of a wider GEMM output
        logits_TE = make_logits(9, 40, torch.bfloat16, seed=4)[:, 5:29]
    else:  # column stride T
        logits_TE = make_logits(24, 9, torch.float32, seed=4).t()
    assert not logits_TE.is_contiguous()
    check_matches_torch(monkeypatch, logits_TE, config)


def test_zero_tokens_launch_nothing(monkeypatch):
    from moe.kernels import route_triton

    monkeypatch.setattr(route_triton, "route_kernel", None)  # a launch would raise
    config = make_config(16, 2, scoring="sigmoid", use_correction_bias=True, n_group=4,
                         topk_group=2)
    empty_TE = torch.empty(0, 16, dtype=torch.bfloat16, device=DEVICE)
    weights_TK, ids_TK = route_with("triton", monkeypatch, empty_TE, config, make_bias(16))
    assert weights_TK.shape == ids_TK.shape == (0, 2)
    assert weights_TK.dtype == torch.float32 and ids_TK.dtype == torch.int64


def test_ties_take_the_lower_expert_and_group(monkeypatch):
    # Token 0: experts 1 and 3 tie for the best choice, 4 and 6 for the third place.
    # Token 1: groups {0..3} and {4..7} tie (max 1.0 each); only one group is kept.
    config = make_config(8, 3, scoring="sigmoid", n_group=2, topk_group=1, renormalize=False)
    plain = make_config(8, 3, scoring="sigmoid", renormalize=False)
    logits_TE = torch.tensor([[0.0, 2.0, -1.0, 2.0, 0.5, -2.0, 0.5, -3.0],
                              [1.0, 0.0, -1.0, -2.0, -1.0, -2.0, 0.5, 1.0]], device=DEVICE)
    _, ids_TK = route_with("triton", monkeypatch, logits_TE, plain, None)
    assert ids_TK[0].tolist() == [1, 3, 4]
    _, ids_TK = route_with("triton", monkeypatch, logits_TE, config, None)
    assert ids_TK[1].tolist() == [0, 1, 2]


def test_nan_logits_still_give_real_distinct_experts(monkeypatch):
    config = make_config(16, 4, scoring="softmax")
    logits_TE = make_logits(5, 16, torch.float32, seed=5)
    logits_TE[2, 7] = float("nan")
    weights_TK, ids_TK = route_with("triton", monkeypatch, logits_TE, config, None)
    assert ((ids_TK >= 0) & (ids_TK < 16)).all()
    assert len(set(ids_TK[2].tolist())) == 4 and weights_TK[2].isnan().all()
    want_w, want_ids = route_with("torch", monkeypatch, logits_TE, config, None)
    rows = [0, 1, 3, 4]  # the other tokens are unaffected
    assert torch.equal(ids_TK[rows], want_ids[rows])
    torch.testing.assert_close(weights_TK[rows], want_w[rows], rtol=RTOL, atol=ATOL)


def test_custom_routing_function_stays_on_torch(monkeypatch):
    config = make_config(8, 2, custom_routing_function=lambda l, k: torch.topk(l, k),
                         routed_scaling_factor=2.0)
    logits_TE = make_logits(3, 8, torch.float32)
    weights_TK, ids_TK = route_with("triton", monkeypatch, logits_TE, config, None)
    values_TK, want_ids = torch.topk(logits_TE, 2)
    assert torch.equal(ids_TK, want_ids)
    torch.testing.assert_close(weights_TK, 2.0 * values_TK)


def test_unknown_implementation_is_named(monkeypatch):
    config = make_config(8, 2)
    with pytest.raises(ValueError, match="'cuda'.*auto"):
        route_with("cuda", monkeypatch, torch.zeros(2, 8), config, None)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("num_experts", "top_k", "dtype", "routing"),
    [
        (256, 8, torch.bfloat16, dict(scoring="sigmoid", use_correction_bias=True, n_group=8,
                                      topk_group=4, routed_scaling_factor=2.5)),  # DeepSeek-V3
        (128, 8, torch.float32, dict(scoring="softmax")),  # Qwen3-MoE
    ],
    ids=["deepseek_v3", "qwen3"],
)
def test_gpu_matches_torch_at_model_shapes(monkeypatch, num_experts, top_k, dtype, routing):
    config = make_config(num_experts, top_k, **routing)
    gen = torch.Generator().manual_seed(7)
    # Random bf16 logits repeat values; the fp32 bias keeps the choices apart.
    logits_TE = torch.randn(4096, num_experts, generator=gen).to(dtype).cuda()
    bias_E = make_bias(num_experts) if config.use_correction_bias else None
    check_matches_torch(monkeypatch, logits_TE, config, bias_E)
