"""The routing align (layer 3: the Triton interpreter on CPU; GPU-marked on CUDA):
`moe.kernels.fused_moe.align` (torch) and its Triton twin `moe.kernels.fused_moe.align_triton`, the layout
checked on its own, then the Triton one equal to the torch one.

Cost under the interpreter: every program runs in Python, and the Triton align sorts
more than 64 routed rows as one 1024-key chunk (seconds).
"""
from __future__ import annotations

import pytest
import torch

from moe.kernels.fused_moe.align import align_routing, max_padded_rows
from moe.kernels.fused_moe.align_triton import align_routing_triton
from moe.workspace import Workspace
from tests.moe.triton_problems import DEVICE, needs_triton  # noqa: F401 (fixture)

pytestmark = [pytest.mark.triton, pytest.mark.usefixtures("needs_triton")]


# At most 64 routed rows (one SMALL_CHUNK by default), except the last case: the only
# one whose default chunk is CHUNK (1024 rows), each a sort of seconds when interpreted.
ALIGN_CASES = [
    (1, 1, 1, 16, 0.0),
    (7, 2, 64, 16, 0.0),  # most experts empty
    (40, 1, 1, 16, 0.0),  # one expert, three blocks
    (8, 8, 8, 32, 0.25),  # ids -1 in the mix
    (16, 4, 5, 16, 1.0),  # everything dropped
    (21, 3, 4, 64, 0.1),
    # 68 blocks of one expert and 117 dropped rows: by default two chunks of CHUNK rows,
    # the second mostly past the last row; the blocks take two scan steps (_BLOCK_STEP).
    (1200, 1, 1, 16, 0.1),
]

# (*ALIGN_CASES row, chunk). None: the default chunk. 16: many count/scatter programs,
# for the cases of more than 16 routed rows (at most 16 make one chunk either way: one
# count and one scatter program, only their sort's width differs). The last row, 19
# chunks of 16, makes the scan read their histograms in two steps of _CHUNK_STEP (16),
# the second partial, as the 1200-row case's 75 chunks did in five, at a quarter of its
# interpreted programs.
TRITON_ALIGN_CASES = [
    *[(*case, None) for case in ALIGN_CASES],
    *[(*case, 16) for case in ALIGN_CASES[:-1] if case[0] * case[1] > 16],
    (300, 1, 1, 16, 0.1, 16),
]


def _random_ids(num_tokens: int, top_k: int, num_experts: int, drop_frac: float) -> torch.Tensor:
    gen = torch.Generator().manual_seed(num_tokens * 31 + top_k)
    ids = torch.randint(0, num_experts, (num_tokens, top_k), generator=gen)
    return ids.masked_fill(torch.rand(num_tokens, top_k, generator=gen) < drop_frac, -1)


