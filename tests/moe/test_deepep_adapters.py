"""Layer 1 (CPU) and Layer 2 (two gloo processes): the DeepEP adapters `deepep_ht` and
`deepep_ll` without DeepEP. Layer 1: the shape rules (padding to DeepEP's copy unit, the
low-latency capacity, the expert ids of DeepEP's expert-major rows, FP8 dequantisation)
and the refusals at construction. Layer 2: a fake `deep_ep` whose methods have the real
signatures (`deep_ep/buffer.py` of v1.2.1) records what the adapters call: one Buffer per
group and mode shared by every layer, grown and torn down with the group; the events
chained through the normal kernels; the low-latency receive hooks run once each, with at
most two operations in flight. The real kernels run in tests/moe/test_deepep_backends.py.
"""
from __future__ import annotations

import sys
from unittest import mock
import types
from dataclasses import replace
from typing import Any, Optional

import pytest
import torch
import torch.distributed as dist

from moe import MoEConfig, MoELayer
from moe.backends.deepep_support import (
    check_ht_world,
    dequantize_fp8,
    ht_padded_hidden,
    ll_capacity,
    LLRowConstants,
    ll_expert_ids,
)
from moe.backends.deepep_ht import DeepEPHTOptions
from moe.backends.deepep_ll import DeepEPLLOptions
from tests.dist_utils import run_distributed

BF16 = torch.bfloat16


# ---------------------------------------------------------------- Layer 1: shape rules

def test_ht_pads_hidden_to_512_byte_rows_and_takes_bfloat16_only():
    assert ht_padded_hidden("deepep_ht", 2048, BF16) == 2048
    assert ht_padded_hidden("deepep_ht", 2880, BF16) == 3072
    assert ht_padded_hidden("deepep_ht", 100, BF16) == 256
    with pytest.raises(ValueError, match=r"MoEConfig.dtype=torch.float32 is not supported.*"
                                         r"set MoEConfig.dtype=torch.bfloat16"):
        ht_padded_hidden("deepep_ht", 2048, torch.float32)
    check_ht_world("deepep_ht", 8)
    with pytest.raises(ValueError, match="an EP group of 3 rank"):
        check_ht_world("deepep_ht", 3)


def test_ll_capacity_makes_ranks_times_capacity_a_multiple_of_4():
    assert [ll_capacity(c, 2) for c in (1, 2, 3, 4, 5)] == [2, 2, 4, 4, 6]
    assert [ll_capacity(c, 4) for c in (1, 3)] == [1, 3]
    assert ll_capacity(5, 1) == 8


def test_ll_expert_ids_mark_the_valid_rows_of_each_expert_block():
    rows = LLRowConstants.make(3, 4, torch.device("cpu"))
    ids = ll_expert_ids(torch.tensor([2, 0, 4], dtype=torch.int32), rows)
    assert ids.shape == (12, 1) and ids.dtype == torch.int64
    assert ids.view(3, 4).tolist() == [[0, 0, -1, -1], [-1, -1, -1, -1], [2, 2, 2, 2]]


def test_dequantize_fp8_applies_per_128_channel_scales_in_column_major_layout():
    torch.manual_seed(0)
    experts, rows, hidden = 2, 4, 256
    x = torch.randn(experts, rows, hidden) * 3
    amax = x.view(experts, rows, 2, 128).abs().amax(-1).clamp_min(1e-4)  # [E, N, 2]
    x_fp8 = (x.view(experts, rows, 2, 128) * (448.0 / amax).unsqueeze(-1)).to(
        torch.float8_e4m3fn).view(experts, rows, hidden)
    # DeepEP returns the scales as a transposed view of [E, H/128, N].
    scales = (amax / 448.0).transpose(1, 2).contiguous().transpose(1, 2)
    assert not scales.is_contiguous()
    out = dequantize_fp8(x_fp8, scales)
    assert out.shape == (experts * rows, hidden) and out.dtype == BF16
    # e4m3 keeps 3 mantissa bits: 1/16 relative per element at most.
    torch.testing.assert_close(out.float(), x.view(-1, hidden), rtol=1 / 16, atol=1e-3)


