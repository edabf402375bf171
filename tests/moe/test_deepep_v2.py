"""Layer 1 (CPU, one process) and Layer 2 (two gloo processes): the `deepep_v2` adapter
(`moe.backends.deepep_v2`) through a fake `ElasticBuffer` (tests/moe/fake_elastic_buffer.py)
that reproduces DeepEP v2's contract and really moves rows between the ranks.

The adapter is checked against the dense reference (float32, 1e-5: only the summation
order differs) in both modes, DBO on and off, over `test_moe_backends`' scenarios (a rank
with no tokens, all tokens to one expert, ...); the order in which the two ubatches issue
their calls (prefill yields before its host-blocking dispatch); the flags it passes; that
decode mode reads nothing on the host; one buffer per group and size; and its refusals
where DeepEP v2 cannot run, with the facts passed in through `elastic_buffer_class`'s
keyword arguments.
"""
from __future__ import annotations

import functools
import types
from dataclasses import replace
from typing import Any, Callable, Optional

import pytest
import torch
import torch.distributed as dist

from dbo import UBatchScheduler
from dbo.failures import record_collectives
from dbo.yield_points import dbo_current_ubatch_id
from moe.backends.deepep_v2 import (BUFFERS, DeepEPV2Backend, DeepEPV2Options,
                                     ElasticBufferPool, elastic_buffer_class)
from moe.backends.nccl_comm import decode_nccl_code, loaded_nccl_version, start_nccl_comm
from moe.config import MoEConfig
from moe.experts.reference import ReferenceExperts
from moe.layer import MoELayer
from moe.reference import init_moe_weights, reference_moe
from moe.workspace import Workspace
from tests.dist_utils import run_distributed
from tests.moe.fake_elastic_buffer import FakeElasticBuffer
from tests.moe.test_moe_backends import SCENARIOS
from tests.moe.test_moe_backends import errors_against_reference as scenario_errors

ATOL = 1e-5
MODES = ("prefill", "decode")


def v2_layer(cfg: MoEConfig, group: Optional[dist.ProcessGroup],
             buffer_cls: Callable[..., Any] = FakeElasticBuffer) -> MoELayer:
    """An MoELayer whose backend is the adapter over `buffer_cls` (the layer builds its
    backend by name, so it is made with another and swapped before the first call)."""
    layer = MoELayer(replace(cfg, backend="local" if group is None else "naive",
                             backend_options=None), group=group)
    layer.backend = DeepEPV2Backend(replace(cfg, backend="deepep_v2"), group,
                                    elastic_buffer_cls=buffer_cls)
    return layer


def errors_against_reference(rank: int, group: Optional[dist.ProcessGroup],
                             mode: str) -> dict[str, tuple]:
    """Per scenario: max |out - reference| with DBO off, on, and on as the model's last
    layer (the split combine, which this backend declines), and the output shapes."""
    torch.manual_seed(99 + rank)
    return scenario_errors(rank, lambda cfg: v2_layer(cfg, group), experts="reference",
                           backend="deepep_v2", backend_options=DeepEPV2Options(mode=mode))


def assert_close(errors: dict[str, tuple], rank: int) -> None:
    for name, (err_off, err_on, err_last, *shapes) in errors.items():
        assert shapes == [(SCENARIOS[name][1][rank], 24)] * 3, (rank, name, shapes)
        assert max(err_off, err_on, err_last) <= ATOL, (rank, name, err_off, err_on, err_last)


@pytest.mark.parametrize("mode", MODES)
def test_matches_reference_one_process(mode):
    assert_close(errors_against_reference(0, None, mode), 0)


def two_ranks(rank: int, world_size: int, mode: str) -> dict[str, tuple]:
    return errors_against_reference(rank, dist.group.WORLD, mode)


@pytest.mark.distributed
@pytest.mark.parametrize("mode", MODES)
def test_matches_reference_two_ranks(mode):
    for rank, errors in enumerate(run_distributed(2, two_ranks, mode)):
        assert_close(errors, rank)


