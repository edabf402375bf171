"""Layer 1 (CPU, one process): MoELayer against the dense token-by-token reference,
chunked experts, per-ubatch workspaces, the yield points of the modular kernel, and bad
input. fp32 tolerance 1e-5: only the summation order differs from the reference."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

import dbo
from dbo import UBatchScheduler
import moe
from moe import MoEConfig, MoELayer, SharedExperts, init_moe_weights, reference_moe
from moe.backends.base import Dispatched, Pending, PrepareFinalize
from moe.modular_kernel import ModularKernel

ATOL = 1e-5


def make_layer(cfg: MoEConfig, **kwargs) -> tuple[MoELayer, dict]:
    choices = {"backend": kwargs.pop("backend", cfg.backend),
               "experts": kwargs.pop("experts", "reference")}
    layer = MoELayer(replace(cfg, **choices), **kwargs)
    weights = init_moe_weights(cfg, seed=11)
    layer.load_weights(weights)
    return layer, weights


def reference(cfg: MoEConfig, weights: dict, x: torch.Tensor, shared=None) -> torch.Tensor:
    return reference_moe(x, router_weight_EH=weights["router_weight"], w13_EIH=weights["w13"],
                         w2_EHI=weights["w2"], config=cfg,
                         correction_bias_E=weights.get("e_score_correction_bias"),
                         shared_experts=shared)


VARIANTS = {
    "softmax_renorm": dict(),
    "softmax_no_renorm": dict(renormalize=False),
    "sigmoid_bias_grouped": dict(scoring="sigmoid", use_correction_bias=True, n_group=4,
                                 topk_group=2, routed_scaling_factor=2.5),
    "top1_on_input": dict(top_k=1, apply_router_weight_on_input=True),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("experts", ["reference", "grouped"])
def test_layer_matches_dense_reference(variant, experts):
    cfg = MoEConfig(**{**dict(num_experts=8, top_k=2, hidden_size=32, intermediate_size=16),
                       **VARIANTS[variant]})
    layer, weights = make_layer(cfg, experts=experts)
    x = torch.randn(37, 32)
    with torch.no_grad():
        out = layer(x)
    torch.testing.assert_close(out, reference(cfg, weights, x), atol=ATOL, rtol=ATOL)


def test_shared_experts_and_dbo_on_equals_off():
    cfg = MoEConfig(num_experts=8, top_k=2, hidden_size=32, intermediate_size=16,
                    num_shared_experts=2)
    layer, weights = make_layer(cfg)
    shared = SharedExperts.from_config(cfg, seed=5)
    layer.shared_experts.load_state_dict(shared.state_dict())
    x = torch.randn(20, 32)
    with torch.no_grad():
        off = layer(x)
        on = torch.cat(UBatchScheduler("cpu").run([lambda: layer(x[:9]), lambda: layer(x[9:])]))
    ref = reference(cfg, weights, x, shared)
    torch.testing.assert_close(off, ref, atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(on, ref, atol=ATOL, rtol=ATOL)


def test_chunked_experts_equal_unchunked():
    base = dict(num_experts=6, top_k=2, hidden_size=16, intermediate_size=8)
    small, _ = make_layer(MoEConfig(**base, expert_chunk_size=5))
    big, _ = make_layer(MoEConfig(**base))
    x = torch.randn(23, 16)
    with torch.no_grad():
        torch.testing.assert_close(small(x), big(x), atol=ATOL, rtol=ATOL)


def test_zero_tokens():
    cfg = MoEConfig(num_experts=4, top_k=2, hidden_size=8, intermediate_size=8)
    layer, _ = make_layer(cfg)
    with torch.no_grad():
        assert layer(torch.randn(0, 8)).shape == (0, 8)


def test_workspaces_are_per_ubatch_and_stop_growing():
    cfg = MoEConfig(num_experts=4, top_k=2, hidden_size=16, intermediate_size=16)
    layer, _ = make_layer(cfg, experts="grouped")
    x = torch.randn(24, 16)
    sched = UBatchScheduler("cpu")
    with torch.no_grad():
        sched.run([lambda: layer(x[:12]), lambda: layer(x[12:])])  # warm-up at max size
        kernel = layer._kernel(x.device)
        ws0, ws1 = (kernel.workspaces.for_ubatch(u) for u in (0, 1))
        assert ws0 is not ws1
        before = (ws0.num_allocations, ws1.num_allocations)
        for n in (12, 7, 1, 12):
            sched.run([lambda: layer(x[:n]), lambda: layer(x[12:12 + n])])
    assert (ws0.num_allocations, ws1.num_allocations) == before


class HookedBackend(PrepareFinalize):
    """A local backend whose receive half is a hook, logging the order of events."""

    name = "hooked"

    def __init__(self, config, log):
        super().__init__(config, None)
        self.log = log

    def _pending(self, what, value):
        ub = dbo.dbo_current_ubatch_id()
        self.log.append((ub, f"{what}_send"))
        got = {}

        def hook():
            self.log.append((ub, f"{what}_hook_run_by", dbo.dbo_current_ubatch_id()))
            got["value"] = value

        def receiver():
            self.log.append((ub, f"{what}_recv"))
            return got["value"]

        return Pending(hook, receiver)

    def prepare_async(self, x_TH, topk_weights_TK, topk_ids_TK, *, workspace):
        return self._pending("dispatch", Dispatched(x_TH, topk_ids_TK, topk_weights_TK, None))

    def finalize_async(self, expert_out_RH, dispatched, *, workspace):
        return self._pending("combine", expert_out_RH)


def test_recv_hooks_are_run_by_the_other_ubatch():
    cfg = MoEConfig(num_experts=4, top_k=1, hidden_size=8, intermediate_size=8)
    layer, _ = make_layer(cfg)
    log: list = []
    kernel = ModularKernel(cfg, HookedBackend(cfg, log), layer._kernel(torch.device("cpu")).experts)
    x = torch.randn(6, 8)
    w, ids = torch.ones(6, 1), torch.randint(0, 4, (6, 1))

    def ub(sl):
        return lambda: kernel.forward(x[sl], w[sl], ids[sl], w13_EIH=layer.w13, w2_EHI=layer.w2)

    with torch.no_grad():
        outs = UBatchScheduler("cpu").run([ub(slice(0, 3)), ub(slice(3, 6))])
        sync_out = kernel.forward(x, w, ids, w13_EIH=layer.w13, w2_EHI=layer.w2)
    torch.testing.assert_close(torch.cat(outs), sync_out, atol=ATOL, rtol=ATOL)
    assert log == [
        (0, "dispatch_send"),
        (0, "dispatch_hook_run_by", 1),  # ubatch 1 runs it after queueing its own work
        (1, "dispatch_send"),
        (0, "dispatch_recv"),
        (1, "dispatch_hook_run_by", 0),
        (0, "combine_send"),
        (1, "dispatch_recv"),
        (0, "combine_hook_run_by", 1),
        (1, "combine_send"),
        (0, "combine_recv"),
        (1, "combine_hook_run_by", 1),  # ubatch 0 finished first: the scheduler runs it
        (1, "combine_recv"),
        # outside DBO: the same calls, each hook run at once by its own caller
        (0, "dispatch_send"), (0, "dispatch_hook_run_by", 0), (0, "dispatch_recv"),
        (0, "combine_send"), (0, "combine_hook_run_by", 0), (0, "combine_recv"),
    ]


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(backend="nope"), ValueError, "unknown MoE backend 'nope'"),
    (dict(experts="nope"), ValueError, "unknown experts kernel 'nope'"),
    (dict(backend="a2a_ll"), ValueError, "max_tokens_per_rank"),
])
def test_bad_layer_arguments(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        MoELayer(MoEConfig(num_experts=4, top_k=2, hidden_size=8, intermediate_size=8,
                           **kwargs))


@pytest.mark.parametrize("x, match", [
    (torch.randn(3, 9), r"shape \(3, 9\), expected \[T, hidden_size=8\]"),
    (torch.randn(2, 3, 8), r"shape \(2, 3, 8\)"),
    (torch.randn(3, 8, dtype=torch.float64), "torch.float64 but MoEConfig.dtype"),
    (torch.randn(3, 8).to("meta"), "on meta but the layer's parameters are on cpu"),
])
def test_bad_layer_input(x, match):
    layer, _ = make_layer(MoEConfig(num_experts=4, top_k=2, hidden_size=8, intermediate_size=8))
    with pytest.raises(ValueError, match=match):
        layer(x)


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="top_k=5 exceeds num_experts=4"):
        MoEConfig(num_experts=4, top_k=5, hidden_size=8, intermediate_size=8)
    with pytest.raises(ValueError, match="n_group=3 does not divide num_experts=8"):
        MoEConfig(num_experts=8, top_k=2, hidden_size=8, intermediate_size=8, n_group=3,
                  topk_group=1)
    with pytest.raises(ValueError, match="apply_router_weight_on_input=True needs top_k=1"):
        MoEConfig(num_experts=8, top_k=2, hidden_size=8, intermediate_size=8,
                  apply_router_weight_on_input=True)


def _ep_indivisible(rank: int, world_size: int) -> str:
    cfg = MoEConfig(num_experts=5, top_k=2, hidden_size=8, intermediate_size=8)
    try:
        MoELayer(cfg, group=dist.group.WORLD)
    except ValueError as exc:
        return str(exc)
    return "no error"


@pytest.mark.distributed
def test_experts_not_divisible_by_ep_size():
    from tests.dist_utils import run_distributed
    for msg in run_distributed(2, _ep_indivisible):
        assert "num_experts=5 is not divisible by the EP size 2" in msg


def test_sync_prepare_finalize_is_the_async_path_plus_its_wait():
    cfg = MoEConfig(num_experts=8, top_k=2, hidden_size=16, intermediate_size=8)
    layer, weights = make_layer(cfg)
    kernel = layer._kernel(torch.device("cpu"))
    x = torch.randn(11, 16)
    with torch.no_grad():
        weights_TK, ids_TK = moe.route(layer.router(x), cfg)
        workspace = kernel.workspaces.for_ubatch(0)
        dispatched = kernel.backend.prepare(x, weights_TK, ids_TK, workspace=workspace)
        expert_out = kernel.experts.apply(dispatched.x_RH, layer.w13, layer.w2,
                                          dispatched.topk_ids_RK, dispatched.topk_weights_RK)
        out = kernel.backend.finalize(expert_out, dispatched, workspace=workspace)
        torch.testing.assert_close(out, layer(x), atol=ATOL, rtol=ATOL)
        torch.testing.assert_close(out, reference(cfg, weights, x), atol=ATOL, rtol=ATOL)
