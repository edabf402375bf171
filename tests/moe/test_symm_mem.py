"""Backend `symm_mem` (`moe.backends.symm_mem`).

Layer 1 (CPU): constructing it refuses in one line saying what is missing (torch's op,
the op's schema, CUDA, NVSHMEM, the capacity, a process group); its buffers' row strides
and send sizes follow the op's block split; a shared set is found, never made, inside a
CUDA graph capture; on the Triton path (interpreted) the send order is one kernel and
every call equals the torch path's bit for bit.
Layer 2 (two gloo processes): the backend's packing, receive masking and combine, with a
stand-in for `torch.ops.symm_mem.all_to_all_vdev` made of gloo collectives (the same
contract: counts on the device in, rows back to back in rank order and the received
counts out): bit-exact against `a2a` on the same routing, DBO off and on, a zero-token
rank, all tokens to one expert; a stack of layers shares two sets (one per ubatch), a
layer of another hidden size gets its own, and `dbo.destroy_group` drops them. The real
op runs in `tests/moe/test_gpu_symm_mem.py`.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist

import moe.backends.symm_mem as symm_backend
import moe.backends.symm_mem_support as support
import dbo
from dbo import UBatchScheduler
from moe import MoEConfig, MoELayer, init_moe_weights
from moe.kernels.policy import KernelPolicy
from moe.workspace import Workspace
from moe.backends.symm_mem_support import (SymmBuffers, num_shared_sets, padded,
                                           release_buffers, row_alignment, shared_buffers)
from tests.dist_utils import run_distributed


def make_layer(**overrides: Any) -> MoELayer:
    cfg = MoEConfig(**{**dict(num_experts=4, top_k=2, hidden_size=8, intermediate_size=8,
                              backend="symm_mem", max_tokens_per_rank=8), **overrides})
    return MoELayer(cfg)


def one_line(exc: pytest.ExceptionInfo) -> str:
    message = str(exc.value)
    assert "\n" not in message and "backend 'symm_mem'" in message
    return message


# ------------------------------------------------------------------------------- layer 1
def test_without_the_op_refuses_naming_it(monkeypatch):
    monkeypatch.setattr(support, "OP_NAME", "no_such_op")
    with pytest.raises(ImportError) as exc:
        make_layer()
    assert "needs torch.ops.symm_mem.no_such_op" in one_line(exc)
    assert "use backend 'a2a'" in str(exc.value)


def test_with_another_schema_refuses_showing_it(monkeypatch):
    monkeypatch.setattr(support, "OP_ARGUMENTS", support.OP_ARGUMENTS[:-1])
    with pytest.raises(ImportError) as exc:
        make_layer()
    assert "but this torch" in one_line(exc) and "all_to_all_vdev(Tensor input" in str(exc.value)


def test_without_cuda_refuses(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError) as exc:
        make_layer()
    assert "this process has no CUDA device" in one_line(exc)


def test_without_nvshmem_refuses(monkeypatch):
    import torch.distributed._symmetric_memory as symm

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(symm, "is_nvshmem_available", lambda: False)
    with pytest.raises(ImportError) as exc:
        make_layer()
    assert "needs NVSHMEM (libnvshmem_host.so.3" in one_line(exc)


def test_without_a_capacity_or_a_group_refuses(monkeypatch):
    with pytest.raises(ValueError) as exc:
        make_layer(max_tokens_per_rank=None)
    assert "needs MoEConfig.max_tokens_per_rank" in one_line(exc)
    monkeypatch.setattr(symm_backend, "require_symm_mem", lambda: None)
    with pytest.raises(ValueError) as exc:
        make_layer()
    assert "needs an expert-parallel process group" in one_line(exc)


@pytest.mark.parametrize("world_size", [2, 3, 4, 8])
def test_buffers_split_evenly_over_the_ops_blocks(world_size):
    """Each peer's bytes divide by the op's blocks per peer whatever its row count, into
    16-byte-aligned shares (NVSHMEM's block copy is fast only aligned): row strides are
    multiples of 16 x those blocks, and send buffers are big enough for the most blocks."""
    align = row_alignment(world_size)
    for blocks in (64, 16):
        per_peer = max(blocks // world_size, 1)
        for rows in (1, 3, 4093):  # every block's share of a peer's rows is 16-aligned
            share, rest = divmod(rows * padded(14432, align), per_peer)
            assert rest == 0 and share % 16 == 0, (world_size, blocks, rows)
    bufs = SymmBuffers.build(lambda shape, kind: torch.empty(shape, dtype=kind), rows=6,
                             row_bytes=56, hidden=8, dtype=torch.bfloat16,
                             world_size=world_size, device=torch.device("cpu"))
    assert bufs.send_XB.shape[1] == bufs.recv_NB.shape[1] == padded(56, align)
    assert bufs.back_send_YH.shape[1] * 2 % align == 0 and bufs.back_send_YH.shape[1] >= 8
    assert bufs.recv_NB.shape[0] == bufs.back_recv_NH.shape[0] == 6
    for send in (bufs.send_XB, bufs.back_send_YH):
        assert send.numel() * send.element_size() >= 4 << 20
    assert bufs.got_D.shape == bufs.got_C.shape == (2, world_size)
    assert torch.equal(bufs.row_N1[:, 0], torch.arange(6))


class FakeGroup:
    """Stands for a process group where only its identity matters (held weakly)."""


def test_a_shared_set_is_found_but_never_made_inside_a_capture(monkeypatch):
    group, device = FakeGroup(), torch.device("cuda", 0)
    made: list[SymmBuffers] = []

    def make() -> SymmBuffers:
        made.append(SymmBuffers.build(lambda shape, kind: torch.zeros(shape, dtype=kind),
                                      rows=4, row_bytes=32, hidden=8, dtype=torch.float32,
                                      world_size=2, device=torch.device("cpu")))
        return made[-1]

    try:
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
        first = shared_buffers(group, (0, "layout"), device=device, make=make)
        assert shared_buffers(group, (0, "layout"), device=device, make=make) is first
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
        assert shared_buffers(group, (0, "layout"), device=device, make=make) is first
        with pytest.raises(RuntimeError, match="inside a CUDA graph capture"):
            shared_buffers(group, (1, "layout"), device=device, make=make)
        assert len(made) == 1 and num_shared_sets(group) == 1
    finally:
        release_buffers(group)
    assert num_shared_sets(group) == 0


def loopback_backend(monkeypatch: pytest.MonkeyPatch, group: Any,
                     kernels: KernelPolicy = KernelPolicy()) -> Any:
    """A symm_mem backend of two ranks in one process: the op sends every row back to
    this rank (rows back to back from row 0, counts in got[0]), the buffers are plain."""
    import torch.distributed._symmetric_memory as symm

    def op(inp: torch.Tensor, out: torch.Tensor, in_splits: torch.Tensor,
           got: torch.Tensor, group_name: str) -> None:
        sent = int(in_splits.sum())
        out[:sent].copy_(inp[:sent])
        got[0].copy_(in_splits)

    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(symm_backend, "require_symm_mem", lambda: op)
    monkeypatch.setattr(symm, "enable_symm_mem_for_group", lambda name: None, raising=False)
    monkeypatch.setattr(SymmBuffers, "allocate", staticmethod(
        lambda *, group_name, **sizes: SymmBuffers.build(
            lambda shape, kind: torch.zeros(shape, dtype=kind), **sizes)))
    cfg = MoEConfig(num_experts=4, top_k=2, hidden_size=8, intermediate_size=8,
                    backend="symm_mem", max_tokens_per_rank=4, kernels=kernels)
    return symm_backend.SymmMemBackend(cfg, group)


def test_the_layout_and_views_are_made_once_and_show_each_calls_rows(monkeypatch):
    """The row layout (and its workspace name) once per backend, the buffer views once
    per workspace; every call's receiver still reads that call's rows through them."""
    from moe.row_layout import RowLayout
    from moe.workspace import Workspace

    group = FakeGroup()
    group.group_name = "fake"  # type: ignore[attr-defined]
    backend = loopback_backend(monkeypatch, group)
    layouts, views = [], []

    views_of = symm_backend.SymmViews.of
    monkeypatch.setattr(symm_backend, "RowLayout",
                        lambda *a: layouts.append(RowLayout(*a)) or layouts[-1])
    monkeypatch.setattr(symm_backend.SymmViews, "of",
                        staticmethod(lambda *a: views.append(views_of(*a)) or views[-1]))
    workspaces = [Workspace(), Workspace()]
    try:
        for step in range(3):
            for workspace in workspaces:
                gen = torch.Generator().manual_seed(step)
                x = torch.randn(3, 8, generator=gen)
                ids = torch.randint(0, 4, (3, 2), generator=gen)
                weights = torch.rand(3, 2, generator=gen)
                got = backend.prepare(x, weights, ids, workspace=workspace)
                bufs = got.handle.views.buffers
                _, weights_NK, x_NH = RowLayout(8, 2, x.dtype).unpack(bufs.recv_NB)
                sent = int(bufs.got_D[0].sum())
                assert sent > 0 and torch.equal(got.x_RH, x_NH)
                assert torch.equal(got.topk_weights_RK, weights_NK)
                assert torch.equal(got.x_RH[:sent].sort(0).values,
                                   torch.cat([x[(ids // 2 == w).any(1)] for w in (0, 1)])
                                   .sort(0).values)
                out = backend.finalize(got.x_RH, got, workspace=workspace)
                assert out.shape == x.shape
        assert len(layouts) == 1
        assert len(views) == 2 and views[0].buffers is views[1].buffers  # one set: no step
    finally:
        release_buffers(group)


@pytest.mark.triton
@pytest.mark.skipif(torch.cuda.is_available(), reason="the loopback's buffers are CPU tensors, "
                    "which Triton takes only interpreted (tests/conftest.py, without CUDA)")
def test_the_triton_path_routes_in_one_kernel_and_matches_torch(monkeypatch):
    """With KernelPolicy "triton" (interpreted here) the send counts, order and slots come
    from `moe.backends.kernels.send_order_triton`, not the torch ops, and every dispatch and
    combine equals the torch path's bit for bit: zero tokens, tokens to one rank only
    (ids -1 beside them), and random ids at the capacity."""
    pytest.importorskip("triton")
    from moe.backends import a2a

    groups = {name: FakeGroup() for name in ("torch", "triton")}
    backends = {}
    for name, group in groups.items():
        group.group_name = name  # type: ignore[attr-defined]
        backends[name] = loopback_backend(monkeypatch, group, KernelPolicy(implementation=name))
    torch_calls: list[str] = []

    def counted(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        return lambda *a: torch_calls.append(name) or fn(*a)

    monkeypatch.setattr(symm_backend, "send_order", counted("send_order", a2a.send_order))
    monkeypatch.setattr(symm_backend, "destination_mask",
                        counted("destination_mask", symm_backend.destination_mask))
    gen = torch.Generator().manual_seed(5)
    cases = [torch.zeros(0, 2, dtype=torch.int64), torch.tensor([[2, -1], [3, 2], [-1, 3]]),
             torch.randint(-1, 4, (4, 2), generator=gen)]
    try:
        for ids in cases:
            x = torch.randn(ids.shape[0], 8, generator=gen)
            weights = torch.rand(ids.shape, generator=gen)
            outs = {}
            for name, backend in backends.items():
                torch_calls.clear()
                got = backend.prepare(x, weights, ids, workspace=Workspace())
                assert torch_calls == ([] if name == "triton" else
                                       ["destination_mask", "send_order"]), (name, torch_calls)
                splits = got.handle.views.buffers.splits_D.clone()
                out = backend.finalize(got.x_RH * 2, got, workspace=Workspace())
                outs[name] = (splits, got.handle.slot_TW, got.x_RH, got.topk_ids_RK,
                              got.topk_weights_RK, out)
            for want, have in zip(outs["torch"], outs["triton"]):
                assert want.dtype == have.dtype and torch.equal(want, have), ids
    finally:
        for group in groups.values():
            release_buffers(group)


# ------------------------------------------------------------------------------- layer 2
def stand_in_op(group: dist.ProcessGroup) -> Callable[..., None]:
    """`all_to_all_vdev(input, out, in_splits, out_splits_offsets, group_name)` from gloo
    collectives: it reads the counts on the host, which the real op never does."""
    def op(inp: torch.Tensor, out: torch.Tensor, in_splits: torch.Tensor,
           got: torch.Tensor, group_name: str) -> None:
        counts = torch.empty_like(in_splits)
        dist.all_to_all_single(counts, in_splits.clone(), group=group)
        got[0].copy_(counts)
        got[1].copy_(torch.cumsum(counts, 0) - counts)
        send, recv = in_splits.tolist(), counts.tolist()
        dist.all_to_all_single(out[:sum(recv)], inp[:sum(send)].contiguous(), recv, send,
                               group=group)
    return op


def install_stand_in(group: dist.ProcessGroup) -> list[dict[str, Any]]:
    """In a rank process: the stand-in op, plain tensors for the symmetric buffers.
    Returns the list of the sizes of every set allocated from now on."""
    import torch.distributed._symmetric_memory as symm

    allocated: list[dict[str, Any]] = []

    def allocate(*, group_name: str, **sizes: Any) -> SymmBuffers:
        allocated.append(sizes)
        return SymmBuffers.build(lambda shape, kind: torch.zeros(shape, dtype=kind), **sizes)

    symm_backend.require_symm_mem = lambda: stand_in_op(group)
    SymmBuffers.allocate = staticmethod(allocate)  # type: ignore[method-assign]
    symm.enable_symm_mem_for_group = lambda name: None
    return allocated


def to_one_expert(logits_TE: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.zeros(logits_TE.shape[0], top_k, dtype=torch.int64, device=logits_TE.device)
    return torch.ones(ids.shape, device=logits_TE.device), ids


#: name -> (MoEConfig overrides, tokens on rank 0 and rank 1)
SCENARIOS: dict[str, tuple[dict, tuple[int, int]]] = {
    "uneven": (dict(), (13, 6)),
    "zero_token_rank": (dict(), (0, 9)),
    "one_expert": (dict(top_k=1, custom_routing_function=to_one_expert), (10, 7)),
    "shared_expert": (dict(num_shared_experts=1), (5, 12)),
}


def compare_with_a2a(rank: int, world_size: int, dtype_name: str, experts: str,
                     stand_in: bool, against: str = "a2a") -> dict[str, list[bool]]:
    """Per scenario: whether symm_mem's output equals `against`'s bit for bit, DBO off,
    DBO on (two ubatches), and DBO on as the model's last layer (against its DBO on).
    The reference experts give each expert the same rows in a2a and symm_mem (padding
    rows have ids -1); the triton experts pick their tiles by the row count, which
    symm_mem shares with a2a_ll (N = W*C rows), not with a2a."""
    device = torch.device("cpu") if stand_in else torch.device("cuda", rank)
    if stand_in:
        install_stand_in(dist.group.WORLD)
    dtype = getattr(torch, dtype_name)
    results = {}
    for name, (overrides, tokens) in SCENARIOS.items():
        cfg = MoEConfig(**{**dict(num_experts=8, top_k=2, hidden_size=32,
                                  intermediate_size=16, max_tokens_per_rank=16,
                                  dtype=dtype, experts=experts), **overrides})
        weights = init_moe_weights(cfg, seed=11, device=device)
        layers = {}
        for backend in (against, "symm_mem"):
            layers[backend] = MoELayer(replace(cfg, backend=backend), group=dist.group.WORLD,
                                       device=device)
            layers[backend].load_weights(weights)
            if cfg.num_shared_experts:
                layers[backend].shared_experts.load_state_dict(
                    layers[against].shared_experts.state_dict())
        gen = torch.Generator(device=device).manual_seed(100 * rank + len(name))
        x = torch.randn(tokens[rank], cfg.hidden_size, generator=gen, device=device).to(dtype)
        half = x.shape[0] // 2
        outs: dict[str, list[torch.Tensor]] = {}
        with torch.no_grad():
            for backend, layer in layers.items():
                outs[backend] = [layer(x)]
                for last in (False, True):
                    layer.last_layer = last
                    outs[backend].append(torch.cat(UBatchScheduler(device).run(
                        [lambda: layer(x[:half]), lambda: layer(x[half:])])))
        if device.type == "cuda":
            torch.cuda.synchronize()
        # As the last layer a2a splits its combine (its own rows' experts run apart, so
        # their sums may round differently); symm_mem cannot, and runs as plain DBO.
        a2a_off, a2a_on, _ = outs[against]
        results[name] = [torch.equal(a, b) and a.shape == (tokens[rank], cfg.hidden_size)
                         for a, b in zip((a2a_off, a2a_on, a2a_on), outs["symm_mem"])]
    return results


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_matches_a2a_bit_for_bit_with_a_stand_in_op(dtype_name):
    for rank, results in enumerate(run_distributed(2, compare_with_a2a, dtype_name,
                                                   "reference", True)):
        for name, same in results.items():
            assert same == [True, True, True], (rank, name, same)


def run_stack(layers: list[MoELayer], x_TH: torch.Tensor, dbo_on: bool) -> torch.Tensor:
    """The layers one after another, in two ubatches when `dbo_on`."""
    def run(x: torch.Tensor) -> torch.Tensor:
        for layer in layers:
            x = layer(x)
        return x

    if not dbo_on:
        return run(x_TH)
    half = x_TH.shape[0] // 2
    return torch.cat(UBatchScheduler(x_TH.device).run([lambda: run(x_TH[:half]),
                                                       lambda: run(x_TH[half:])]))


def shared_sets_worker(rank: int, world_size: int) -> dict[str, Any]:
    """Three symm_mem layers on one group against three a2a layers (same weights), DBO
    off then on; then a wider layer; then the group's teardown."""
    group = dbo.new_group()
    allocated = install_stand_in(group)
    cfg = MoEConfig(num_experts=8, top_k=2, hidden_size=32, intermediate_size=16,
                    max_tokens_per_rank=16, experts="reference")
    stacks: dict[str, list[MoELayer]] = {}
    for backend in ("a2a", "symm_mem"):
        stacks[backend] = []
        for seed in (1, 2, 3):
            layer = MoELayer(replace(cfg, backend=backend), group=group)
            layer.load_weights(init_moe_weights(cfg, seed=seed))
            stacks[backend].append(layer)
    x = torch.randn(11 + 3 * rank, 32, generator=torch.Generator().manual_seed(rank))
    out: dict[str, Any] = {}
    with torch.no_grad():
        out["same"] = [torch.equal(run_stack(stacks["a2a"], x, on),
                                   run_stack(stacks["symm_mem"], x, on))
                       for on in (False, True)]
        out["sets"] = (len(allocated), num_shared_sets(group))
        wide = MoELayer(replace(cfg, backend="symm_mem", hidden_size=64), group=group)
        wide.load_weights(init_moe_weights(replace(cfg, hidden_size=64), seed=4))
        for on in (False, True):
            run_stack([wide], torch.randn(7, 64), on)
    out["wide_sets"] = (len(allocated), num_shared_sets(group))
    out["hidden"] = [sizes["hidden"] for sizes in allocated]
    dbo.destroy_group(group)
    out["after_destroy"] = num_shared_sets(group)
    return out


def test_layers_of_a_group_share_two_sets_and_stay_exact():
    """Three layers make two sets (one per ubatch), not six; bit-exact against a2a DBO
    off and on; a layer of another hidden size makes its own two; the group's teardown
    drops them all."""
    for rank, out in enumerate(run_distributed(2, shared_sets_worker)):
        assert out["same"] == [True, True], (rank, out)
        assert out["sets"] == (2, 2), (rank, out)
        assert out["wide_sets"] == (4, 4) and out["hidden"] == [32, 32, 64, 64], (rank, out)
        assert out["after_destroy"] == 0, (rank, out)