def small_config(**overrides: Any) -> MoEConfig:
    return MoEConfig(**{**dict(num_experts=4, top_k=2, hidden_size=8, intermediate_size=8,
                               max_tokens_per_rank=8, experts="reference",
                               backend="deepep_v2"), **overrides})


@pytest.mark.parametrize("mode,expand", [("prefill", True), ("decode", False)])
def test_every_call_is_async_after_an_event_of_the_compute_stream(mode, expand):
    """Both calls: `previous_event` captured by the adapter, `allocate_on_comm_stream`
    (which DeepEP requires with it), `async_with_compute_stream` (the compute stream is
    not held); the dispatch with the mode's `do_cpu_sync` and `do_expand`."""
    cfg = small_config(backend_options=DeepEPV2Options(mode=mode))
    layer = v2_layer(cfg, None)
    layer.load_weights(init_moe_weights(cfg, seed=0))
    with torch.no_grad():
        layer(torch.randn(5, 8))
    dispatch, combine = layer.backend.buffer.calls[-2:]
    assert (dispatch.op, dispatch.do_cpu_sync, dispatch.do_expand) == ("dispatch", expand, expand)
    assert combine.op == "combine"
    for call in (dispatch, combine):
        assert call.previous_event and call.allocate_on_comm_stream
        assert call.async_with_compute_stream
    assert layer.backend.graph_safe is (mode == "decode")


def test_decode_reads_nothing_on_the_host():
    """Decode mode: every device output of the fake refuses a host read (the count of
    received rows lives on the GPU); the dispatch's masking and the combine never read
    one. The result still equals the reference."""
    cfg = small_config(backend_options=DeepEPV2Options(mode="decode"), num_experts=4, top_k=2)
    buffer_cls = functools.partial(FakeElasticBuffer, device_only=True)
    backend = DeepEPV2Backend(cfg, None, elastic_buffer_cls=buffer_cls)
    weights = init_moe_weights(cfg, seed=2)
    x = torch.randn(6, 8)
    logits = x @ weights["router_weight"].t()
    topk_weights, topk_ids = torch.topk(torch.softmax(logits, -1), 2)
    topk_weights = topk_weights / topk_weights.sum(-1, keepdim=True)
    dispatched = backend.prepare(x, topk_weights, topk_ids, workspace=Workspace())
    assert dispatched.x_RH.shape[0] == cfg.max_tokens_per_rank  # worst case, W = 1
    plain = [t.as_subclass(torch.Tensor) for t in
             (dispatched.x_RH, dispatched.topk_ids_RK, dispatched.topk_weights_RK)]
    out_RH = ReferenceExperts().apply(plain[0], weights["w13"], weights["w2"], plain[1],
                                      plain[2])
    out_TH = backend.finalize(out_RH, dispatched, workspace=Workspace())
    ref = reference_moe(x, router_weight_EH=weights["router_weight"], w13_EIH=weights["w13"],
                        w2_EHI=weights["w2"], config=cfg)
    torch.testing.assert_close(out_TH.as_subclass(torch.Tensor), ref, atol=ATOL, rtol=ATOL)


def issue_order(mode: str) -> list[tuple[str, int]]:
    """(call, ubatch) in the order a DBO step of one layer issued them; "capture" is
    the event on the compute stream that a dispatch or combine then waits for."""
    cfg = small_config(backend_options=DeepEPV2Options(mode=mode))
    layer = v2_layer(cfg, None)
    layer.load_weights(init_moe_weights(cfg, seed=0))
    kernel = layer._kernel(torch.device("cpu"))
    experts = kernel.experts

    class LoggedExperts:
        name = experts.name

        def apply(self, *args: Any, **kwargs: Any) -> torch.Tensor:
            log.append(("experts", dbo_current_ubatch_id()))
            return experts.apply(*args, **kwargs)

    kernel.experts = LoggedExperts()
    capture = layer.backend.buffer.capture

    def logged_capture() -> Any:
        log.append(("capture", dbo_current_ubatch_id()))
        return capture()

    layer.backend.buffer.capture = logged_capture
    x = torch.randn(8, 8)
    with torch.no_grad(), record_collectives() as log:
        UBatchScheduler("cpu").run([lambda: layer(x[:4]), lambda: layer(x[4:])])
    return [(name.removeprefix("deepep_v2."), ubatch) for name, ubatch in log]