def test_deepep_options_take_bools_only():
    with pytest.raises(TypeError, match="DeepEPLLOptions.fp8_dispatch='yes'"):
        DeepEPLLOptions(fp8_dispatch="yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="DeepEPHTOptions.worst_case_dispatch=1"):
        DeepEPHTOptions(worst_case_dispatch=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="MoEConfig.backend_options=True"):
        MoEConfig(num_experts=4, top_k=2, hidden_size=8, intermediate_size=8,
                  backend_options=True)  # type: ignore[arg-type]


# ---------------------------------------------------------------- Layer 1: refusals

@pytest.fixture
def deep_ep_present(monkeypatch):
    monkeypatch.setitem(sys.modules, "deep_ep", _fake_deep_ep())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


def _layer(backend: str, **kw: Any) -> MoELayer:
    fields = dict(num_experts=8, top_k=2, hidden_size=2048, intermediate_size=8, dtype=BF16)
    fields.update(kw)
    return MoELayer(MoEConfig(backend=backend, **fields))


@pytest.mark.parametrize("backend,kw,message", [
    ("deepep_ht", dict(dtype=torch.float32), "DeepEP's normal combine sums bfloat16 rows only"),
    ("deepep_ht", dict(backend_options=DeepEPHTOptions(worst_case_dispatch=True)),
     "worst_case_dispatch needs MoEConfig.max_tokens_per_rank"),
    ("deepep_ht", {}, "needs an EP process group"),
    ("deepep_ll", dict(hidden_size=1000), "MoEConfig.hidden_size=1000 is not supported"),
    ("deepep_ll", dict(dtype=torch.float16), "DeepEP's low-latency kernels move bfloat16"),
    ("deepep_ll", {}, "needs an EP group of at least 2 ranks"),
])
def test_construction_refuses_what_deepep_cannot_run(deep_ep_present, backend, kw, message):
    with pytest.raises(ValueError, match=message) as exc:
        _layer(backend, **kw)
    assert "\n" not in str(exc.value)


# ---------------------------------------------------------------- the fake deep_ep

class _Event:
    def __init__(self, log: list, name: str) -> None:
        self.event, self.log, self.name = object(), log, name

    def current_stream_wait(self) -> None:
        self.log.append(("wait", self.name))


class _Config:
    def __init__(self, extra: int) -> None:
        self.extra = extra

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        return 1000 * hidden_bytes + self.extra

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        return 0


class _Buffer:
    """`deep_ep.Buffer` with the real signatures; records the calls in `log`."""

    made: list = []
    log: list = []
    nvshmem_qp_depth = 1024
    recv_count = (2, 0, 8, 1)
    fail = False  # the next construction raises, as DeepEP's C++ asserts do

    def __init__(self, group: Any, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0,
                 low_latency_mode: bool = False, num_qps_per_rank: int = 24,
                 allow_nvlink_for_low_latency_mode: bool = True, allow_mnnvl: bool = False,
                 use_fabric: bool = False, explicitly_destroy: bool = False,
                 enable_shrink: bool = False, comm: Any = None) -> None:
        self.args = dict(nvl=num_nvl_bytes, rdma=num_rdma_bytes, ll=low_latency_mode,
                         qps=num_qps_per_rank, explicit=explicitly_destroy)
        if _Buffer.fail:
            raise RuntimeError("Failed: Assertion error (fake)")
        self.group_size = group.size()
        self.destroyed = 0
        _Buffer.made.append(self)

    def destroy(self) -> None:
        self.destroyed += 1

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> _Config:
        return _Config(1)

    @staticmethod
    def get_combine_config(num_ranks: int) -> _Config:
        return _Config(2)

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int,
                                       num_ranks: int, num_experts: int) -> int:
        return num_max_dispatch_tokens_per_rank * hidden * num_ranks * num_experts

    @staticmethod
    def capture() -> _Event:
        return _Event(_Buffer.log, "captured")

    def get_dispatch_layout(self, topk_idx, num_experts, previous_event=None,
                            async_finish=False, allocate_on_comm_stream=False):
        self.log.append(("layout", _name(previous_event), async_finish))
        t, w = topk_idx.shape[0], self.group_size
        return (torch.zeros(w, dtype=torch.int32), None,
                torch.zeros(num_experts, dtype=torch.int32),
                torch.ones(t, w, dtype=torch.bool), _Event(self.log, "layout_done"))

    def dispatch(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
                 is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None,
                 topk_weights=None, expert_alignment=1, num_worst_tokens=0, config=None,
                 previous_event=None, async_finish=False, allocate_on_comm_stream=False):
        self.log.append(("dispatch", _name(previous_event), async_finish, num_worst_tokens,
                         tuple(x.shape), x.is_contiguous()))
        return (x.clone(), topk_idx.clone(), topk_weights.clone(), [], ("handle",),
                _Event(self.log, "dispatch_done"))

    def combine(self, x, handle, topk_weights=None, bias=None, config=None,
                previous_event=None, async_finish=False, allocate_on_comm_stream=False):
        self.log.append(("combine", _name(previous_event), async_finish, tuple(x.shape)))
        return x.clone(), None, _Event(self.log, "combine_done")

    def low_latency_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                             cumulative_local_expert_recv_stats=None,
                             dispatch_wait_recv_cost_stats=None, use_fp8=True,
                             round_scale=False, use_ue8m0=False, async_finish=False,
                             return_recv_hook=False):
        assert not async_finish
        self.log.append(("ll_dispatch", return_recv_hook))
        num_local = num_experts // self.group_size
        rows = self.group_size * num_max_dispatch_tokens_per_rank
        recv = torch.zeros(num_local, rows, x.shape[1], dtype=BF16)
        count = torch.tensor(self.recv_count[:num_local], dtype=torch.int32)
        hook = self._hook("dispatch") if return_recv_hook else None
        return recv, count, ("ll_handle",), _Event(self.log, "none"), hook

    def low_latency_combine(self, x, topk_idx, topk_weights, handle, use_logfmt=False,
                            zero_copy=False, async_finish=False, return_recv_hook=False,
                            out=None, combine_wait_recv_cost_stats=None):
        assert x.dim() == 3 and x.is_contiguous()
        self.log.append(("ll_combine", return_recv_hook))
        out_TH = torch.zeros(topk_idx.shape[0], x.shape[2], dtype=BF16)
        hook = self._hook("combine") if return_recv_hook else None
        return out_TH, _Event(self.log, "none"), hook

    def _hook(self, what: str):
        return lambda: self.log.append(("recv", what))


