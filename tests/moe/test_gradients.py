"""Layers 1-2 (CPU; one process, then two gloo ranks; one GPU-marked test): what autograd
sees of dbo.

The contract (`moe.inference_only`): an MoE layer is inference-only. With gradients on
(PyTorch's default) its forward gives the same output as under no_grad, on every backend
and expert kernel, DBO on and off; a backward that reaches it raises one RuntimeError
naming the layer, backend and experts (never a wrong or missing gradient); a gradient
that does not pass through it is exact. Everything else of `MoETransformer` (embedding,
attention with its rotary kernel, norms, dense FFN, LM head) is differentiable, and DBO
gives it the same gradients as the model alone.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from dbo import DBOConfig, DBORunner
from moe import MoEConfig, MoELayer, SharedExperts, init_moe_weights, reference_moe
from moe.models import rotary
from moe.kernels.policy import KernelPolicy
from moe.models.attention import causal_attention, rotary_cos_sin
from moe.models.transformer import MoETransformer, get_preset, make_batch
from tests.dist_utils import run_distributed

SPLIT = DBOConfig(split="tokens", min_decode_tokens=0, min_prefill_tokens=0)
# The model attends within a call only: split at request boundaries, never inside one.
BY_REQUESTS = DBOConfig(split="requests", max_imbalance=1.0, min_prefill_tokens=0)
CFG = dict(num_experts=4, top_k=2, hidden_size=32, intermediate_size=16)


def make_layer(cfg: MoEConfig, **kwargs) -> tuple[MoELayer, dict, SharedExperts | None]:
    choices = {name: kwargs.pop(name) for name in ("backend", "experts") if name in kwargs}
    layer = MoELayer(dataclasses.replace(cfg, **choices), **kwargs)
    weights = init_moe_weights(cfg, seed=3)
    layer.load_weights(weights)
    shared = None
    if cfg.num_shared_experts:
        shared = SharedExperts.from_config(cfg, seed=4)
        layer.shared_experts.load_state_dict(shared.state_dict())
    return layer, weights, shared


def dense_reference(cfg: MoEConfig, weights: dict, x: torch.Tensor,
                    shared: SharedExperts | None) -> torch.Tensor:
    with torch.no_grad():
        return reference_moe(x, router_weight_EH=weights["router_weight"],
                             w13_EIH=weights["w13"], w2_EHI=weights["w2"], config=cfg,
                             shared_experts=shared)


def assert_backward_refused(out: torch.Tensor, *, backend: str, experts: str) -> None:
    assert out.requires_grad  # the error comes at backward, not as "does not require grad"
    with pytest.raises(RuntimeError, match=(
            rf"MoELayer layer 0 \(backend '{backend}', experts '{experts}'\) is "
            rf"inference-only: it has no backward")):
        out.square().sum().backward()


# ---------------------------------------------------------------- layer 1: one process
@pytest.mark.parametrize("shared", [0, 1])
@pytest.mark.parametrize("experts", ["reference", "grouped", "triton"])
@pytest.mark.parametrize("dbo_on", [False, True])
def test_layer_forward_with_grads_on_is_exact_and_backward_raises(experts, shared, dbo_on):
    cfg = MoEConfig(**CFG, num_shared_experts=shared)
    layer, weights, shared_module = make_layer(cfg, experts=experts)
    call = DBORunner(layer, SPLIT) if dbo_on else layer
    x = torch.randn(9, 32)
    with torch.no_grad():
        expected = call(x)
    torch.testing.assert_close(expected, dense_reference(cfg, weights, x, shared_module),
                               atol=1e-5, rtol=1e-5)
    # Parameters require grad (the default), the input too, or only the parameters: the
    # output is the no-grad output, and any backward through it raises.
    for x_in in (x.clone().requires_grad_(), x):
        out = call(x_in)
        assert torch.equal(out, expected)
        assert_backward_refused(out, backend="local", experts=experts)
        assert x_in.grad is None and all(p.grad is None for p in layer.parameters())


def test_no_graph_when_nothing_requires_grad():
    layer, _, _ = make_layer(MoEConfig(**CFG), experts="reference")
    layer.requires_grad_(False)
    out = layer(torch.randn(5, 32))
    assert not out.requires_grad and out.grad_fn is None


@pytest.mark.parametrize("dbo_on", [False, True])
def test_gradient_not_through_the_layer_is_exact(dbo_on):
    """d(loss)/d(head) where only the head requires the gradient: the MoE output is a
    constant there, and its values are the dense reference's."""
    cfg = MoEConfig(**CFG, num_shared_experts=1)
    layer, weights, shared = make_layer(cfg, experts="grouped")
    call = DBORunner(layer, SPLIT) if dbo_on else layer
    head = torch.randn(32, 3, requires_grad=True)
    x = torch.randn(10, 32, requires_grad=True)
    (grad,) = torch.autograd.grad((call(x) @ head).square().sum(), [head])
    ref_head = head.detach().clone().requires_grad_()
    (dense_reference(cfg, weights, x.detach(), shared) @ ref_head).square().sum().backward()
    torch.testing.assert_close(grad, ref_head.grad, atol=1e-4, rtol=1e-5)