def test_prefill_yields_before_its_host_blocking_dispatch():
    """The second ubatch's dispatch (which waits on the host for the counts) comes after
    the first ubatch's experts are queued, but waits on an event captured before them;
    the first dispatch of the step goes at once (nothing is queued to overlap it); the
    combines yield before sending, so the transfers alternate: dispatch 0, dispatch 1,
    combine 0, combine 1."""
    assert issue_order("prefill") == [
        ("capture", 0), ("dispatch", 0), ("capture", 1), ("experts", 0), ("capture", 0),
        ("dispatch", 1), ("experts", 1), ("capture", 1), ("combine", 0), ("combine", 1)]


def test_decode_sends_before_yielding():
    assert issue_order("decode") == [
        ("capture", 0), ("dispatch", 0), ("capture", 1), ("dispatch", 1), ("experts", 0),
        ("capture", 0), ("combine", 0), ("experts", 1), ("capture", 1), ("combine", 1)]


def test_one_buffer_per_group_and_size():
    cfg = small_config()
    first = DeepEPV2Backend(cfg, None, elastic_buffer_cls=FakeElasticBuffer)
    second = DeepEPV2Backend(replace(cfg, backend_options=DeepEPV2Options(mode="decode")), None,
                             elastic_buffer_cls=FakeElasticBuffer)
    wider = DeepEPV2Backend(replace(cfg, hidden_size=16), None,
                            elastic_buffer_cls=FakeElasticBuffer)
    assert first.buffer is second.buffer
    assert wider.buffer is not first.buffer and wider.buffer.hidden == 16


def test_the_nccl_comm_is_started_before_each_new_buffer_only():
    # DeepEP v2 reads the group's NCCL communicator, null until a lazily started group's
    # first collective: the pool starts it before building, once per buffer it builds.
    started = []
    pool = ElasticBufferPool(before_build=started.append)
    group = None  # a live group to the pool (a made-up object would be forgotten)
    first = pool.get(FakeElasticBuffer, group, num_max_tokens_per_rank=8, hidden=8, num_topk=2)
    again = pool.get(FakeElasticBuffer, group, num_max_tokens_per_rank=8, hidden=8, num_topk=2)
    wider = pool.get(FakeElasticBuffer, group, num_max_tokens_per_rank=8, hidden=16, num_topk=2)
    assert first is again and wider is not first
    assert started == [group, group]


def test_starting_the_comm_is_a_no_op_off_nccl():
    start_nccl_comm(None)  # no group: nothing to start, and no CUDA needed


def forgets_destroyed_groups(rank: int, world_size: int) -> bool:
    group = dist.new_group()
    backend = DeepEPV2Backend(small_config(), group, elastic_buffer_cls=FakeElasticBuffer)
    assert any(entry[2] is backend.buffer for entry in BUFFERS._entries)
    dist.destroy_process_group(group)
    DeepEPV2Backend(small_config(), dist.group.WORLD, elastic_buffer_cls=FakeElasticBuffer)
    return all(entry[0] is not group for entry in BUFFERS._entries)


@pytest.mark.distributed
def test_the_pool_forgets_the_buffers_of_destroyed_groups():
    assert run_distributed(2, forgets_destroyed_groups) == [True, True]