def _name(event: Optional[_Event]) -> Optional[str]:
    return None if event is None else event.name


def _fake_deep_ep() -> types.ModuleType:
    module = types.ModuleType("deep_ep")
    module.__spec__ = types.SimpleNamespace(name="deep_ep")  # find_spec reads sys.modules
    module.Buffer = _Buffer
    module.topk_idx_t = torch.int64
    _Buffer.made, _Buffer.log, _Buffer.fail = [], [], False
    return module


# ---------------------------------------------------------------- Layer 2: two gloo ranks

def _config(backend: str, hidden: int = 2048, capacity: Optional[int] = 3) -> MoEConfig:
    return MoEConfig(num_experts=8, top_k=2, hidden_size=hidden, intermediate_size=8,
                     dtype=BF16, backend=backend, max_tokens_per_rank=capacity)


def _fake_worker(rank: int, world_size: int) -> dict[str, Any]:
    from moe.backends.deepep_ht import DeepEPHTBackend
    from moe.backends.deepep_ll import DeepEPLLBackend
    from moe.backends.deepep_support import destroy_buffers
    from moe.workspace import Workspace

    sys.modules["deep_ep"] = _fake_deep_ep()
    torch.cuda.is_available = lambda: True  # this process only
    world = dist.group.WORLD
    out: dict[str, Any] = {}
    ws = Workspace()

    ht1 = DeepEPHTBackend(_config("deepep_ht"), world)
    ht2 = DeepEPHTBackend(_config("deepep_ht"), world)
    out["ht_shared"] = ht1.shared is ht2.shared and len(_Buffer.made) == 1
    out["ht_args"] = _Buffer.made[0].args
    worst = replace(_config("deepep_ht"), backend_options=DeepEPHTOptions(worst_case_dispatch=True))
    out["graph_safe"] = (ht1.graph_safe, DeepEPHTBackend(worst, world).graph_safe)
    first = _Buffer.made[0]
    ht_pad = DeepEPHTBackend(_config("deepep_ht", hidden=2880), world)  # padded to 3072
    out["grown"] = (first.destroyed, ht1.shared.buffer is ht_pad.shared.buffer,
                    ht1.shared.buffer.args["nvl"])

    # Normal kernels: events chained, x padded to the copy unit, the result sliced back.
    x = torch.randn(5, 2880, dtype=BF16)
    ids = torch.tensor([[0, 5]] * 5)
    weights = torch.full((5, 2), 0.5)
    _Buffer.log.clear()
    # Outside a step: DeepEP's synchronous form (no events, nothing to wait on).
    dispatched = ht_pad.prepare(x, weights, ids, workspace=ws)
    plain = ht_pad.finalize(dispatched.x_RH, dispatched, workspace=ws)
    out["ht_plain_log"] = list(_Buffer.log)
    out["ht_plain"] = torch.equal(plain, x)
    _Buffer.log.clear()
    with mock.patch("moe.backends.deepep_ht.dbo_enabled", return_value=True):
        dispatched = ht_pad.prepare(x, weights, ids, workspace=ws)
        combined = ht_pad.finalize(dispatched.x_RH * 2, dispatched, workspace=ws)
    out["ht_log"] = list(_Buffer.log)
    out["ht_shapes"] = (tuple(dispatched.x_RH.shape), tuple(combined.shape),
                        combined.is_contiguous(), torch.equal(combined, x * 2))

    # Low-latency: its own buffer; hooks once each; at most two in flight.
    ll = DeepEPLLBackend(_config("deepep_ll"), world)
    out["ll_args"] = ll.shared.buffer.args
    out["ll_capacity"] = ll.capacity
    _Buffer.log.clear()
    x = torch.randn(3, 2048, dtype=BF16)
    ids = torch.tensor([[0, 5]] * 3)
    # Outside a DBO step each call is one kernel: no receive hook to hand over.
    plain = ll.prepare_async(x, weights[:3], ids, workspace=ws)
    out["ll_plain"] = (plain.hook is None, ll.shared.ll_in_flight)
    ll.finalize(torch.zeros(32, 2048, dtype=BF16), plain.receiver(), workspace=ws)
    out["ll_plain_log"] = list(_Buffer.log)
    _Buffer.log.clear()
    in_step = mock.patch("moe.backends.deepep_ll.dbo_enabled", return_value=True)
    in_step.start()  # inside a DBO step (as the scheduler makes it): send, then hook
    first_op = ll.prepare_async(x, weights[:3], ids, workspace=ws)
    second_op = ll.prepare_async(x, weights[:3], ids, workspace=ws)
    try:
        ll.prepare_async(x, weights[:3], ids, workspace=ws)
        out["third"] = "no error"
    except AssertionError as exc:
        out["third"] = str(exc)
    ll.shared.ll_in_flight = 2  # the refused third never started
    first_op.hook()
    try:
        first_op.hook()
        out["twice"] = "no error"
    except AssertionError as exc:
        out["twice"] = str(exc)
    got = first_op.receiver()
    second_op.wait()
    out["ll_dispatched"] = (tuple(got.x_RH.shape), got.topk_ids_RK.view(4, 8).tolist(),
                            got.topk_weights_RK.unique().tolist())
    back = ll.finalize(torch.zeros(32, 2048, dtype=BF16), got, workspace=ws)
    out["ll_out"] = tuple(back.shape)
    out["ll_log"] = list(_Buffer.log)
    out["in_flight"] = ll.shared.ll_in_flight
    in_step.stop()

    # Orphans: a destroyed group's buffer goes at the next buffer made.
    side = dist.new_group([0, 1])
    DeepEPHTBackend(_config("deepep_ht"), side)
    side_buffer = _Buffer.made[-1]
    dist.destroy_process_group(side)
    DeepEPLLBackend(_config("deepep_ll", capacity=100), world)  # grows the LL buffer
    out["orphan_destroyed"] = side_buffer.destroyed

    # dbo.destroy_group tears a group's buffers down with it.
    import dbo
    torn = dist.new_group([0, 1])
    DeepEPHTBackend(_config("deepep_ht"), torn)
    torn_buffer = _Buffer.made[-1]
    dbo.destroy_group(torn)
    out["destroy_group"] = torn_buffer.destroyed

    destroy_buffers(world)
    out["destroyed"] = [b.destroyed for b in _Buffer.made]
    _Buffer.nvshmem_qp_depth = 8
    try:
        DeepEPLLBackend(_config("deepep_ll", capacity=8), world)
        out["qp"] = "no error"
    except ValueError as exc:
        out["qp"] = str(exc)
    # The group's buffer (made above, depth 8) is not grown for a capacity that its depth
    # refuses: the refusal comes first (a grown buffer can be tens of GB).
    made = len(_Buffer.made)
    try:
        DeepEPLLBackend(_config("deepep_ll", capacity=100), world)
        out["qp_grow"] = "no error"
    except ValueError as exc:
        out["qp_grow"] = str(exc)
    out["qp_grow_made"] = len(_Buffer.made) - made
    _Buffer.nvshmem_qp_depth = 1024
    try:  # 2**20 tokens: 2**35 bytes by the fake's size hint, beyond DeepEP's int count
        DeepEPLLBackend(_config("deepep_ll", capacity=2**20), world)
        out["too_big"] = "no error"
    except ValueError as exc:
        out["too_big"] = str(exc)
    # Growing the LL buffer (made above at capacity 8) where DeepEP's remake fails: the
    # old buffer is destroyed once, and the group's teardown does not destroy it again.
    _Buffer.fail = True
    try:
        DeepEPLLBackend(_config("deepep_ll", capacity=200), world)
        out["failed_grow"] = "no error"
    except RuntimeError as exc:
        out["failed_grow"] = str(exc)
    _Buffer.fail = False
    destroy_buffers(world)
    out["destroyed_after_failed_grow"] = [b.destroyed for b in _Buffer.made]
    return out