@pytest.mark.parametrize("num_tokens, top_k, num_experts, block_m, drop_frac", ALIGN_CASES)
def test_align_layout(
    num_tokens: int, top_k: int, num_experts: int, block_m: int, drop_frac: float
) -> None:
    ids = _random_ids(num_tokens, top_k, num_experts, drop_frac)
    routing = align_routing(ids.to(DEVICE), num_experts, block_m)

    num_routed = num_tokens * top_k
    sorted_ids = routing.sorted_ids_P.cpu().long()
    block_experts = routing.block_expert_ids_B.cpu().long()
    used = int(routing.num_padded_rows.item())
    assert routing.num_routed == num_routed and routing.block_m == block_m
    assert sorted_ids.numel() == max_padded_rows(num_routed, num_experts, block_m)
    assert sorted_ids.numel() % block_m == 0
    assert block_experts.numel() == sorted_ids.numel() // block_m
    assert used % block_m == 0 and used <= sorted_ids.numel()
    assert (sorted_ids[used:] == num_routed).all(), "rows past the used range are padding"
    assert (block_experts[used // block_m :] == -1).all(), "idle blocks carry expert -1"

    # Every (token, k) appears exactly once, in a block of its expert (-1: dropped block).
    real = sorted_ids[:used] < num_routed
    assert sorted(sorted_ids[:used][real].tolist()) == list(range(num_routed))
    row_expert = block_experts[:used // block_m].repeat_interleave(block_m)
    flat_ids = ids.reshape(-1)
    assert torch.equal(row_expert[real], flat_ids[sorted_ids[:used][real]])

    # Segments: experts ascending, dropped last, each padded to a multiple of BLOCK_M with
    # the fewest blocks; token order kept inside a segment.
    blocks = block_experts[: used // block_m]
    segment_order = torch.where(blocks < 0, num_experts, blocks)
    assert torch.equal(segment_order, segment_order.sort().values)
    for expert in range(-1, num_experts):
        count = int((flat_ids == expert).sum())
        assert int((blocks == expert).sum()) == -(-count // block_m)
        rows = sorted_ids[:used][real & (row_expert == expert)]
        assert torch.equal(rows, rows.sort().values)

    # Tile table: the blocks of experts (no padding-only, dropped or idle block), those
    # with more than half their rows used first, then the half-used ones, each in order.
    num_full, num_half = routing.num_tiles.cpu().tolist()
    tiles = routing.tile_rows_B.cpu().long()[: num_full + num_half]
    used_rows = real.view(-1, block_m).sum(1)
    is_expert = blocks >= 0
    want_full = (torch.nonzero(is_expert & (used_rows > block_m // 2)).view(-1)) * block_m
    want_half = torch.nonzero(is_expert & (used_rows > 0) & (used_rows <= block_m // 2))
    assert torch.equal(tiles[:num_full], want_full)
    assert torch.equal(tiles[num_full:], want_half.view(-1) * block_m)


def assert_same_routing(ids: torch.Tensor, num_experts: int, block_m: int, **kwargs: int) -> None:
    """The Triton align equals the torch one (whose layout test_align_layout checks) on
    every row that is read: the used rows and all block entries."""
    want = align_routing(ids, num_experts, block_m)
    got = align_routing_triton(ids, num_experts, block_m, **kwargs)
    used = int(want.num_padded_rows.item())
    assert int(got.num_padded_rows.item()) == used
    assert (got.block_m, got.num_routed) == (want.block_m, want.num_routed)
    assert got.sorted_ids_P.shape == want.sorted_ids_P.shape
    assert torch.equal(got.sorted_ids_P[:used], want.sorted_ids_P[:used])
    assert torch.equal(got.block_expert_ids_B, want.block_expert_ids_B)
    assert torch.equal(got.num_tiles, want.num_tiles)
    num_tiles = int(want.num_tiles.sum())
    assert torch.equal(got.tile_rows_B[:num_tiles], want.tile_rows_B[:num_tiles])


@pytest.mark.parametrize("num_tokens, top_k, num_experts, block_m, drop_frac, chunk",
                         TRITON_ALIGN_CASES)
def test_triton_align_matches_torch(
    num_tokens: int, top_k: int, num_experts: int, block_m: int, drop_frac: float,
    chunk: int | None,
) -> None:
    ids = _random_ids(num_tokens, top_k, num_experts, drop_frac).to(DEVICE)
    assert_same_routing(ids, num_experts, block_m, chunk=chunk)


def test_triton_align_int32_empty_and_workspace() -> None:
    ids = _random_ids(9, 4, 6, 0.2).to(DEVICE)
    assert_same_routing(ids.int(), 6, 16, chunk=16)
    empty = align_routing_triton(torch.empty(0, 4, dtype=torch.int64, device=DEVICE), 8, 16)
    assert empty.sorted_ids_P.numel() == 0 and int(empty.num_padded_rows.item()) == 0
    ws = Workspace()
    first = align_routing_triton(ids, 6, 16, workspace=ws)
    allocations = ws.num_allocations
    again = align_routing_triton(ids[:5], 6, 16, workspace=ws)
    assert ws.num_allocations == allocations, "the smaller call reuses every buffer"
    assert again.sorted_ids_P.data_ptr() == first.sorted_ids_P.data_ptr()
    with pytest.raises(ValueError, match="chunk must be a power of two"):
        align_routing_triton(ids, 6, 16, chunk=24)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens, num_experts, block_m", [(8192, 128, 128), (3000, 32, 64),
                                                              (1, 256, 16)])
def test_gpu_triton_align_matches_torch(num_tokens: int, num_experts: int, block_m: int) -> None:
    ids = _random_ids(num_tokens, 8, num_experts, 0.4).to(DEVICE)
    assert_same_routing(ids, num_experts, block_m)


def test_align_empty_and_workspace() -> None:
    routing = align_routing(torch.empty(0, 4, dtype=torch.int64, device=DEVICE), 8, 16)
    assert routing.sorted_ids_P.numel() == 0 and int(routing.num_padded_rows.item()) == 0

    ws = Workspace()
    ids = torch.tensor([[2, 0], [1, -1], [2, 2]], device=DEVICE)
    first = align_routing(ids, 3, 16, workspace=ws)
    again = align_routing(ids[:2], 3, 16, workspace=ws)
    assert ws.num_allocations == 3, "sorted ids, block experts and tiles, reused by the smaller call"
    assert again.sorted_ids_P.data_ptr() == first.sorted_ids_P.data_ptr()
    num_blocks = int(again.num_padded_rows.item()) // 16
    assert again.block_expert_ids_B[:num_blocks].tolist() == [0, 1, 2, -1]


def test_align_rejects_bad_block_m() -> None:
    with pytest.raises(ValueError, match="power of two"):
        align_routing(torch.zeros(2, 1, dtype=torch.int64), 1, 24)