def test_needs_a_capacity_and_keeps_to_it():
    with pytest.raises(ValueError, match="'deepep_v2' needs MoEConfig.max_tokens_per_rank"):
        DeepEPV2Backend(small_config(max_tokens_per_rank=None), None,
                        elastic_buffer_cls=FakeElasticBuffer)
    layer = v2_layer(small_config(max_tokens_per_rank=4), None)
    layer.load_weights(init_moe_weights(small_config(), seed=0))
    with pytest.raises(ValueError, match="5 tokens on this rank exceed MoEConfig."
                                         "max_tokens_per_rank=4"), torch.no_grad():
        layer(torch.randn(5, 8))


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="DeepEPV2Options.mode='eager' is not a deepep_v2 mode"):
        DeepEPV2Options(mode="eager")


# ---------------------------------------------------------------- refusals
V2 = types.SimpleNamespace(ElasticBuffer=object)
V1 = types.SimpleNamespace(Buffer=object)


def refusal(cfg: Optional[MoEConfig] = None, group: Any = "group", deep_ep: Any = V2,
            nccl: Optional[tuple] = (2, 30, 4), cuda: bool = True) -> type:
    return elastic_buffer_class(cfg or small_config(dtype=torch.bfloat16), group,
                                find_deep_ep=lambda: deep_ep, nccl_version=lambda: nccl,
                                cuda_available=lambda: cuda)


@pytest.mark.parametrize("kwargs,exc,text", [
    (dict(deep_ep=None), ImportError,
     "backend 'deepep_v2' needs DeepEP (deep_ep.ElasticBuffer), which is not installed"),
    (dict(deep_ep=V1), ImportError,
     "needs deep_ep.ElasticBuffer, which the installed deep_ep lacks (it is DeepEP v1)"),
    (dict(cuda=False), ValueError, "this process has no CUDA device"),
    (dict(nccl=(2, 28, 9)), ImportError,
     "needs NCCL >= 2.30.4 (DeepEP v2 uses NCCL's device API) but this process runs NCCL 2.28.9"),
    (dict(nccl=None), ImportError, "needs NCCL >= 2.30.4 (DeepEP v2 uses NCCL's device API) "
                                   "but this process runs no NCCL"),
    (dict(group=None), ValueError, "needs an expert-parallel process group"),
    (dict(cfg=small_config()), ValueError,
     "moves torch.bfloat16 tokens only (DeepEP v2's combine takes bf16) but MoEConfig.dtype "
     "is torch.float32"),
    (dict(cfg=small_config(dtype=torch.bfloat16, hidden_size=12)), ValueError,
     "hidden_size=12 bf16 values are 24 bytes: use a multiple of 8"),
])
def test_refuses_in_one_line_what_deepep_v2_cannot_run_on(kwargs, exc, text):
    with pytest.raises(exc) as info:
        refusal(**kwargs)
    message = str(info.value)
    assert text in message and "\n" not in message
    assert "use backend 'a2a' or 'a2a_ll'" in message or "backend 'local'" in message


def test_everything_present_gives_the_elastic_buffer_class():
    assert refusal() is object
    assert refusal(nccl=(2, 31, 0)) is object


def test_this_machine_is_refused_without_importing_deep_ep_at_module_import():
    """The real path, here: no deep_ep (or no CUDA, where one is installed)."""
    with pytest.raises((ImportError, ValueError)) as info:
        DeepEPV2Backend(small_config(), None)
    assert "backend 'deepep_v2'" in str(info.value)


def test_nccl_version_code_decodes():
    # ncclGetVersion's integer for NCCL >= 2.9 is major * 10000 + minor * 100 + patch
    assert decode_nccl_code(23007) == (2, 30, 7)
    assert decode_nccl_code(22809) == (2, 28, 9)


def test_loaded_nccl_is_none_without_one():
    # This CPU torch loads no libnccl; the reader must say so rather than guess.
    if torch.cuda.is_available():
        pytest.skip("a CUDA torch has loaded its NCCL")
    assert loaded_nccl_version() is None