@pytest.mark.distributed
def test_adapters_share_buffers_chain_events_and_run_each_hook_once():
    for out in run_distributed(2, _fake_worker):
        assert out["ht_shared"], out
        assert out["ht_args"] == dict(nvl=1000 * 4096 + 2, rdma=0, ll=False, qps=1,
                                      explicit=True)
        assert out["graph_safe"] == (False, True)
        assert out["grown"] == (1, True, 1000 * 6144 + 2)
        assert out["ht_plain_log"] == [("layout", None, False),
                                       ("dispatch", None, False, 0, (5, 3072), True),
                                       ("combine", None, False, (5, 3072))]
        assert out["ht_plain"]
        assert out["ht_log"] == [
            ("layout", "captured", True),
            ("dispatch", "layout_done", True, 0, (5, 3072), True),
            ("wait", "dispatch_done"),
            ("combine", "captured", True, (5, 3072)),
            ("wait", "combine_done")]
        assert out["ht_shapes"] == ((5, 2880), (5, 2880), True, True)
        assert out["ll_capacity"] == 4  # 3 rounded up: 2 ranks x 4 is a multiple of 4
        assert out["ll_args"] == dict(nvl=0, rdma=4 * 2048 * 2 * 8, ll=True, qps=4,
                                      explicit=True)
        assert out["third"].startswith("more than two DeepEP low-latency operations")
        assert out["twice"] == "a DeepEP receive hook ran twice"
        assert out["ll_dispatched"] == ((32, 2048), [
            [0, 0, -1, -1, -1, -1, -1, -1], [-1] * 8, [2] * 8, [3] + [-1] * 7], [1.0])
        assert out["ll_out"] == (3, 2048)
        assert out["ll_plain"] == (True, 0)
        assert out["ll_plain_log"] == [("ll_dispatch", False), ("ll_combine", False)]
        assert out["ll_log"] == [("ll_dispatch", True), ("ll_dispatch", True),
                                 ("ll_dispatch", True),  # the refused third: sent, never counted
                                 ("recv", "dispatch"), ("recv", "dispatch"),
                                 ("ll_combine", True), ("recv", "combine")]
        assert out["in_flight"] == 0
        assert out["orphan_destroyed"] == 1
        assert out["destroy_group"] == 1
        assert all(d == 1 for d in out["destroyed"]), out["destroyed"]
        assert "NVSHMEM queue depth of at least 18" in out["qp"]
        assert "NVSHMEM queue depth of at least 202, and DeepEP was given 8" in out["qp_grow"]
        assert out["qp_grow_made"] == 0
        assert "needs a 32.0 GiB low-latency buffer, beyond DeepEP's 32 GiB" in out["too_big"]
        assert out["failed_grow"].startswith("Failed: Assertion error")
        assert all(d == 1 for d in out["destroyed_after_failed_grow"]), out


# ---------------------------------------------------------------- Layer 1: host cost

def test_ht_inputs_already_in_deepeps_dtypes_pass_through_without_a_call():
    """`deepep_ht` hands DeepEP its inputs as they are when their dtype and layout are
    already the ones it takes (no `to`/`contiguous` call per dispatch), else converts."""
    from moe.backends.deepep_ht import _as

    ids = torch.arange(6).view(3, 2)
    assert _as(ids, torch.int64) is ids
    as_int32 = _as(ids, torch.int32)
    assert as_int32.dtype == torch.int32 and torch.equal(as_int32, ids.int())
    strided = ids.t()
    out = _as(strided, torch.int64)
    assert out is not strided and out.is_contiguous() and torch.equal(out, strided)
