"""Layer 1 (CPU): `moe.workspace` -- reuse, growth only on larger requests, per-ubatch independence."""
from __future__ import annotations

import pytest
import torch

from moe.workspace import Workspace, WorkspaceSets, empty_from

CPU = torch.device("cpu")


def test_reuse_same_request() -> None:
    ws = Workspace()
    a = ws.get("x", (4, 8), torch.float32, CPU)
    b = ws.get("x", (4, 8), torch.float32, "cpu")
    assert a.shape == (4, 8) and a.dtype == torch.float32 and a.is_contiguous()
    assert a.data_ptr() == b.data_ptr()
    assert ws.num_allocations == 1


def test_grows_only_on_larger_request() -> None:
    ws = Workspace()
    big = ws.get("x", (16, 16), torch.float32, CPU)
    nbytes = ws.nbytes
    assert nbytes >= 16 * 16 * 4
    small = ws.get("x", (3, 5), torch.float32, CPU)  # smaller: a view of the same buffer
    assert small.data_ptr() == big.data_ptr() and ws.num_allocations == 1
    assert ws.nbytes == nbytes  # never shrinks
    ws.get("x", (16, 16), torch.bfloat16, CPU)  # other dtype, fewer bytes: reinterpreted
    assert ws.num_allocations == 1
    grown = ws.get("x", (64, 64), torch.float32, CPU)
    assert ws.num_allocations == 2 and ws.nbytes >= 64 * 64 * 4
    assert grown.shape == (64, 64)
    ws.get("x", (16, 16), torch.float32, CPU)
    assert ws.num_allocations == 2


def test_names_are_independent_and_no_growth_after_warmup() -> None:
    ws = Workspace()
    shapes = [(7, 3), (128, 5), (1, 1), (40, 12)]
    for n, m in shapes:  # warmup over all sizes
        ws.get("a", (n, m), torch.float32, CPU)
        ws.get("b", (n, 2 * m), torch.bfloat16, CPU)
    a = ws.get("a", (2, 2), torch.float32, CPU)
    b = ws.get("b", (2, 2), torch.float32, CPU)
    assert a.data_ptr() != b.data_ptr()
    allocations, nbytes = ws.num_allocations, ws.nbytes
    for _ in range(3):
        for n, m in reversed(shapes):
            ws.get("a", (n, m), torch.float32, CPU)
            ws.get("b", (n, 2 * m), torch.bfloat16, CPU)
    assert (ws.num_allocations, ws.nbytes) == (allocations, nbytes)


def test_views_write_through_and_zero_size() -> None:
    ws = Workspace()
    view = ws.get("x", (2, 3), torch.float32, CPU)
    view.fill_(7.0)
    assert torch.equal(ws.get("x", (6,), torch.float32, CPU), torch.full((6,), 7.0))
    empty = ws.get("y", (0, 5), torch.float16, CPU)
    assert empty.shape == (0, 5) and empty.dtype == torch.float16
    assert ws.num_allocations == 1
    with pytest.raises(ValueError, match="negative"):
        ws.get("z", (-1, 2), torch.float32, CPU)


def test_freeze() -> None:
    ws = Workspace()
    ws.get("x", (1024,), torch.float32, CPU)
    ws.freeze()
    ws.get("x", (4,), torch.float32, CPU)  # fits: fine
    with pytest.raises(RuntimeError, match="frozen"):
        ws.get("x", (1025,), torch.float32, CPU)
    with pytest.raises(RuntimeError, match="frozen"):
        ws.get("new", (1,), torch.float32, CPU)
    ws.clear()
    assert ws.nbytes == 0 and not ws.frozen


def test_workspace_sets_are_independent() -> None:
    sets = WorkspaceSets(num_ubatches=2)
    assert sets.num_ubatches == 2
    ws0, ws1 = sets.for_ubatch(0), sets.for_ubatch(1)
    assert ws0 is not ws1 and sets.for_ubatch(0) is ws0
    a0 = ws0.get("x", (4, 4), torch.float32, CPU)
    a1 = ws1.get("x", (4, 4), torch.float32, CPU)
    assert a0.data_ptr() != a1.data_ptr()
    a0.fill_(1.0)
    a1.fill_(2.0)
    assert torch.all(a0 == 1.0)
    ws1.get("x", (1000,), torch.float32, CPU)
    assert ws0.num_allocations == 1 and ws1.num_allocations == 2
    assert sets.num_allocations == 3 and sets.nbytes == ws0.nbytes + ws1.nbytes
    sets.freeze()
    assert ws0.frozen and ws1.frozen
    with pytest.raises(ValueError, match="ubatch_id=2"):
        sets.for_ubatch(2)
    with pytest.raises(ValueError, match="num_ubatches=0"):
        WorkspaceSets(num_ubatches=0)