def tiny(num_dense_layers: int | None = None) -> MoETransformer:
    cfg = get_preset("tiny")
    if num_dense_layers is not None:
        cfg = dataclasses.replace(cfg, num_dense_layers=num_dense_layers)
    model = MoETransformer(cfg)
    model.init_weights(seed=0)
    return model


@pytest.mark.parametrize("dbo_on", [False, True])
def test_readme_example_runs_with_grads_on(dbo_on):
    """The README's plain call: a fresh model (parameters require grad), no no_grad. On
    main this crashed inside torch (`index_select(): functions with out=...`)."""
    model = tiny()
    batch = make_batch(model.config, num_tokens=12, num_requests=3, seed=0)
    call = DBORunner(model, BY_REQUESTS) if dbo_on else model
    args = (batch.input_ids_T, batch.positions_T)
    logits = call(*args, seq_lens=batch.seq_lens)
    with torch.inference_mode():
        expected = call(*args, seq_lens=batch.seq_lens)
    torch.testing.assert_close(logits, expected, atol=0, rtol=0)
    with pytest.raises(RuntimeError, match=r"MoELayer layer 2 \(backend 'local', experts "
                                           r"'grouped'\) is inference-only"):
        logits.sum().backward()


def test_dense_model_gradients_with_dbo_on_equal_off():
    """With no MoE layer, every parameter gets its gradient, the same with DBO on as off."""
    model = tiny(num_dense_layers=3)
    batch = make_batch(model.config, num_tokens=12, num_requests=3, seed=1)
    args = (batch.input_ids_T, batch.positions_T)
    model(*args, seq_lens=batch.seq_lens).square().mean().backward()
    off = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    DBORunner(model, BY_REQUESTS)(*args, seq_lens=batch.seq_lens).square().mean().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and off[name].abs().sum() > 0, name
        torch.testing.assert_close(p.grad, off[name], atol=1e-5, rtol=1e-4, msg=name)


def test_packed_attention_gradients_equal_one_request_at_a_time():
    """`causal_attention` writes each length group into a fresh output (a slice copy, an
    index_copy_): its gradients equal those of causal SDPA run per request, kv heads
    repeated."""
    seq_lens = (1, 4, 1, 3, 4)  # length 4 twice apart (row gather), 1 twice apart, 3 once
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(13, heads, 8, generator=gen) for heads in (4, 2, 2))
    grad_out = torch.randn(13, 4, 8, generator=gen)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    causal_attention(*leaves, seq_lens).backward(grad_out)
    ref_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    outs, start = [], 0
    for length in seq_lens:
        q_r, k_r, v_r = (t[start:start + length].transpose(0, 1) for t in ref_leaves)
        k_r, v_r = k_r.repeat_interleave(2, dim=0), v_r.repeat_interleave(2, dim=0)
        outs.append(torch.nn.functional.scaled_dot_product_attention(
            q_r, k_r, v_r, is_causal=True).transpose(0, 1))
        start += length
    torch.cat(outs).backward(grad_out)
    for got, expected in zip(leaves, ref_leaves):
        torch.testing.assert_close(got.grad, expected.grad, atol=1e-5, rtol=1e-5)


