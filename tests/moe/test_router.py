"""Layer 1 (CPU): `moe.router.route` -- every routing variant against per-token Python re-derivations.

Shape legend: T tokens, E experts, K top-k.

The re-derivations below use plain Python floats and sorting, one token at a time, so
they share no code (and no torch op) with the router's vectorised implementation.
"""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moe.config import MoEConfig
from moe.router import route


def python_route(logits: list[float], config: MoEConfig, bias: list[float] | None) -> tuple[
    list[float], list[int]
]:
    """One token, the slow obvious way. Returns (weights, ids) in selection order."""
    num_experts = len(logits)
    if config.scoring == "softmax":
        top = max(logits)
        exps = [math.exp(v - top) for v in logits]
        scores = [v / sum(exps) for v in exps]
    else:
        scores = [1.0 / (1.0 + math.exp(-v)) for v in logits]
    choice = [s + (bias[e] if bias else 0.0) for e, s in enumerate(scores)]
    allowed = list(range(num_experts))
    if config.n_group:
        size = num_experts // config.n_group
        group_scores = []
        for g in range(config.n_group):
            members = sorted((choice[e] for e in range(g * size, (g + 1) * size)), reverse=True)
            group_scores.append((sum(members[:2]) if bias else members[0], g))
        kept = {g for _, g in sorted(group_scores, reverse=True)[: config.topk_group]}
        allowed = [e for e in allowed if e // size in kept]
    ids = sorted(allowed, key=lambda e: choice[e], reverse=True)[: config.top_k]
    weights = [scores[e] for e in ids]
    if config.renormalize:
        total = sum(weights)
        weights = [w / total for w in weights]
    return [w * config.routed_scaling_factor for w in weights], ids


def check_against_python(logits_TE: torch.Tensor, config: MoEConfig,
                         bias_E: torch.Tensor | None = None) -> None:
    weights_TK, ids_TK = route(logits_TE, config, correction_bias_E=bias_E)
    assert weights_TK.dtype == torch.float32 and ids_TK.dtype == torch.int64
    assert weights_TK.shape == ids_TK.shape == (logits_TE.shape[0], config.top_k)
    bias = None if bias_E is None else bias_E.tolist()
    for t, row in enumerate(logits_TE.float().tolist()):
        want_w, want_ids = python_route(row, config, bias)
        assert ids_TK[t].tolist() == want_ids, f"token {t}"
        assert weights_TK[t].tolist() == pytest.approx(want_w, rel=1e-5, abs=1e-6), f"token {t}"


def logits(num_tokens: int, num_experts: int, seed: int = 0, scale: float = 2.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return scale * torch.randn(num_tokens, num_experts, generator=gen)


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("top_k", [1, 2, 6])
def test_softmax(renormalize: bool, top_k: int) -> None:
    config = MoEConfig(num_experts=16, top_k=top_k, hidden_size=8, intermediate_size=8,
                       renormalize=renormalize)
    check_against_python(logits(23, 16), config)


@pytest.mark.parametrize("renormalize", [True, False])
def test_sigmoid_with_correction_bias(renormalize: bool) -> None:
    config = MoEConfig(num_experts=16, top_k=4, hidden_size=8, intermediate_size=8,
                       scoring="sigmoid", use_correction_bias=True, renormalize=renormalize)
    bias_E = torch.linspace(-0.8, 0.8, 16)
    logits_TE = logits(31, 16, seed=1)
    check_against_python(logits_TE, config, bias_E)
    # The bias changes the selection but never enters the weights.
    weights_TK, ids_TK = route(logits_TE, config, correction_bias_E=bias_E)
    plain = MoEConfig(num_experts=16, top_k=4, hidden_size=8, intermediate_size=8,
                      scoring="sigmoid", renormalize=renormalize)
    _, plain_ids_TK = route(logits_TE, plain)
    assert not torch.equal(ids_TK, plain_ids_TK)
    unbiased_TK = torch.sigmoid(logits_TE).gather(1, ids_TK)
    if renormalize:
        unbiased_TK = unbiased_TK / unbiased_TK.sum(-1, keepdim=True)
    torch.testing.assert_close(weights_TK, unbiased_TK)


@pytest.mark.parametrize(
    ("scoring", "use_bias", "n_group", "topk_group", "top_k"),
    [
        ("softmax", False, 4, 2, 3),
        ("softmax", False, 8, 1, 2),
        ("sigmoid", True, 8, 4, 8),  # DeepSeek-V3 shape, scaled down: 32 experts
        ("sigmoid", True, 4, 1, 4),
        ("sigmoid", False, 2, 2, 5),
    ],
)
def test_grouped_topk(scoring: str, use_bias: bool, n_group: int, topk_group: int,
                      top_k: int) -> None:
    config = MoEConfig(num_experts=32, top_k=top_k, hidden_size=8, intermediate_size=8,
                       scoring=scoring, use_correction_bias=use_bias, n_group=n_group,
                       topk_group=topk_group, routed_scaling_factor=2.5)
    bias_E = 0.3 * torch.randn(32, generator=torch.Generator().manual_seed(5)) if use_bias else None
    logits_TE = logits(40, 32, seed=2)
    check_against_python(logits_TE, config, bias_E)
    _, ids_TK = route(logits_TE, config, correction_bias_E=bias_E)
    groups_per_token = [len({e // (32 // n_group) for e in row}) for row in ids_TK.tolist()]
    assert max(groups_per_token) <= topk_group


def test_group_score_top2_vs_max() -> None:
    """With the bias a group is scored by its top-2 sum: one strong expert is not enough."""
    config = MoEConfig(num_experts=8, top_k=2, hidden_size=8, intermediate_size=8,
                       scoring="sigmoid", use_correction_bias=True, n_group=2, topk_group=1,
                       renormalize=False)
    # Group 0: one high (0.95) and three low scores; group 1: four medium scores.
    probs = torch.tensor([[0.95, 0.05, 0.05, 0.05, 0.7, 0.7, 0.7, 0.7]])
    logits_TE = torch.log(probs / (1 - probs))
    _, ids_TK = route(logits_TE, config, correction_bias_E=torch.zeros(8))
    assert set(ids_TK[0].tolist()) <= {4, 5, 6, 7}  # top-2 sums: 1.0 vs 1.4
    no_bias = MoEConfig(num_experts=8, top_k=2, hidden_size=8, intermediate_size=8,
                        scoring="sigmoid", n_group=2, topk_group=1, renormalize=False)
    _, ids_TK = route(logits_TE, no_bias)
    assert set(ids_TK[0].tolist()) <= {0, 1, 2, 3}  # max: 0.95 vs 0.7


@pytest.mark.parametrize("factor", [0.5, 2.5])
def test_routed_scaling_factor(factor: float) -> None:
    config = MoEConfig(num_experts=8, top_k=3, hidden_size=8, intermediate_size=8,
                       routed_scaling_factor=factor)
    logits_TE = logits(9, 8, seed=3)
    check_against_python(logits_TE, config)
    weights_TK, _ = route(logits_TE, config)
    torch.testing.assert_close(weights_TK.sum(-1), torch.full((9,), factor))


def test_custom_routing_function() -> None:
    calls = []

    def top1_sigmoid(logits_TE: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append((logits_TE.dtype, top_k))
        values_TK, ids_TK = torch.topk(logits_TE, top_k, dim=-1)
        return torch.sigmoid(values_TK).to(torch.bfloat16), ids_TK.to(torch.int32)

    config = MoEConfig(num_experts=8, top_k=1, hidden_size=8, intermediate_size=8,
                       custom_routing_function=top1_sigmoid, routed_scaling_factor=2.0)
    logits_TE = logits(11, 8, seed=4).to(torch.bfloat16)
    weights_TK, ids_TK = route(logits_TE, config)
    assert calls == [(torch.float32, 1)]  # the function sees float32 logits
    assert weights_TK.dtype == torch.float32 and ids_TK.dtype == torch.int64
    for t, row in enumerate(logits_TE.float().tolist()):
        best = max(range(8), key=lambda e: row[e])
        assert ids_TK[t].item() == best
        want = 2.0 * float(torch.tensor(1 / (1 + math.exp(-row[best]))).to(torch.bfloat16))
        assert weights_TK[t].item() == pytest.approx(want)  # not renormalised, but scaled


@pytest.mark.parametrize(
    ("result", "error", "match"),
    [
        (lambda l, k: torch.zeros(l.shape[0], k), TypeError, "must return a tuple"),
        (lambda l, k: (torch.zeros(l.shape[0], k + 1), torch.zeros(l.shape[0], k).long()),
         ValueError, "topk_weights of shape"),
        (lambda l, k: (torch.zeros(l.shape[0], k), torch.zeros(l.shape[0]).long()),
         ValueError, "topk_ids of shape"),
        (lambda l, k: (torch.zeros(l.shape[0], k), torch.zeros(l.shape[0], k)),
         TypeError, "integer tensor"),
        (lambda l, k: (torch.zeros(l.shape[0], k).long(), torch.zeros(l.shape[0], k).long()),
         TypeError, "floating tensor"),
    ],
)
def test_custom_routing_function_output_checked(result, error, match) -> None:
    config = MoEConfig(num_experts=8, top_k=2, hidden_size=8, intermediate_size=8,
                       custom_routing_function=result)
    with pytest.raises(error, match=match):
        route(logits(5, 8), config)


@pytest.mark.parametrize(
    "config",
    [
        MoEConfig(num_experts=8, top_k=2, hidden_size=8, intermediate_size=8),
        MoEConfig(num_experts=8, top_k=2, hidden_size=8, intermediate_size=8, scoring="sigmoid",
                  use_correction_bias=True, n_group=4, topk_group=2),
        MoEConfig(num_experts=8, top_k=2, hidden_size=8, intermediate_size=8,
                  custom_routing_function=lambda l, k: torch.topk(l, k)),
    ],
    ids=["softmax", "grouped_bias", "custom"],
)
def test_zero_tokens(config: MoEConfig) -> None:
    bias_E = torch.zeros(8) if config.use_correction_bias else None
    weights_TK, ids_TK = route(torch.empty(0, 8, dtype=torch.bfloat16), config,
                               correction_bias_E=bias_E)
    assert weights_TK.shape == ids_TK.shape == (0, 2)
    assert weights_TK.dtype == torch.float32 and ids_TK.dtype == torch.int64


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_logits_route_like_their_float32_copy(dtype: torch.dtype) -> None:
    config = MoEConfig(num_experts=16, top_k=4, hidden_size=8, intermediate_size=8,
                       scoring="sigmoid", use_correction_bias=True, n_group=4, topk_group=2)
    logits_TE = logits(17, 16, seed=6).to(dtype)
    bias_E = torch.linspace(-0.2, 0.2, 16).to(dtype)
    got = route(logits_TE, config, correction_bias_E=bias_E)
    want = route(logits_TE.float(), config, correction_bias_E=bias_E.float())
    assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])
    check_against_python(logits_TE, config, bias_E.float())


def test_input_errors() -> None:
    config = MoEConfig(num_experts=8, top_k=2, hidden_size=8, intermediate_size=8)
    biased = MoEConfig(num_experts=8, top_k=2, hidden_size=8, intermediate_size=8,
                       use_correction_bias=True)
    with pytest.raises(ValueError, match="expected \\[num_tokens, num_experts\\]"):
        route(torch.zeros(8), config)
    with pytest.raises(ValueError, match="7 columns"):
        route(torch.zeros(3, 7), config)
    with pytest.raises(TypeError, match="not floating"):
        route(torch.zeros(3, 8, dtype=torch.int64), config)
    with pytest.raises(ValueError, match="correction_bias_E is None"):
        route(torch.zeros(3, 8), biased)
    with pytest.raises(ValueError, match="use_correction_bias=False"):
        route(torch.zeros(3, 8), config, correction_bias_E=torch.zeros(8))
    with pytest.raises(ValueError, match="shape \\(4,\\)"):
        route(torch.zeros(3, 8), biased, correction_bias_E=torch.zeros(4))


@settings(max_examples=40, deadline=None)
@given(
    num_tokens=st.integers(0, 12),
    n_group=st.sampled_from([None, 1, 2, 4, 8]),
    data=st.data(),
    scoring=st.sampled_from(["softmax", "sigmoid"]),
    use_bias=st.booleans(),
    renormalize=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_random_configs_match_python(num_tokens, n_group, data, scoring, use_bias, renormalize,
                                     seed) -> None:
    num_experts = 16
    topk_group = None
    if n_group is not None:
        topk_group = data.draw(st.integers(1, n_group))
        use_bias = use_bias and num_experts // n_group >= 2
    max_k = num_experts if n_group is None else topk_group * (num_experts // n_group)
    top_k = data.draw(st.integers(1, max_k))
    config = MoEConfig(num_experts=num_experts, top_k=top_k, hidden_size=8, intermediate_size=8,
                       scoring=scoring, use_correction_bias=use_bias, renormalize=renormalize,
                       n_group=n_group, topk_group=topk_group)
    bias_E = 0.2 * torch.randn(num_experts, generator=torch.Generator().manual_seed(seed)) \
        if use_bias else None
    logits_TE = logits(num_tokens, num_experts, seed=seed)
    check_against_python(logits_TE, config, bias_E)
    _, ids_TK = route(logits_TE, config, correction_bias_E=bias_E)
    for row in ids_TK.tolist():
        assert len(set(row)) == top_k