def test_empty_from() -> None:
    fresh = empty_from(None, "x", (3, 2), torch.bfloat16, CPU)
    assert fresh.shape == (3, 2) and fresh.dtype == torch.bfloat16
    ws = Workspace()
    a = empty_from(ws, "x", (3, 2), torch.bfloat16, CPU)
    b = empty_from(ws, "x", (3, 2), torch.bfloat16, CPU)
    assert a.data_ptr() == b.data_ptr()


def test_repeated_request_returns_the_cached_view_until_the_buffer_grows() -> None:
    ws = Workspace()
    a = ws.get("x", (4, 8), torch.float32, CPU)
    assert ws.get("x", (4, 8), torch.float32, CPU) is a  # the cached view object
    b = ws.get("x", (8, 4), torch.float32, CPU)  # another shape: another view, now cached
    assert b is not a and ws.get("x", (8, 4), torch.float32, CPU) is b
    a = ws.get("x", (4, 8), torch.float32, CPU)  # one entry per name: a new view again
    assert a is not b and a.shape == (4, 8) and len(ws._views) == 1
    other = ws.get("y", (4, 8), torch.float32, CPU)
    assert other.data_ptr() != a.data_ptr()
    ws.get("x", (64, 64), torch.float32, CPU)  # grows: views of the old buffer are dropped
    again = ws.get("x", (4, 8), torch.float32, CPU)
    assert again is not a and again.data_ptr() != a.data_ptr()
    assert ws.get("y", (4, 8), torch.float32, CPU) is other  # other names keep theirs
    ws.clear()
    fresh = ws.get("x", (4, 8), torch.float32, CPU)
    assert fresh is not again and ws.num_allocations == 4


def test_uncached_requests_still_work() -> None:
    """A list shape or an unindexed device string skips the view cache, same result."""
    ws = Workspace()
    a = ws.get("x", [4, 8], torch.float32, "cpu")
    b = ws.get("x", [4, 8], torch.float32, "cpu")
    assert a is not b and a.data_ptr() == b.data_ptr() and b.shape == (4, 8)


def test_keep_makes_once_and_returns_the_same_object_until_clear() -> None:
    ws = Workspace()
    made = []

    def make() -> list[int]:
        made.append(1)
        return [len(made)]

    first = ws.keep("sym", make)
    assert ws.keep("sym", make) is first and made == [1] and ws.num_allocations == 1
    assert ws.keep("other", make) == [2]
    ws.freeze()
    assert ws.keep("sym", make) is first  # made already: a frozen workspace still hands it
    with pytest.raises(RuntimeError, match="'new' is not made yet"):
        ws.keep("new", make)
    ws.clear()
    assert ws.keep("sym", make) == [3]


def test_a_buffer_a_graph_may_hold_is_kept_alive_when_it_grows():
    from streams.graph_capture import GRAPH_CAPTURES

    ws = Workspace()
    ws.get("a", (64,), torch.uint8, "cpu")
    ws.get("a", (4096,), torch.uint8, "cpu")  # no capture since: the old one is freed
    assert ws.pinned_nbytes == 0 and ws.num_allocations == 2
    held = ws.get("a", (4096,), torch.uint8, "cpu")
    GRAPH_CAPTURES.begin()  # a graph captured now may hold `held`'s buffer
    ws.get("a", (4096,), torch.uint8, "cpu")  # fits: nothing moves
    assert ws.pinned_nbytes == 0
    grown = ws.get("a", (8192,), torch.uint8, "cpu")
    assert ws.pinned_nbytes == 4096 and ws.nbytes == 8192
    assert held.untyped_storage().data_ptr() in {
        t.untyped_storage().data_ptr() for t in ws._pinned}
    assert grown.untyped_storage().data_ptr() != held.untyped_storage().data_ptr()
    ws.get("a", (16384,), torch.uint8, "cpu")  # no capture since the last growth
    assert ws.pinned_nbytes == 4096
    ws.clear()
    assert ws.pinned_nbytes == 0 and ws.nbytes == 0