def test_rotary_kernel_keeps_the_gradient(monkeypatch):
    """The Triton rotary kernel has no backward: where autograd records, the torch version
    runs (on main the output did not require grad, and q/k's gradient was lost)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 2, 8, generator=gen)
    cos, sin = rotary_cos_sin(torch.arange(5), head_dim=8, theta=10000.0)
    grad_out = torch.randn(5, 2, 8, generator=gen)
    grads = []
    for implementation in ("torch", "triton"):
        x_in = x.clone().requires_grad_()
        policy = KernelPolicy(implementation=implementation)
        rotary.apply_rotary(x_in, cos, sin, policy=policy).backward(grad_out)
        grads.append(x_in.grad)
    assert torch.equal(grads[0], grads[1])


@pytest.mark.gpu
def test_gpu_triton_paths_with_grads_on():
    """On CUDA the router, rows and experts run Triton kernels: the forward with grads on
    is still the no-grad forward and the backward raises; the rotary kernel's gradient
    equals the torch version's."""
    cfg = MoEConfig(**{**CFG, "hidden_size": 64, "intermediate_size": 64},
                    num_shared_experts=1, dtype=torch.bfloat16)
    layer = MoELayer(dataclasses.replace(cfg, experts="triton"), device="cuda")
    layer.load_weights({k: v.cuda() for k, v in init_moe_weights(cfg, seed=3).items()})
    layer.shared_experts.load_state_dict(SharedExperts.from_config(cfg, seed=4).state_dict())
    x = torch.randn(33, 64, device="cuda", dtype=torch.bfloat16)
    out = layer(x.clone().requires_grad_())
    with torch.inference_mode():
        assert torch.equal(out, layer(x))
    assert_backward_refused(out, backend="local", experts="triton")
    q = torch.randn(9, 4, 64, device="cuda", requires_grad=True)
    cos, sin = rotary_cos_sin(torch.arange(9, device="cuda"), head_dim=64, theta=10000.0)
    (grad,) = torch.autograd.grad(rotary.apply_rotary(q, cos, sin).sum(), [q])
    (expected,) = torch.autograd.grad(rotary._apply_rotary_torch(q, cos, sin).sum(), [q])
    assert torch.equal(grad, expected)


# ------------------------------------------------------------ layer 2: two gloo ranks
EP_BACKENDS = ("naive", "a2a", "a2a_ll")


def ep_forward_and_backward(rank: int, world_size: int) -> dict[str, list[str]]:
    """Per backend, DBO off then on: the forward with grads on equals the no-grad forward
    (and the dense reference); the backward raises. Returns the errors' texts."""
    torch.manual_seed(rank)
    cfg = MoEConfig(**CFG, num_shared_experts=1, max_tokens_per_rank=16)
    x = torch.randn(7 + 3 * rank, 32)
    texts: dict[str, list[str]] = {}
    for backend in EP_BACKENDS:
        layer, weights, shared = make_layer(cfg, group=dist.group.WORLD, backend=backend,
                                            experts="reference")
        texts[backend] = []
        for dbo_on in (False, True):
            call = DBORunner(layer, SPLIT, group=dist.group.WORLD) if dbo_on else layer
            with torch.no_grad():
                expected = call(x)
            torch.testing.assert_close(expected, dense_reference(cfg, weights, x, shared),
                                       atol=1e-5, rtol=1e-5)
            out = call(x.clone().requires_grad_())
            assert torch.equal(out, expected) and out.requires_grad
            try:
                out.sum().backward()
            except RuntimeError as exc:
                texts[backend].append(str(exc))
            assert all(p.grad is None for p in layer.parameters())
    return texts


@pytest.mark.distributed
def test_ep_backends_refuse_backward_two_ranks():
    """On main: no error, dx off by 13-64x and the router's and w13's grads None (shared
    experts), or "does not require grad" without them."""
    for texts in run_distributed(2, ep_forward_and_backward):
        for backend in EP_BACKENDS:
            assert len(texts[backend]) == 2, backend
            for text in texts[backend]:
                assert (f"MoELayer layer 0 (backend '{backend}', experts 'reference') is "
                        f"inference-only") in text
